"""NvmeStagedSource end to end over the simulated controller: stage a synthetic GGUF into an
image, serve the image from the simulator, read every extent back through our driver."""
import hashlib
import mmap

import numpy as np
import pytest

from ntx_system import staging
from ntx_system.qpair import CommandError
from ntx_system.source import NvmeStagedSource
from ntx_system.spec import STATUS_UNRECOVERED_READ_ERROR

from .fake_nvme import FakeNvmeController, FakeNvmeTransport

from .ggufgen import write_synthetic_gguf


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    d = tmp_path_factory.mktemp("src")
    model = write_synthetic_gguf(d / "m.gguf", n_layers=5, big=40000)
    img = d / "dev.img"
    with open(img, "wb") as f:
        f.truncate(8 << 20)
    staging.stage(str(img), model, lba_size=512)
    return model, np.fromfile(img, np.uint8)


def _open(image, **kw):
    sim = FakeNvmeController(image.copy(), mdts=4, completion_order="shuffle", **kw)
    t = FakeNvmeTransport(sim)
    return sim, t, NvmeStagedSource.open(transport=t, queue_depth=8)


def _pinned(n):
    mem = mmap.mmap(-1, max(n, 1))
    return mem, np.frombuffer(mem, np.uint8)


def test_every_extent_matches_the_file(staged):
    model, image = staged
    data = open(model, "rb").read()
    sim, t, src = _open(image)
    ext = src.extents()
    assert "blk.4" in ext and "nonlayer" in ext and "gguf.meta" in ext
    for name, (off, length) in ext.items():
        mem, buf = _pinned(length)
        assert src.register_buffer(buf)
        buf[:] = 0xEE                                  # poisoned, never zeros
        src.read_into(off, length, buf)
        assert hashlib.sha256(buf[:length]).hexdigest() == \
            hashlib.sha256(data[off:off + length]).hexdigest(), name
        src.unregister_buffer(buf)
    assert src.bytes_direct > 0 and not sim.faults
    src.close()
    assert t.regions == []


def test_unregistered_and_unaligned_reads_bounce(staged):
    model, image = staged
    data = np.frombuffer(open(model, "rb").read(), np.uint8)
    sim, t, src = _open(image)
    off, length = src.extents()["blk.2"]
    dest = np.zeros(length + 3, np.uint8)
    src.read_into(off + 3, length - 3, dest[3:])      # odd offset, odd address, spans extents
    assert (dest[3:length] == data[off + 3: off + length]).all()
    span_off, span_len = off - 100, length + 200        # crosses into the neighbours
    out = bytearray(span_len)
    src.read_into(span_off, span_len, memoryview(out))
    assert bytes(out) == data[span_off: span_off + span_len].tobytes()
    assert src.bytes_direct == 0 and src.bytes_bounced > 0
    tens = src.tensors()
    toff, tlen = tens["blk.3.attn_q.weight"]
    w = np.empty(tlen // 4, np.float32)
    src.read_into(toff, tlen, w)
    assert (w.view(np.uint8) == data[toff:toff + tlen]).all()
    src.close()


def image_tail(image, src):
    last = src.layout.extents[-1]
    end = last.device_offset + last.length
    return bytes(image[end - 10:end])


def test_range_and_buffer_errors(staged):
    _, image = staged
    sim, t, src = _open(image)
    with pytest.raises(ValueError, match="outside the model"):
        src.read_into(src.layout.model_size, 20, bytearray(20))
    tail = bytearray(b"\xee" * 20)                # a read past the end stops at the end
    src.read_into(src.layout.model_size - 10, 20, tail)
    assert bytes(tail[:10]) == image_tail(image, src) and tail[10:] == b"\xee" * 10
    with pytest.raises(ValueError, match="dest holds"):
        src.read_into(0, 20, bytearray(10))
    with pytest.raises(ValueError, match="writable"):
        src.read_into(0, 4, b"abcd")
    src.close()


def test_unstaged_device_is_named(tmp_path):
    sim = FakeNvmeController(1 << 20)
    with pytest.raises(Exception, match="no staged model"):
        NvmeStagedSource.open(transport=FakeNvmeTransport(sim))


def test_parallel_reads_on_several_queues_count_bytes_and_errors(staged):
    """Two queue pairs: two threads read at once, every byte matches and the counters add up;
    an injected media error fails that read, is counted, and the next read works."""
    import threading

    path, image = staged
    sim = FakeNvmeController(image.copy(), mdts=4, completion_order="shuffle")
    src = NvmeStagedSource.open(transport=FakeNvmeTransport(sim), queue_depth=8, queues=2)
    try:
        assert src.queues == 2
        ext = [e for e in src.layout.extents if e.name.startswith("blk.")]
        want = open(path, "rb").read()
        bufs = [_pinned(max(e.length for e in ext))[1] for _ in range(2)]
        for b in bufs:
            assert src.register_buffer(b)
        errors = []

        def worker(k):
            try:
                for e in ext[k::2]:
                    src.read_into(e.offset, e.length, bufs[k])
                    assert bufs[k][:e.length].tobytes() == want[e.offset:e.offset + e.length]
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        st = src.stats()
        assert st["bytes"] == sum(e.length for e in ext) and st["reads"] == len(ext)
        assert st["commands"] > 0 and st["in_flight"] == 0 and st["errors"] == 0
        first = ext[0]
        sim.error_for = lambda cmd: STATUS_UNRECOVERED_READ_ERROR if cmd.opc == 0x02 else None
        with pytest.raises(CommandError, match="unrecovered read error"):
            src.read_into(first.offset, first.length, bufs[0])
        sim.error_for = lambda cmd: None
        assert src.stats()["errors"] == 1 and "unrecovered" in src.stats()["last_error"]
        src.read_into(first.offset, first.length, bufs[0])
        assert bufs[0][:first.length].tobytes() == want[first.offset:first.offset + first.length]
    finally:
        src.close()
