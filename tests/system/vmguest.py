"""Boot a QEMU guest (TCG, q35, intel-iommu, emulated NVMe) and run one shell script in it.

The way ../shared/notes/vm-nvme.md measured at ~6 s per boot: a tiny busybox initramfs loads the
9p modules, mounts the host's root read-only over virtio-9p, chroots into it and runs a script
that lives on the host (so the guest runs this checkout and this venv's Python), then prints the
script's exit code and powers off.  Output comes back over the serial console.

Every block-device write of a VM test happens inside the guest, on an emulated NVMe backed by an
image file in the test's tmp directory.  Never KVM: Debian's kernel hangs with it here.

Thread rule: one guest per call; calls may run in parallel (each has its own files).
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass

QEMU = "qemu-system-x86_64"
BUSYBOX_CANDIDATES = ["/bin/busybox", "/usr/bin/busybox"]
NINEP_MODULES = ["virtio_ring", "virtio", "virtio_pci_modern_dev", "virtio_pci_legacy_dev",
                 "virtio_pci", "netfs", "fscache", "9pnet", "9pnet_virtio", "9p"]
DEBIAN_PACKAGES = ["qemu-system-x86", "linux-image-amd64", "busybox-static"]


def guest_kernel() -> tuple[str, str] | None:
    """(vmlinuz path, version) of the newest /boot/vmlinuz-* whose modules are installed."""
    for path in sorted(glob.glob("/boot/vmlinuz-*"), reverse=True):
        kver = path[len("/boot/vmlinuz-"):]
        if os.path.isdir(f"/lib/modules/{kver}/kernel") and os.access(path, os.R_OK):
            return path, kver
    return None


def busybox_path() -> str | None:
    for p in BUSYBOX_CANDIDATES:
        if os.path.exists(p):
            out = subprocess.run(["file", "-L", p], capture_output=True, text=True).stdout \
                if shutil.which("file") else "statically linked"
            if "statically linked" in out or "static-pie" in out:
                return p
    return None


def vm_missing() -> str | None:
    """Why VM tests cannot run here, or None.  The fix is always the same apt line."""
    fix = f"apt-get install -y {' '.join(DEBIAN_PACKAGES)}"
    if shutil.which(QEMU) is None:
        return f"{QEMU} not installed ({fix})"
    if guest_kernel() is None:
        return f"no /boot/vmlinuz-* with modules ({fix})"
    if busybox_path() is None:
        return f"no static busybox ({fix})"
    if os.geteuid() != 0:
        return "the 9p share of / needs root to read every file"
    return None


# --------------------------------------------------------------------------- initramfs

def _cpio_newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A newc cpio archive of (name, mode, data) entries, which the kernel unpacks as rootfs."""
    out = bytearray()
    ino = 1
    for name, mode, data in entries + [("TRAILER!!!", 0, b"")]:
        nb = name.encode() + b"\0"
        hdr = "070701" + "".join(f"{v:08X}" for v in (
            ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nb), 0))
        out += hdr.encode() + nb
        out += b"\0" * (-len(out) % 4)
        out += data
        out += b"\0" * (-len(out) % 4)
        ino += 1
    return bytes(out)


INIT_SCRIPT = r"""#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /host /bin /sbin
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in %(modules)s; do insmod /mods/$m.ko 2>/dev/null; done
cmd=$(sed -n 's/.*ntx\.script=\([^ ]*\).*/\1/p' /proc/cmdline)
if ! mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144 hostroot /host; then
  echo "NTX-GUEST-ERROR: 9p mount failed"; poweroff -f
fi
mount -t proc proc /host/proc
mount -t sysfs sys /host/sys
mount -t devtmpfs dev /host/dev
mount -t tmpfs run /host/run
mkdir -p /host/run/tmp
echo "NTX-GUEST-START"
chroot /host /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  HOME=/run/tmp TMPDIR=/run/tmp PYTHONDONTWRITEBYTECODE=1 /bin/sh "$cmd"
echo "NTX-GUEST-EXIT=$?"
poweroff -f
"""


def build_initramfs(cache_dir: str) -> str:
    """Build (once per kernel version) the busybox initramfs; returns its path."""
    _, kver = guest_kernel()
    path = os.path.join(cache_dir, f"ntx-initramfs-{kver}.cpio")
    if os.path.exists(path):
        return path
    entries: list[tuple[str, int, bytes]] = [
        ("bin", stat.S_IFDIR | 0o755, b""), ("mods", stat.S_IFDIR | 0o755, b""),
        ("dev", stat.S_IFDIR | 0o755, b""),
    ]
    with open(busybox_path(), "rb") as f:
        entries.append(("bin/busybox", stat.S_IFREG | 0o755, f.read()))
    present = []
    for m in NINEP_MODULES:
        r = subprocess.run(["modinfo", "-k", kver, "-n", m], capture_output=True, text=True)
        ko = r.stdout.strip()
        if r.returncode or not ko.endswith(".ko"):
            continue                         # built in, or compressed (not on Debian 12)
        with open(ko, "rb") as f:
            entries.append((f"mods/{m}.ko", stat.S_IFREG | 0o644, f.read()))
        present.append(m)
    init = INIT_SCRIPT % {"modules": " ".join(present)}
    entries.append(("init", stat.S_IFREG | 0o755, init.encode()))
    os.makedirs(cache_dir, exist_ok=True)
    tmp = path + f".{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(_cpio_newc(entries))
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------- boot

@dataclass
class GuestResult:
    rc: int | None          # the script's exit code; None if the guest never reported one
    output: str             # the script's output (serial console, after NTX-GUEST-START)
    console: str            # everything the console printed
    seconds: float


@dataclass
class NvmeDisk:
    image: str
    serial: str


def run_guest(script: str, *, disks: list[NvmeDisk], workdir: str, timeout_s: float = 240,
              memory: str = "1G", append: str = "", iommu: bool = True) -> GuestResult:
    """Boot the guest with one emulated NVMe controller per disk and run `script` (sh)."""
    kernel, _ = guest_kernel()
    initrd = build_initramfs(os.path.join(tempfile.gettempdir(), "ntx-vm-cache"))
    script_path = os.path.join(workdir, f"guest-{time.time_ns()}.sh")
    with open(script_path, "w") as f:
        f.write("set -u\n" + script)
    # no_timer_check: on a busy host the emulated CPU is too slow for the kernel's IO-APIC timer
    # check, which then panics ("timer doesn't work through Interrupt-remapped IO-APIC")
    cmdline = f"console=ttyS0 quiet panic=-1 no_timer_check ntx.script={script_path} {append}"
    args = [QEMU, "-machine", "q35", "-accel", "tcg", "-cpu", "max", "-smp", "1", "-m", memory,
            "-display", "none", "-monitor", "none", "-serial", "stdio", "-no-reboot",
            "-kernel", kernel, "-initrd", initrd,
            "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,"
                       "multidevs=remap"]
    if iommu:
        args += ["-device", "intel-iommu,intremap=on,caching-mode=on"]
        cmdline += " intel_iommu=on"
    for i, d in enumerate(disks):
        args += ["-drive", f"file={d.image},if=none,id=nv{i},format=raw,cache=unsafe",
                 "-device", f"nvme,serial={d.serial},drive=nv{i}"]
    args += ["-append", cmdline]
    start = time.monotonic()
    try:
        proc = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=timeout_s)
        console = proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
    except subprocess.TimeoutExpired as exc:
        console = (exc.stdout or b"").decode(errors="replace") + "\n[ntx: guest timed out]"
    seconds = time.monotonic() - start
    console = console.replace("\r\n", "\n")
    m = re.search(r"NTX-GUEST-EXIT=(\d+)", console)
    body = console.split("NTX-GUEST-START\n", 1)[-1]
    body = body.split("NTX-GUEST-EXIT=", 1)[0]
    return GuestResult(int(m.group(1)) if m else None, body, console, seconds)


# --------------------------------------------------------------------------- no-IOMMU vfio.ko

NOIOMMU_FILES = ["vfio_main.c", "iova_bitmap.c", "container.c", "vfio.h"]


def noiommu_missing() -> str | None:
    kver = (guest_kernel() or (None, None))[1]
    if kver is None:
        return "no guest kernel"
    if not glob.glob("/usr/src/linux-source-*.tar.xz"):
        return "linux-source not installed (apt-get install -y linux-source-6.1)"
    if not os.path.isdir(f"/lib/modules/{kver}/build"):
        return f"kernel headers missing (apt-get install -y linux-headers-{kver})"
    if shutil.which("make") is None or shutil.which("gcc") is None:
        return "make/gcc missing (they come with linux-headers' dependencies)"
    return None


def build_noiommu_vfio(cache_dir: str) -> str:
    """vfio.ko of the guest kernel rebuilt with CONFIG_VFIO_NOIOMMU (Debian builds it without),
    from Debian's linux-source against the matching headers; cached per kernel version."""
    _, kver = guest_kernel()
    out = os.path.join(cache_dir, f"vfio-noiommu-{kver}.ko")
    if os.path.exists(out):
        return out
    tarball = sorted(glob.glob("/usr/src/linux-source-*.tar.xz"))[-1]
    top = os.path.basename(tarball)[: -len(".tar.xz")]
    work = tempfile.mkdtemp(prefix="ntx-vfio-build-", dir=cache_dir if os.path.isdir(cache_dir)
                            else None)
    members = [f"{top}/drivers/vfio/{f}" for f in NOIOMMU_FILES]
    subprocess.run(["tar", "-xf", tarball, "-C", work, *members], check=True)
    src = os.path.join(work, top, "drivers/vfio")
    with open(os.path.join(src, "Kbuild"), "w") as f:
        f.write("obj-m += vfio.o\nvfio-y := vfio_main.o iova_bitmap.o container.o\n")
    r = subprocess.run(["make", "-s", "-C", f"/lib/modules/{kver}/build", f"M={src}",
                        "CONFIG_VFIO_NOIOMMU=y", "KCFLAGS=-DCONFIG_VFIO_NOIOMMU=1", "modules"],
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"vfio.ko build failed:\n{r.stdout}\n{r.stderr}")
    os.makedirs(cache_dir, exist_ok=True)
    shutil.copy(os.path.join(src, "vfio.ko"), out + ".tmp")
    os.replace(out + ".tmp", out)
    shutil.rmtree(work, ignore_errors=True)
    return out
