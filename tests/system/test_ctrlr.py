"""Controller bring-up state machine and MDTS-sized reads against the simulated controller."""
import numpy as np
import pytest

from ntx_system import spec
from ntx_system.ctrlr import Controller, CtrlrError, CtrlrState
from .fake_nvme import FakeNvmeController, FakeNvmeTransport

MIB = 1 << 20


def _storage(n=8 * MIB, seed=3):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class FakeClock:
    """Time that advances only when the driver sleeps, so CAP.TO waits take no real time."""
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


def test_bring_up_reaches_ready_and_identifies():
    sim = FakeNvmeController(_storage(), serial="SER-XYZ", mdts=5, max_io_queues=2)
    t = FakeNvmeTransport(sim)
    ctrl = Controller(t).start(io_queues=8)
    assert ctrl.state == CtrlrState.READY
    assert ctrl.identity.serial == "SER-XYZ" and ctrl.identity.model == "NTX Simulated NVMe"
    assert ctrl.namespace.lba_size == 512 and ctrl.namespace.size_bytes == 8 * MIB
    assert ctrl.max_transfer == 128 * 1024
    assert ctrl.io_queues_granted == 2
    ctrl.shutdown()
    assert ctrl.state == CtrlrState.CLOSED and t.regions == []


def test_bring_up_from_an_enabled_controller_resets_it_first():
    sim = FakeNvmeController(_storage(MIB))
    t = FakeNvmeTransport(sim)
    Controller(t).start()            # leave it enabled, as a crashed process would
    ctrl = Controller(t).start()
    assert ctrl.state == CtrlrState.READY


def test_never_ready_fails_in_named_state_within_cap_to():
    sim = FakeNvmeController(_storage(MIB), to_ms=2000)
    sim.never_ready = True
    clock = FakeClock()
    ctrl = Controller(FakeNvmeTransport(sim), clock=clock, sleep=clock.sleep)
    with pytest.raises(CtrlrError) as err:
        ctrl.start()
    assert "ENABLE_WAIT_FOR_READY_1" in str(err.value) and "2.0 s" in str(err.value)
    assert ctrl.state == CtrlrState.FAILED
    assert 2.0 <= clock.now < 2.1


def test_admin_error_status_names_state():
    sim = FakeNvmeController(_storage(MIB))
    sim.error_for = lambda cmd: spec.STATUS_INVALID_FIELD if cmd.qid == 0 and cmd.opc == 0x09 \
        else None
    with pytest.raises(CtrlrError) as err:
        Controller(FakeNvmeTransport(sim)).start()
    assert "SET_NUMBER_OF_QUEUES" in str(err.value) and "invalid field" in str(err.value)


@pytest.mark.parametrize("paged", [False, True], ids=["iommu", "noiommu-pages"])
@pytest.mark.parametrize("lba_size", [512, 4096])
def test_read_into_mdts_chunks_prp_lists(paged, lba_size):
    storage = _storage()
    sim = FakeNvmeController(storage, lba_size=lba_size, mdts=6, completion_order="shuffle",
                        mqes=1024)
    t = FakeNvmeTransport(sim, paged=paged)
    ctrl = Controller(t).start()
    io = ctrl.io_qpair_create(depth=8)
    buf = t.dma_alloc(5 * MIB)
    ctrl.read_into(io, 3 * 4096, 5 * MIB - 4096, buf, 4096)
    assert (buf.view[4096:] == storage[3 * 4096: 3 * 4096 + 5 * MIB - 4096]).all()
    assert sim.max_transfer_seen == 256 * 1024          # MDTS=6 -> 64 pages
    assert io.qpair.stats.max_outstanding == 8
    assert not sim.faults
    if paged:
        assert io.qpair.entries <= 64                   # one physically contiguous page
    ctrl.shutdown()


def test_read_into_caller_buffer_and_write_back():
    sim = FakeNvmeController(_storage(MIB))
    t = FakeNvmeTransport(sim)
    ctrl = Controller(t).start()
    io = ctrl.io_qpair_create(depth=4)
    import mmap
    mem = mmap.mmap(-1, 64 * 1024)
    user = np.frombuffer(mem, np.uint8)
    region = t.dma_map(user)
    user[:] = 0xAB
    ctrl.write_from(io, 4096, 64 * 1024, region)
    assert (sim.storage[4096: 4096 + 64 * 1024] == 0xAB).all()
    user[:] = 0
    ctrl.read_into(io, 4096, 64 * 1024, region)
    assert (user == 0xAB).all()
    t.dma_free(region)
    ctrl.shutdown()


def test_read_into_rejects_unaligned_and_out_of_range():
    sim = FakeNvmeController(_storage(MIB))
    t = FakeNvmeTransport(sim)
    ctrl = Controller(t).start()
    io = ctrl.io_qpair_create()
    buf = t.dma_alloc(8192)
    with pytest.raises(ValueError, match="multiples of the LBA size"):
        ctrl.read_into(io, 100, 512, buf)
    with pytest.raises(ValueError, match="end of the namespace"):
        ctrl.read_into(io, MIB, 512, buf)


def test_unmapped_dma_is_recorded_as_a_fault():
    """QEMU completes a read into an unmapped IOVA with success; only the fault log shows it.
    The simulator mimics that, so tests must check `faults` as VM tests check dmesg."""
    sim = FakeNvmeController(_storage(MIB))
    t = FakeNvmeTransport(sim)
    ctrl = Controller(t).start()
    io = ctrl.io_qpair_create()
    cid = io.qpair.submit(spec.IoOpcode.READ, nsid=1, prp1=0xDEAD000, cdw12=0)
    assert io.qpair.wait([cid])[cid].status.ok
    assert sim.faults and "not mapped" in sim.faults[0]


def test_sim_follows_chained_prp_lists():
    """Our driver never needs a chained list (transfers <= 2 MiB), but the simulator handles
    them so a larger cap could be tested."""
    sim = FakeNvmeController(_storage(8 * MIB), mdts=0)
    t = FakeNvmeTransport(sim)
    ctrl = Controller(t, max_transfer_cap=2 * MIB).start()
    io = ctrl.io_qpair_create()
    buf = t.dma_alloc(2 * MIB + 4096)
    ctrl.read_into(io, 0, 2 * MIB, buf, 2048)          # PRP1 with an offset: 513 pages
    assert (buf.view[2048: 2048 + 2 * MIB] == sim.storage[: 2 * MIB]).all()
