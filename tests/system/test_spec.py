"""Wire formats: sizes, field offsets and decoders against hand-computed values."""
import numpy as np

from ntx_system import spec


def test_wire_structure_sizes():
    assert spec.SQE_DTYPE.itemsize == 64
    assert spec.CQE_DTYPE.itemsize == 16
    assert spec.IDENTIFY_CTRLR_DTYPE.itemsize == 4096
    assert spec.IDENTIFY_NS_DTYPE.itemsize == 4096
    assert spec.SQE_DTYPE.fields["prp1"][1] == 24
    assert spec.SQE_DTYPE.fields["cdw10"][1] == 40
    assert spec.CQE_DTYPE.fields["status"][1] == 14
    assert spec.IDENTIFY_CTRLR_DTYPE.fields["mdts"][1] == 77
    assert spec.IDENTIFY_CTRLR_DTYPE.fields["nn"][1] == 516


def test_cap_decode_qemu_value():
    # CAP of QEMU 7.2's controller: MQES=2047, CQR, TO=15 (7.5 s), DSTRD=0, CSS=NVM|admin-only
    raw = 0x00400020_0F0107FF | (0xC1 << 37)
    cap = spec.Cap.decode(raw)
    assert cap.mqes == 2048 and cap.cqr and cap.to_ms == 7500 and cap.dstrd == 0
    assert cap.mpsmin == 4096


def test_cap_encode_round_trip():
    raw = spec.Cap.encode(mqes=64, dstrd=2, to_ms=2000, mpsmax_log2=16)
    cap = spec.Cap.decode(raw)
    assert (cap.mqes, cap.dstrd, cap.to_ms, cap.mpsmin, cap.mpsmax) == (64, 2, 2000, 4096, 65536)


def test_doorbell_offsets_with_stride():
    assert spec.doorbell_sq_tail(0, 0) == 0x1000
    assert spec.doorbell_cq_head(0, 0) == 0x1004
    assert spec.doorbell_sq_tail(1, 0) == 0x1008
    assert spec.doorbell_sq_tail(1, 2) == 0x1000 + 2 * 16
    assert spec.doorbell_cq_head(3, 1) == 0x1000 + 7 * 8


def test_cc_and_aqa_values():
    cc = spec.cc_value(enable=True)
    assert cc & spec.CC_EN and (cc >> 16) & 0xF == 6 and (cc >> 20) & 0xF == 4
    assert spec.aqa_value(32, 16) == (15 << 16) | 31


def test_status_decode_names_and_phase():
    raw = spec.Status(2, 0x81, dnr=True).to_cqe_status(phase=1)
    st = spec.Status.from_cqe_status(raw)
    assert raw & 1 == 1
    assert (st.sct, st.sc, st.dnr) == (2, 0x81, True)
    assert "unrecovered read error" in str(st)
    assert not st.ok
    assert spec.Status.from_cqe_status(1).ok
    assert "unknown" in spec.Status(0, 0x7F).name


def test_identify_decoders():
    rec = np.zeros(1, spec.IDENTIFY_CTRLR_DTYPE)
    rec["sn"], rec["mn"], rec["mdts"], rec["nn"] = b"SER42   ", b"Model X   ", 7, 1
    ident = spec.IdentifyController.decode(rec.view(np.uint8))
    assert (ident.serial, ident.model, ident.mdts, ident.nn) == ("SER42", "Model X", 7, 1)
    ns = np.zeros(1, spec.IDENTIFY_NS_DTYPE)
    lbaf = np.zeros(16, np.uint32)
    lbaf[1] = 12 << 16
    ns["nsze"], ns["flbas"], ns["lbaf"] = 1000, 1, lbaf
    dec = spec.IdentifyNamespace.decode(ns.view(np.uint8))
    assert dec.lba_size == 4096 and dec.size_bytes == 4096 * 1000


def test_max_transfer():
    assert spec.max_transfer_bytes(5, 4096, 1 << 30) == 128 << 10
    assert spec.max_transfer_bytes(0, 4096, 2 << 20) == 2 << 20
    assert spec.max_transfer_bytes(10, 4096, 2 << 20) == 2 << 20
