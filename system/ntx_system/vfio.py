"""The PCIe transport: a controller bound to vfio-pci, driven from this process.

Opens the VFIO container (`/dev/vfio/vfio`) and the device's group, selects the IOMMU model
(type1v2, falling back to type1; no-IOMMU only when the caller asks), gets the device fd, reads
region info, enables memory decoding and bus mastering in config space, mmaps BAR0 and maps DMA
buffers.

Under type1 every buffer gets an IOVA from `IovaAllocator` and `VFIO_IOMMU_MAP_DMA` pins it; the
device can reach nothing else.  In no-IOMMU mode (`noiommu=True`, needs a kernel with
CONFIG_VFIO_NOIOMMU and `enable_unsafe_noiommu_mode=1`) the device sees physical addresses,
which we read from /proc/self/pagemap for mlocked pages: one address per page, no protection.
That mode exists for machines without an IOMMU and is never chosen implicitly.

BAR0 is accessed with 32-bit loads and stores only (QEMU's controller and the spec's register
model both expect that); 64-bit registers are written low half first.

Thread rule: one `VfioTransport` per controller, created and closed by one thread.  Register
reads/writes are single aligned accesses and may come from the threads that own I/O queue pairs
(their doorbells); `dma_alloc/dma_map/dma_free` take an internal lock.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import mmap
import os
import struct
import threading
from dataclasses import dataclass

import numpy as np

from .dma import ContiguousDmaRegion, DmaRegion, IovaAllocator, PagedDmaRegion, align_up
from .spec import PAGE_SIZE

# <linux/vfio.h>: every ioctl is _IO(';', 100 + n); the argument size travels in `argsz`.
_VFIO_TYPE = ord(";")


def _vfio_io(nr: int) -> int:
    return (_VFIO_TYPE << 8) | (100 + nr)


VFIO_GET_API_VERSION = _vfio_io(0)
VFIO_CHECK_EXTENSION = _vfio_io(1)
VFIO_SET_IOMMU = _vfio_io(2)
VFIO_GROUP_GET_STATUS = _vfio_io(3)
VFIO_GROUP_SET_CONTAINER = _vfio_io(4)
VFIO_GROUP_UNSET_CONTAINER = _vfio_io(5)
VFIO_GROUP_GET_DEVICE_FD = _vfio_io(6)
VFIO_DEVICE_GET_INFO = _vfio_io(7)
VFIO_DEVICE_GET_REGION_INFO = _vfio_io(8)
VFIO_DEVICE_RESET = _vfio_io(11)
VFIO_IOMMU_GET_INFO = _vfio_io(12)
VFIO_IOMMU_MAP_DMA = _vfio_io(13)
VFIO_IOMMU_UNMAP_DMA = _vfio_io(14)
assert VFIO_GET_API_VERSION == 0x3B64 and VFIO_IOMMU_MAP_DMA == 0x3B71

VFIO_API_VERSION = 0
VFIO_TYPE1_IOMMU = 1
VFIO_TYPE1v2_IOMMU = 3
VFIO_NOIOMMU_IOMMU = 8
VFIO_GROUP_FLAGS_VIABLE = 1 << 0
VFIO_DMA_MAP_FLAG_READ = 1 << 0
VFIO_DMA_MAP_FLAG_WRITE = 1 << 1
VFIO_REGION_INFO_FLAG_MMAP = 1 << 2
VFIO_PCI_BAR0_REGION_INDEX = 0
VFIO_PCI_CONFIG_REGION_INDEX = 7

PCI_COMMAND = 0x04
PCI_COMMAND_MEMORY = 0x2
PCI_COMMAND_MASTER = 0x4

_GROUP_STATUS = struct.Struct("<II")                # argsz, flags
_DEVICE_INFO = struct.Struct("<IIII")               # argsz, flags, num_regions, num_irqs
_REGION_INFO = struct.Struct("<IIIIQQ")             # argsz, flags, index, cap_offset, size, offset
_DMA_MAP = struct.Struct("<IIQQQ")                  # argsz, flags, vaddr, iova, size
_DMA_UNMAP = struct.Struct("<IIQQ")                 # argsz, flags, iova, size
assert (_GROUP_STATUS.size, _DEVICE_INFO.size, _REGION_INFO.size, _DMA_MAP.size,
        _DMA_UNMAP.size) == (8, 16, 32, 32, 24)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class VfioError(RuntimeError):
    """Opening or driving the VFIO device failed; the message says why and what to do."""


@dataclass(frozen=True)
class RegionInfo:
    index: int
    flags: int
    size: int
    offset: int


def _ioctl(fd: int, request: int, arg, what: str):
    try:
        return fcntl.ioctl(fd, request, arg)
    except OSError as exc:
        raise VfioError(f"{what} failed: {exc.strerror} (errno {exc.errno})") from exc


def pci_iommu_group(pci_address: str, sysfs: str = "/sys") -> int | None:
    link = os.path.join(sysfs, "bus/pci/devices", pci_address, "iommu_group")
    if not os.path.exists(link):
        return None
    return int(os.path.basename(os.readlink(link)))


def _read_hex(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip(), 16)
    except OSError:
        return None


class VfioTransport:
    """Implements the transport `ctrlr.Controller` expects, over VFIO."""

    def __init__(self, pci_address: str, *, noiommu: bool = False, sysfs: str = "/sys",
                 dev_vfio: str = "/dev/vfio"):
        self.pci_address = pci_address
        self.noiommu = noiommu
        self.contiguous_dma = not noiommu
        dev_dir = os.path.join(sysfs, "bus/pci/devices", pci_address)
        vid, did = _read_hex(f"{dev_dir}/vendor"), _read_hex(f"{dev_dir}/device")
        self.pci_ids = (vid, did) if vid is not None and did is not None else None
        self._lock = threading.Lock()
        self._iova = IovaAllocator()
        self._regions: dict[int, tuple[DmaRegion, object]] = {}   # id -> (region, keepalive)
        self.container = self.group = self.device = -1
        self._bar_map: mmap.mmap | None = None
        self._regs = None
        try:
            self._open(dev_dir, dev_vfio, sysfs)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ open / close

    def _open(self, dev_dir: str, dev_vfio: str, sysfs: str) -> None:
        driver = os.path.realpath(f"{dev_dir}/driver") if os.path.exists(f"{dev_dir}/driver") \
            else None
        if driver is None or os.path.basename(driver) != "vfio-pci":
            raise VfioError(f"{self.pci_address} is bound to "
                            f"{os.path.basename(driver) if driver else 'no driver'}, not "
                            f"vfio-pci: run `ntx-admin bind {self.pci_address}` first")
        group = pci_iommu_group(self.pci_address, sysfs)
        if group is None:
            raise VfioError(f"{self.pci_address} has no IOMMU group: enable the IOMMU "
                            f"(intel_iommu=on / amd_iommu=on, see `ntx-admin check`) or use "
                            f"no-IOMMU mode explicitly")
        self.group_number = group
        group_path = os.path.join(dev_vfio, f"noiommu-{group}" if self.noiommu else str(group))
        if not os.path.exists(group_path):
            hint = ("load vfio with enable_unsafe_noiommu_mode=1 (a kernel built with "
                    "CONFIG_VFIO_NOIOMMU)" if self.noiommu else "modprobe vfio-pci and bind "
                    "the device to it")
            raise VfioError(f"{group_path} does not exist: {hint}")
        self.container = os.open(os.path.join(dev_vfio, "vfio"), os.O_RDWR | os.O_CLOEXEC)
        if _ioctl(self.container, VFIO_GET_API_VERSION, 0, "VFIO_GET_API_VERSION") \
                != VFIO_API_VERSION:
            raise VfioError("unknown VFIO API version")
        if self.noiommu:
            candidates = [VFIO_NOIOMMU_IOMMU]
        else:
            candidates = [VFIO_TYPE1v2_IOMMU, VFIO_TYPE1_IOMMU]
        self.iommu_type = next((t for t in candidates if _ioctl(
            self.container, VFIO_CHECK_EXTENSION, t, "VFIO_CHECK_EXTENSION")), None)
        if self.iommu_type is None:
            raise VfioError("the kernel's VFIO supports none of the IOMMU models "
                            f"{candidates}: modprobe vfio_iommu_type1")
        self.group = os.open(group_path, os.O_RDWR | os.O_CLOEXEC)
        status = bytearray(_GROUP_STATUS.pack(_GROUP_STATUS.size, 0))
        _ioctl(self.group, VFIO_GROUP_GET_STATUS, status, "VFIO_GROUP_GET_STATUS")
        if not _GROUP_STATUS.unpack(status)[1] & VFIO_GROUP_FLAGS_VIABLE:
            raise VfioError(f"IOMMU group {group} is not viable: every device in "
                            f"/sys/kernel/iommu_groups/{group}/devices must be bound to vfio-pci "
                            f"or have no driver")
        _ioctl(self.group, VFIO_GROUP_SET_CONTAINER,
               bytearray(struct.pack("<i", self.container)), "VFIO_GROUP_SET_CONTAINER")
        _ioctl(self.container, VFIO_SET_IOMMU, self.iommu_type, "VFIO_SET_IOMMU")
        # The ioctl's return value is the fd: pass a mutable buffer so fcntl returns it.
        self.device = _ioctl(self.group, VFIO_GROUP_GET_DEVICE_FD,
                             bytearray(self.pci_address.encode() + b"\0"),
                             "VFIO_GROUP_GET_DEVICE_FD")
        info = bytearray(_DEVICE_INFO.pack(_DEVICE_INFO.size, 0, 0, 0))
        _ioctl(self.device, VFIO_DEVICE_GET_INFO, info, "VFIO_DEVICE_GET_INFO")
        self.num_regions = _DEVICE_INFO.unpack(info)[2]
        self.bar0 = self.region_info(VFIO_PCI_BAR0_REGION_INDEX)
        self.config = self.region_info(VFIO_PCI_CONFIG_REGION_INDEX)
        self._enable_bus_master()
        if not self.bar0.flags & VFIO_REGION_INFO_FLAG_MMAP:
            raise VfioError("BAR0 cannot be mmapped through VFIO")
        self._bar_map = mmap.mmap(self.device, self.bar0.size, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE, offset=self.bar0.offset)
        self._regs = (ctypes.c_uint32 * (self.bar0.size // 4)).from_buffer(self._bar_map)

    def region_info(self, index: int) -> RegionInfo:
        buf = bytearray(_REGION_INFO.pack(_REGION_INFO.size, 0, index, 0, 0, 0))
        _ioctl(self.device, VFIO_DEVICE_GET_REGION_INFO, buf, f"region info {index}")
        _, flags, idx, _, size, offset = _REGION_INFO.unpack(buf)
        return RegionInfo(idx, flags, size, offset)

    def _enable_bus_master(self) -> None:
        off = self.config.offset + PCI_COMMAND
        cmd = struct.unpack("<H", os.pread(self.device, 2, off))[0]
        want = cmd | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER
        if want != cmd:
            os.pwrite(self.device, struct.pack("<H", want), off)

    def close(self) -> None:
        """Unmap every DMA buffer, unmap BAR0 and release the device, group and container.
        Closing the device fd lets vfio-pci reset the function, which stops any DMA still
        queued (after a timeout, say) before the memory goes back to the kernel."""
        for region, _ in list(self._regions.values()):
            try:
                self.dma_free(region)
            except (VfioError, ValueError):
                pass
        self._regs = None
        if self._bar_map is not None:
            try:
                self._bar_map.close()
            except BufferError:
                pass
            self._bar_map = None
        if self.device >= 0:
            os.close(self.device)
            self.device = -1
        if self.group >= 0:
            try:
                fcntl.ioctl(self.group, VFIO_GROUP_UNSET_CONTAINER)
            except OSError:
                pass
            os.close(self.group)
            self.group = -1
        if self.container >= 0:
            os.close(self.container)
            self.container = -1

    # ------------------------------------------------------------------ registers

    def read32(self, offset: int) -> int:
        return self._regs[offset >> 2]

    def write32(self, offset: int, value: int) -> None:
        self._regs[offset >> 2] = value & 0xFFFFFFFF

    def read64(self, offset: int) -> int:
        lo = self._regs[offset >> 2]
        return lo | (self._regs[(offset >> 2) + 1] << 32)

    def write64(self, offset: int, value: int) -> None:
        self._regs[offset >> 2] = value & 0xFFFFFFFF
        self._regs[(offset >> 2) + 1] = value >> 32

    # ------------------------------------------------------------------ DMA

    def dma_alloc(self, size: int) -> DmaRegion:
        """Zeroed, page-aligned memory the device can read and write."""
        size = align_up(max(size, 1), PAGE_SIZE)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        mem = mmap.mmap(-1, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        view = np.frombuffer(mem, np.uint8)
        return self._map(view, owned=True, keepalive=mem)

    def dma_map(self, array: np.ndarray) -> DmaRegion:
        """Make a caller's buffer (page-aligned, 1-D uint8) reachable by the device."""
        if array.dtype != np.uint8 or array.ndim != 1 or not array.flags.c_contiguous:
            raise ValueError("DMA buffers are 1-D contiguous uint8 arrays")
        if array.ctypes.data % PAGE_SIZE:
            raise ValueError("DMA buffers must start on a page boundary (allocate with "
                             "mmap or numpy over mmap)")
        return self._map(array, owned=False, keepalive=array)

    def _map(self, view: np.ndarray, *, owned: bool, keepalive) -> DmaRegion:
        vaddr = view.ctypes.data
        size = align_up(view.nbytes, PAGE_SIZE)
        with self._lock:
            if self.noiommu:
                if _libc.mlock(ctypes.c_void_p(vaddr), ctypes.c_size_t(size)) != 0:
                    err = ctypes.get_errno()
                    raise VfioError(f"mlock of {size} bytes failed ({os.strerror(err)}): raise "
                                    f"the memlock limit (ulimit -l / LimitMEMLOCK=)")
                view[::PAGE_SIZE] = view[::PAGE_SIZE]        # fault every page in
                region: DmaRegion = PagedDmaRegion(view, physical_pages(vaddr, size),
                                                   owned=owned)
            else:
                iova = self._iova.alloc(size)
                arg = bytearray(_DMA_MAP.pack(_DMA_MAP.size, VFIO_DMA_MAP_FLAG_READ
                                              | VFIO_DMA_MAP_FLAG_WRITE, vaddr, iova, size))
                try:
                    _ioctl(self.container, VFIO_IOMMU_MAP_DMA, arg,
                           f"VFIO_IOMMU_MAP_DMA of {size} bytes (memlock limit? "
                           f"`ntx-admin check`)")
                except VfioError:
                    self._iova.free(iova)
                    raise
                region = ContiguousDmaRegion(view, iova, owned=owned)
            region._map_size = size
            region._vaddr = vaddr
            self._regions[id(region)] = (region, keepalive)
        return region

    def dma_free(self, region: DmaRegion) -> None:
        with self._lock:
            entry = self._regions.pop(id(region), None)
            if entry is None:
                raise ValueError("DMA region is not mapped by this transport")
            region.mapped = False
            if self.noiommu:
                _libc.munlock(ctypes.c_void_p(region._vaddr), ctypes.c_size_t(region._map_size))
            else:
                arg = bytearray(_DMA_UNMAP.pack(_DMA_UNMAP.size, 0, region.iova_base,
                                                region._map_size))
                if self.container >= 0:
                    _ioctl(self.container, VFIO_IOMMU_UNMAP_DMA, arg, "VFIO_IOMMU_UNMAP_DMA")
                self._iova.free(region.iova_base)


def physical_pages(vaddr: int, size: int) -> list[int]:
    """Physical address of each page of [vaddr, vaddr+size), from /proc/self/pagemap (bits
    0-54 = PFN, bit 63 = present).  The PFN reads as 0 without CAP_SYS_ADMIN."""
    first = vaddr // PAGE_SIZE
    count = align_up(size, PAGE_SIZE) // PAGE_SIZE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = np.frombuffer(f.read(count * 8), "<u8")
    if not (raw >> np.uint64(63)).all():
        raise VfioError("a DMA page is not present in memory (pagemap)")
    pfns = raw & np.uint64((1 << 55) - 1)
    if not pfns.all():
        raise VfioError("/proc/self/pagemap hides physical addresses: no-IOMMU mode needs root "
                        "(CAP_SYS_ADMIN)")
    return [int(p) * PAGE_SIZE for p in pfns]
