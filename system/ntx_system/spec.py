"""NVMe wire formats: controller registers, SQE/CQE, identify structures, status codes.

Everything here is data and pure functions (NVMe Base Specification 1.4, the revision QEMU 7.2
emulates).  Every wire structure is a numpy structured dtype with an assert on its size, the way
SPDK's nvme_spec.h static_asserts them, so a wrong field width fails at import, not on a device.

Thread rule: nothing here holds state; safe from any thread.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

# --------------------------------------------------------------------------- registers (BAR0)

REG_CAP = 0x00     # 64-bit, controller capabilities
REG_VS = 0x08      # version
REG_INTMS = 0x0C   # interrupt mask set
REG_INTMC = 0x10   # interrupt mask clear
REG_CC = 0x14      # controller configuration
REG_CSTS = 0x1C    # controller status
REG_NSSR = 0x20    # NVM subsystem reset
REG_AQA = 0x24     # admin queue attributes
REG_ASQ = 0x28     # 64-bit, admin submission queue base
REG_ACQ = 0x30     # 64-bit, admin completion queue base
REG_DOORBELL_BASE = 0x1000

PAGE_SIZE = 4096   # the memory page size we program (CC.MPS = 0); also the host page size
SQE_SIZE_LOG2 = 6
CQE_SIZE_LOG2 = 4


def doorbell_sq_tail(qid: int, dstrd: int) -> int:
    """Offset of the submission-queue tail doorbell of queue `qid` (CAP.DSTRD stride)."""
    return REG_DOORBELL_BASE + (2 * qid) * (4 << dstrd)


def doorbell_cq_head(qid: int, dstrd: int) -> int:
    """Offset of the completion-queue head doorbell of queue `qid`."""
    return REG_DOORBELL_BASE + (2 * qid + 1) * (4 << dstrd)


def _bits(value: int, lo: int, width: int) -> int:
    return (value >> lo) & ((1 << width) - 1)


@dataclass(frozen=True)
class Cap:
    """CAP decoded.  `mqes` is 0-based in the register; here it is the real entry count."""
    mqes: int           # maximum queue entries supported (entries, not 0-based)
    cqr: bool           # contiguous queues required
    ams: int
    to_ms: int          # worst-case time for CSTS.RDY to change after CC.EN changes
    dstrd: int          # doorbell stride: 4 << dstrd bytes
    nssrs: bool
    css: int
    mpsmin: int         # bytes
    mpsmax: int         # bytes

    @classmethod
    def decode(cls, raw: int) -> "Cap":
        return cls(
            mqes=_bits(raw, 0, 16) + 1,
            cqr=bool(_bits(raw, 16, 1)),
            ams=_bits(raw, 17, 2),
            to_ms=_bits(raw, 24, 8) * 500,
            dstrd=_bits(raw, 32, 4),
            nssrs=bool(_bits(raw, 36, 1)),
            css=_bits(raw, 37, 8),
            mpsmin=1 << (12 + _bits(raw, 48, 4)),
            mpsmax=1 << (12 + _bits(raw, 52, 4)),
        )

    @staticmethod
    def encode(*, mqes: int, cqr: bool = True, to_ms: int = 1000, dstrd: int = 0,
               css: int = 1, mpsmin_log2: int = 12, mpsmax_log2: int = 12) -> int:
        """Build a CAP value (used by the tests' fake controller)."""
        return ((mqes - 1) & 0xFFFF) | (int(cqr) << 16) | (((to_ms + 499) // 500) & 0xFF) << 24 \
            | (dstrd & 0xF) << 32 | (css & 0xFF) << 37 \
            | ((mpsmin_log2 - 12) & 0xF) << 48 | ((mpsmax_log2 - 12) & 0xF) << 52


# CC fields
CC_EN = 1 << 0
CC_CSS_SHIFT = 4
CC_MPS_SHIFT = 7
CC_AMS_SHIFT = 11
CC_SHN_SHIFT = 14
CC_SHN_MASK = 0x3 << CC_SHN_SHIFT
CC_SHN_NORMAL = 0x1 << CC_SHN_SHIFT
CC_SHN_ABRUPT = 0x2 << CC_SHN_SHIFT
CC_IOSQES_SHIFT = 16
CC_IOCQES_SHIFT = 20


def cc_value(*, enable: bool, mps_log2: int = 12, css: int = 0, shn: int = 0) -> int:
    """CC for the NVM command set, round-robin arbitration, 64 B SQEs and 16 B CQEs."""
    return (int(enable) * CC_EN) | (css << CC_CSS_SHIFT) | ((mps_log2 - 12) << CC_MPS_SHIFT) \
        | shn | (SQE_SIZE_LOG2 << CC_IOSQES_SHIFT) | (CQE_SIZE_LOG2 << CC_IOCQES_SHIFT)


# CSTS fields
CSTS_RDY = 1 << 0
CSTS_CFS = 1 << 1           # controller fatal status
CSTS_SHST_SHIFT = 2
CSTS_SHST_MASK = 0x3 << CSTS_SHST_SHIFT
CSTS_SHST_COMPLETE = 0x2 << CSTS_SHST_SHIFT


def aqa_value(sq_entries: int, cq_entries: int) -> int:
    """AQA holds 0-based sizes: ASQS in bits 11:0, ACQS in bits 27:16."""
    assert 2 <= sq_entries <= 4096 and 2 <= cq_entries <= 4096
    return ((cq_entries - 1) << 16) | (sq_entries - 1)


# --------------------------------------------------------------------------- opcodes

class AdminOpcode(enum.IntEnum):
    DELETE_IO_SQ = 0x00
    CREATE_IO_SQ = 0x01
    GET_LOG_PAGE = 0x02
    DELETE_IO_CQ = 0x04
    CREATE_IO_CQ = 0x05
    IDENTIFY = 0x06
    ABORT = 0x08
    SET_FEATURES = 0x09
    GET_FEATURES = 0x0A


class IoOpcode(enum.IntEnum):
    FLUSH = 0x00
    WRITE = 0x01
    READ = 0x02


class IdentifyCns(enum.IntEnum):
    NAMESPACE = 0x00
    CONTROLLER = 0x01
    ACTIVE_NS_LIST = 0x02


FEATURE_NUMBER_OF_QUEUES = 0x07

# --------------------------------------------------------------------------- SQE / CQE

SQE_DTYPE = np.dtype([
    ("opc", "u1"),          # opcode
    ("flags", "u1"),        # FUSE bits 1:0, PSDT bits 7:6 (0 = PRPs)
    ("cid", "<u2"),         # command identifier, echoed in the CQE
    ("nsid", "<u4"),
    ("cdw2", "<u4"),
    ("cdw3", "<u4"),
    ("mptr", "<u8"),
    ("prp1", "<u8"),
    ("prp2", "<u8"),
    ("cdw10", "<u4"),
    ("cdw11", "<u4"),
    ("cdw12", "<u4"),
    ("cdw13", "<u4"),
    ("cdw14", "<u4"),
    ("cdw15", "<u4"),
])
assert SQE_DTYPE.itemsize == 64 == 1 << SQE_SIZE_LOG2

CQE_DTYPE = np.dtype([
    ("dw0", "<u4"),         # command specific result
    ("dw1", "<u4"),
    ("sqhd", "<u2"),        # SQ head pointer: how far the controller has consumed the SQ
    ("sqid", "<u2"),
    ("cid", "<u2"),
    ("status", "<u2"),      # bit 0: phase tag; bits 15:1: status field
])
assert CQE_DTYPE.itemsize == 16 == 1 << CQE_SIZE_LOG2

CQE_PHASE = 0x1

# --------------------------------------------------------------------------- identify

IDENTIFY_SIZE = 4096

IDENTIFY_CTRLR_DTYPE = np.dtype({
    "names": ["vid", "ssvid", "sn", "mn", "fr", "rab", "ieee", "cmic", "mdts", "cntlid", "ver",
              "sqes", "cqes", "maxcmd", "nn", "oncs", "vwc", "sgls", "subnqn"],
    "formats": ["<u2", "<u2", "S20", "S40", "S8", "u1", "V3", "u1", "u1", "<u2", "<u4",
                "u1", "u1", "<u2", "<u4", "<u2", "u1", "<u4", "S256"],
    "offsets": [0, 2, 4, 24, 64, 72, 73, 76, 77, 78, 80,
                512, 513, 514, 516, 520, 525, 536, 768],
    "itemsize": IDENTIFY_SIZE,
})
assert IDENTIFY_CTRLR_DTYPE.itemsize == IDENTIFY_SIZE

IDENTIFY_NS_DTYPE = np.dtype({
    "names": ["nsze", "ncap", "nuse", "nsfeat", "nlbaf", "flbas", "mc", "dpc", "dps", "lbaf"],
    "formats": ["<u8", "<u8", "<u8", "u1", "u1", "u1", "u1", "u1", "u1", ("<u4", 16)],
    "offsets": [0, 8, 16, 24, 25, 26, 27, 28, 29, 128],
    "itemsize": IDENTIFY_SIZE,
})
assert IDENTIFY_NS_DTYPE.itemsize == IDENTIFY_SIZE


def _ascii(raw: bytes) -> str:
    return raw.decode("ascii", "replace").strip(" \x00")


@dataclass(frozen=True)
class IdentifyController:
    vid: int
    serial: str
    model: str
    firmware: str
    mdts: int            # log2 of max transfer in units of CAP.MPSMIN pages; 0 = no limit
    cntlid: int
    version: int
    nn: int              # number of namespaces
    maxcmd: int

    @classmethod
    def decode(cls, buf) -> "IdentifyController":
        rec = np.frombuffer(bytes(buf[:IDENTIFY_SIZE]), dtype=IDENTIFY_CTRLR_DTYPE)[0]
        return cls(vid=int(rec["vid"]), serial=_ascii(rec["sn"]), model=_ascii(rec["mn"]),
                   firmware=_ascii(rec["fr"]), mdts=int(rec["mdts"]), cntlid=int(rec["cntlid"]),
                   version=int(rec["ver"]), nn=int(rec["nn"]), maxcmd=int(rec["maxcmd"]))


@dataclass(frozen=True)
class IdentifyNamespace:
    nsze: int            # size in logical blocks
    ncap: int
    lba_size: int        # bytes, from the format FLBAS selects
    metadata_size: int

    @property
    def size_bytes(self) -> int:
        return self.nsze * self.lba_size

    @classmethod
    def decode(cls, buf) -> "IdentifyNamespace":
        rec = np.frombuffer(bytes(buf[:IDENTIFY_SIZE]), dtype=IDENTIFY_NS_DTYPE)[0]
        lbaf = int(rec["lbaf"][int(rec["flbas"]) & 0xF])
        return cls(nsze=int(rec["nsze"]), ncap=int(rec["ncap"]),
                   lba_size=1 << _bits(lbaf, 16, 8), metadata_size=_bits(lbaf, 0, 16))


# --------------------------------------------------------------------------- status codes

class StatusCodeType(enum.IntEnum):
    GENERIC = 0x0
    COMMAND_SPECIFIC = 0x1
    MEDIA_DATA_INTEGRITY = 0x2
    PATH = 0x3
    VENDOR = 0x7


STATUS_NAMES: dict[tuple[int, int], str] = {
    (0, 0x00): "successful completion",
    (0, 0x01): "invalid command opcode",
    (0, 0x02): "invalid field in command",
    (0, 0x03): "command id conflict",
    (0, 0x04): "data transfer error",
    (0, 0x05): "commands aborted due to power loss",
    (0, 0x06): "internal error",
    (0, 0x07): "command abort requested",
    (0, 0x08): "command aborted due to SQ deletion",
    (0, 0x09): "command aborted due to failed fused command",
    (0, 0x0A): "command aborted due to missing fused command",
    (0, 0x0B): "invalid namespace or format",
    (0, 0x0C): "command sequence error",
    (0, 0x0D): "invalid SGL segment descriptor",
    (0, 0x0E): "invalid number of SGL descriptors",
    (0, 0x0F): "data SGL length invalid",
    (0, 0x13): "PRP offset invalid",
    (0, 0x15): "operation denied",
    (0, 0x20): "namespace is write protected",
    (0, 0x21): "command interrupted",
    (0, 0x22): "transient transport error",
    (0, 0x80): "LBA out of range",
    (0, 0x81): "capacity exceeded",
    (0, 0x82): "namespace not ready",
    (0, 0x83): "reservation conflict",
    (0, 0x84): "format in progress",
    (1, 0x00): "completion queue invalid",
    (1, 0x01): "invalid queue identifier",
    (1, 0x02): "invalid queue size",
    (1, 0x03): "abort command limit exceeded",
    (1, 0x05): "asynchronous event request limit exceeded",
    (1, 0x08): "invalid interrupt vector",
    (1, 0x09): "invalid log page",
    (1, 0x0A): "invalid format",
    (1, 0x0C): "invalid queue deletion",
    (1, 0x80): "conflicting attributes",
    (1, 0x82): "attempted write to read only range",
    (2, 0x80): "write fault",
    (2, 0x81): "unrecovered read error",
    (2, 0x82): "end-to-end guard check error",
    (2, 0x83): "end-to-end application tag check error",
    (2, 0x84): "end-to-end reference tag check error",
    (2, 0x85): "compare failure",
    (2, 0x86): "access denied",
    (2, 0x87): "deallocated or unwritten logical block",
}


@dataclass(frozen=True)
class Status:
    """The 15-bit status field of a CQE (phase bit removed)."""
    sct: int
    sc: int
    more: bool = False
    dnr: bool = False          # do not retry

    @classmethod
    def from_cqe_status(cls, raw: int) -> "Status":
        return cls(sct=_bits(raw, 9, 3), sc=_bits(raw, 1, 8),
                   more=bool(_bits(raw, 14, 1)), dnr=bool(_bits(raw, 15, 1)))

    def to_cqe_status(self, phase: int) -> int:
        return (phase & 1) | (self.sc << 1) | (self.sct << 9) | (int(self.more) << 14) \
            | (int(self.dnr) << 15)

    @property
    def ok(self) -> bool:
        return self.sct == 0 and self.sc == 0

    @property
    def name(self) -> str:
        known = STATUS_NAMES.get((self.sct, self.sc))
        if known:
            return known
        try:
            kind = StatusCodeType(self.sct).name.lower()
        except ValueError:
            kind = f"type {self.sct:#x}"
        return f"unknown {kind} status {self.sc:#04x}"

    def __str__(self) -> str:
        return f"{self.name} (sct={self.sct:#x} sc={self.sc:#04x}{' dnr' if self.dnr else ''})"


STATUS_SUCCESS = Status(0, 0)
STATUS_INVALID_OPCODE = Status(0, 0x01)
STATUS_INVALID_FIELD = Status(0, 0x02)
STATUS_DATA_TRANSFER_ERROR = Status(0, 0x04)
STATUS_ABORTED_SQ_DELETION = Status(0, 0x08)
STATUS_INVALID_NAMESPACE = Status(0, 0x0B)
STATUS_LBA_OUT_OF_RANGE = Status(0, 0x80)
STATUS_INVALID_QUEUE_ID = Status(1, 0x01)
STATUS_INVALID_QUEUE_SIZE = Status(1, 0x02)
STATUS_UNRECOVERED_READ_ERROR = Status(2, 0x81)


def max_transfer_bytes(mdts: int, mpsmin: int, cap_bytes: int) -> int:
    """The largest single transfer: 2**MDTS pages of CAP.MPSMIN, no larger than `cap_bytes`."""
    if mdts == 0:
        return cap_bytes
    return min(cap_bytes, (1 << mdts) * mpsmin)
