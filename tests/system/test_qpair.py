"""Queue pair logic against the simulated controller: wrap-around, phase, order, errors,
timeouts and abort on shutdown."""

import numpy as np
import pytest

from ntx_system import spec
from ntx_system.ctrlr import Controller
from ntx_system.qpair import CommandError, CommandTimeout, QpairClosed, QueueFull
from .fake_nvme import FakeNvmeController, FakeNvmeTransport
from ntx_system.spec import IoOpcode

MIB = 1 << 20


def _bring_up(storage_bytes=4 * MIB, *, io_timeout_s=5.0, **sim_kw):
    rng = np.random.default_rng(7)
    storage = rng.integers(0, 256, storage_bytes, dtype=np.uint8)
    sim = FakeNvmeController(storage, **sim_kw)
    t = FakeNvmeTransport(sim)
    ctrl = Controller(t, io_timeout_s=io_timeout_s).start()
    return sim, t, ctrl


def _read_one(ctrl, io, buf, lba, nlb=1, ring=True):
    return ctrl._submit_rw(io, IoOpcode.READ, lba, nlb * 512, buf, lba * 512 % buf.size,
                           ring=ring)


def test_ring_wraps_and_phase_flips_many_times():
    sim, t, ctrl = _bring_up(mqes=4)            # 4-entry ring: 3 outstanding at most
    io = ctrl.io_qpair_create(depth=64)
    qp = io.qpair
    assert qp.entries == 4 and qp.capacity == 3
    buf = t.dma_alloc(64 * 512)
    phases = []
    for i in range(50):                         # 50 commands through a 4-slot ring
        cid = _read_one(ctrl, io, buf, i)
        qp.wait([cid])[cid].check(qp.qid)
        phases.append(qp.phase)
    flips = sum(1 for a, b in zip(phases, phases[1:]) if a != b)
    assert flips == 50 // 4                   # the CQ wrapped 12 times
    assert (buf.view[: 50 * 512] == sim.storage[: 50 * 512]).all()
    assert not sim.faults


@pytest.mark.parametrize("order", ["reverse", "shuffle"])
def test_out_of_order_completions(order):
    sim, t, ctrl = _bring_up(completion_order=order, mqes=32)
    io = ctrl.io_qpair_create(depth=31)
    qp = io.qpair
    buf = t.dma_alloc(31 * 512)
    cids = [_read_one(ctrl, io, buf, i, ring=False) for i in range(31)]
    qp.ring()                                   # one doorbell for the batch
    done = qp.poll()
    got = [c.cid for c in done]
    assert sorted(got) == sorted(cids) and got != cids
    assert (buf.view[: 31 * 512] == sim.storage[: 31 * 512]).all()
    # the freed command ids are reusable at once
    assert qp.can_submit() and qp.outstanding == 0


def test_queue_full_is_an_error_not_a_hang():
    sim, t, ctrl = _bring_up(mqes=4)
    sim.hang_for = lambda cmd: cmd.qid == 1
    io = ctrl.io_qpair_create()
    buf = t.dma_alloc(4096)
    for i in range(3):
        _read_one(ctrl, io, buf, i)
    with pytest.raises(QueueFull):
        _read_one(ctrl, io, buf, 3)


def test_error_status_is_decoded_and_named():
    sim, t, ctrl = _bring_up(mdts=1)           # 8 KiB per command: 16 LBAs
    sim.error_for = lambda cmd: spec.STATUS_UNRECOVERED_READ_ERROR if cmd.qid and cmd.slba == 16 \
        else None
    io = ctrl.io_qpair_create(depth=8)
    buf = t.dma_alloc(64 * 1024)
    with pytest.raises(CommandError) as err:
        ctrl.read_into(io, 0, 64 * 1024, buf)
    assert err.value.status.sct == 2 and err.value.status.sc == 0x81
    assert "unrecovered read error" in str(err.value) and "LBA 16" in str(err.value)
    assert io.qpair.outstanding == 0            # everything in flight was drained first
    # the queue stays usable after an error status
    ctrl.read_into(io, 64 * 1024, 4096, buf)


def test_lba_out_of_range_from_controller():
    sim, t, ctrl = _bring_up()
    io = ctrl.io_qpair_create()
    buf = t.dma_alloc(4096)
    cid = _read_one(ctrl, io, buf, 4 * MIB // 512)        # one past the end
    c = io.qpair.wait([cid])[cid]
    assert c.status == spec.STATUS_LBA_OUT_OF_RANGE


def test_never_completing_command_times_out():
    sim, t, ctrl = _bring_up(io_timeout_s=0.2, mdts=1)
    sim.hang_for = lambda cmd: cmd.qid == 1 and cmd.slba == 16
    io = ctrl.io_qpair_create(depth=8)
    buf = t.dma_alloc(64 * 1024)
    with pytest.raises(CommandTimeout) as err:
        ctrl.read_into(io, 0, 64 * 1024, buf, depth=4)
    assert "did not complete" in str(err.value) and err.value.cid is not None
    with pytest.raises(QpairClosed):            # a timed-out queue refuses new work
        _read_one(ctrl, io, buf, 0)
    ctrl.shutdown()                             # resets the controller, frees everything
    assert t.regions == [buf]


def test_shutdown_aborts_outstanding_and_frees_queues():
    sim, t, ctrl = _bring_up()
    sim.hang_for = lambda cmd: cmd.qid == 1
    io = ctrl.io_qpair_create()
    buf = t.dma_alloc(4096)
    _read_one(ctrl, io, buf, 0)
    assert io.qpair.outstanding == 1
    ctrl.shutdown()
    assert io.qpair.closed and io.qpair.outstanding == 0
    assert t.regions == [buf] and not sim.cc & spec.CC_EN
