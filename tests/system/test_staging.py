"""Staging header format and layout: round trip, alignment, coverage, corruption."""
import hashlib
import os

import pytest

from ntx_system import staging
from ntx_system.staging import StagingError

from .ggufgen import write_synthetic_gguf


@pytest.fixture
def model(tmp_path):
    return write_synthetic_gguf(tmp_path / "m.gguf", n_layers=4)


@pytest.mark.parametrize("lba", [512, 4096])
def test_layout_covers_file_in_order_and_aligned(model, lba):
    layout = staging.plan_layout(model, lba_size=lba)
    names = [e.name for e in layout.extents]
    assert names == ["gguf.meta", "nonlayer", "blk.0", "blk.1", "blk.2", "blk.3", "nonlayer#1"]
    pos = 0
    for e in layout.extents:
        assert e.offset == pos                          # contiguous, in file order
        assert e.device_offset % 4096 == 0 and e.device_offset % lba == 0
        assert e.device_offset >= layout.header_bytes
        pos += e.length
    assert pos == os.path.getsize(model)
    for a, b in zip(layout.extents, layout.extents[1:]):
        assert a.device_offset + a.length <= b.device_offset
    assert {t.extent for t in layout.tensors if t.name.startswith("blk.2.")} == {"blk.2"}


def test_header_round_trip(model):
    layout = staging.plan_layout(model)
    data = open(model, "rb").read()
    for e in layout.extents:
        e.sha256 = hashlib.sha256(data[e.offset:e.offset + e.length]).hexdigest()
    layout.model_sha256 = hashlib.sha256(data).hexdigest()
    raw = staging.encode_header(layout)
    assert len(raw) == layout.header_bytes and raw[:8] == b"NTXSTAGE"
    back = staging.decode_header(raw)
    assert back == layout


def test_header_corruption_and_foreign_data_are_named(model):
    layout = staging.plan_layout(model)
    layout.model_sha256 = "ab" * 32
    raw = bytearray(staging.encode_header(layout))
    raw[200] ^= 0xFF
    with pytest.raises(StagingError, match="corrupt"):
        staging.decode_header(bytes(raw))
    with pytest.raises(StagingError, match="no staged model"):
        staging.decode_header(b"\0" * 4096)


def test_stage_to_image_file_and_verify(model, tmp_path):
    img = tmp_path / "dev.img"
    with open(img, "wb") as f:
        f.truncate(4 << 20)
    report = staging.stage(str(img), model, lba_size=512, device_size=4 << 20)
    assert report.verified and not report.bad_extents
    on_disk = staging.read_layout(str(img))
    assert on_disk.model_sha256 == hashlib.sha256(open(model, "rb").read()).hexdigest()
    # flip one byte inside blk.1 on the "device": verification names that extent
    e = next(x for x in on_disk.extents if x.name == "blk.1")
    with open(img, "r+b") as f:
        f.seek(e.device_offset + 5)
        b = f.read(1)
        f.seek(e.device_offset + 5)
        f.write(bytes([b[0] ^ 1]))
    reader = staging.direct_reader(str(img))
    try:
        assert staging.verify_extents(reader, on_disk) == ["blk.1"]
    finally:
        reader.close()


def test_stage_refuses_a_too_small_device(model, tmp_path):
    img = tmp_path / "small.img"
    img.write_bytes(b"\0" * 8192)
    with pytest.raises(StagingError, match="needs"):
        staging.stage(str(img), model, lba_size=512, device_size=8192)
