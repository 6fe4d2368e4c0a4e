"""Under a real systemd (marker vm): a QEMU guest boots systemd as PID 1 over this host's root
(9p, read-only, with a tmpfs overlay; ../shared/notes/vm-systemd.md), installs the packaged unit,
sysusers and tmpfiles files with packaging/install.sh, and checks the service end to end."""

from __future__ import annotations

import glob
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time

import pytest

pytestmark = [pytest.mark.vm, pytest.mark.slow]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BINDIR = os.path.dirname(sys.executable)
MODULES = ["virtio_ring", "virtio", "virtio_pci_legacy_dev", "virtio_pci_modern_dev", "virtio_pci",
           "9pnet", "9pnet_virtio", "netfs", "fscache", "9p", "overlay"]
FIX = "apt-get install -y qemu-system-x86 linux-image-amd64 busybox-static systemd"

INIT = r"""#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /lower /rw /newroot /bin
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in %(modules)s; do insmod /mods/$m.ko 2>/dev/null; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144 hostroot /lower || { echo "NTX-VM-ERROR 9p"; poweroff -f; }
mount -t tmpfs rw /rw; mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot || { echo "NTX-VM-ERROR overlay"; poweroff -f; }
rm -f /newroot/.dockerenv
mount -t tmpfs tmp /newroot/tmp
# a checkout under /tmp (a CI clone) stays visible through the fresh tmpfs
case "%(root)s" in /tmp/*) mkdir -p /newroot%(root)s && mount -o bind /lower%(root)s /newroot%(root)s ;; esac
cp /lower%(work)s/ntx-test.service /lower%(work)s/ntx-test.target /newroot/etc/systemd/system/ || { echo "NTX-VM-ERROR cp"; poweroff -f; }
umount /proc /sys 2>/dev/null; umount /dev 2>/dev/null
exec switch_root /newroot /lib/systemd/systemd
"""

TARGET = """[Unit]
Description=ntransformer VM test
Requires=basic.target ntx-test.service
After=basic.target
AllowIsolate=yes
"""

SERVICE = """[Unit]
Description=ntransformer VM test runner
After=basic.target
[Service]
Type=oneshot
ExecStart=/bin/sh %(work)s/runner.sh
StandardOutput=journal+console
StandardError=journal+console
TimeoutStartSec=20min
"""

RUNNER = r"""set -u
bin=%(bindir)s
fail() { echo "NTX-VM-VERDICT=fail: $*"; systemctl poweroff --no-block; exit 1; }
cd /
%(root)s/packaging/install.sh --bindir "$bin" || fail "install.sh"
case "%(root)s" in /tmp/*|/var/tmp/*)  # PrivateTmp= would hide a checkout there from the daemon
    mkdir -p /etc/systemd/system/ntransformerd.service.d
    printf '[Service]\nBindReadOnlyPaths=%(root)s\n' > /etc/systemd/system/ntransformerd.service.d/ntx-test-checkout.conf
    systemctl daemon-reload ;;
esac
cat > /etc/ntransformer/ntransformerd.toml <<CONFIG_END
model = "%(model)s"
backend = "cpu"
max_ctx = 256
CONFIG_END
useradd -M -N -G ntransformer ntxuser || fail "useradd"
# the venv's interpreter may live under /root (pyenv); let the test users reach it (guest overlay only)
chmod o+x /root
t0=$(date +%%s)
systemctl start ntransformerd || { journalctl -u ntransformerd --no-pager | tail -30; fail "start"; }
echo "NTX-VM-STARTED after $(( $(date +%%s) - t0 )) s"
[ "$(systemctl is-active ntransformerd)" = active ] || fail "is-active"
[ -S /run/ntransformer/ntransformerd.sock ] || fail "no socket after READY"
stat -c 'NTX-VM-SOCKET %%a %%G' /run/ntransformer/ntransformerd.sock
out=$(runuser -u ntxuser -- $bin/ntx-client generate --raw --temperature 0 --max-tokens 4 --json "Hello" 2>&1) || fail "member: $out"
echo "NTX-VM-MEMBER $(echo "$out" | tail -1)"
out=$(runuser -u nobody -- $bin/ntx-client generate --raw --max-tokens 4 "Hello" 2>&1) && fail "nobody was served"
echo "NTX-VM-NOBODY $out"
journalctl -u ntransformerd --no-pager | grep -q "listening on /run/ntransformer/ntransformerd.sock" || fail "journal"
journalctl -u ntransformerd --no-pager | tail -5
systemctl stop ntransformerd
echo "NTX-VM-RESULT $(systemctl show -p Result --value ntransformerd) $(systemctl is-active ntransformerd)"
[ -e /run/ntransformer/ntransformerd.sock ] && fail "socket left after stop"
echo "NTX-VM-VERDICT=ok"
systemctl poweroff --no-block
"""


def _cpio(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A newc cpio archive, as the kernel unpacks an initramfs."""
    out = bytearray()
    for ino, (name, mode, data) in enumerate(entries + [("TRAILER!!!", 0, b"")], 1):
        nb = name.encode() + b"\0"
        out += ("070701" + "".join(f"{v:08X}" for v in (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nb), 0))).encode()
        out += nb + b"\0" * (-(110 + len(nb)) % 4) + data + b"\0" * (-len(data) % 4)
    return bytes(out)


def _kernel():
    for path in sorted(glob.glob("/boot/vmlinuz-*"), reverse=True):
        kver = path[len("/boot/vmlinuz-"):]
        if os.path.isdir(f"/lib/modules/{kver}/kernel"):
            return path, kver
    return None


def _missing() -> str | None:
    if shutil.which("qemu-system-x86_64") is None or _kernel() is None or not os.path.exists("/bin/busybox"):
        return f"qemu, a kernel or a static busybox is missing ({FIX})"
    if not os.path.exists("/lib/systemd/systemd") or shutil.which("systemd-sysusers") is None:
        return f"systemd is not installed ({FIX})"
    if os.geteuid() != 0:
        return "the 9p share of / needs root"
    return None


def test_service_under_systemd_in_a_vm():
    why = _missing()
    if why:
        pytest.skip(why)
    kernel, kver = _kernel()
    work = tempfile.mkdtemp(prefix="ntx-vm-", dir="/var/tmp")  # not /tmp: the guest mounts a tmpfs there
    model_dir = None
    try:
        from ntransformerd.tools.synth import synthesize
        # not in /tmp or /var/tmp either: the unit's PrivateTmp= hides both from the daemon
        model_dir = tempfile.mkdtemp(prefix="ntx-vm-model-", dir="/var/lib")
        os.chmod(model_dir, 0o755)
        model = os.path.join(model_dir, "tiny.gguf")
        synthesize(model, shape="tiny", ftype="q8_0")  # loads in moments even under TCG
        os.chmod(work, 0o755)
        os.chmod(model, 0o644)
        subst = dict(work=work, bindir=BINDIR, root=ROOT, model=model, modules=" ".join(MODULES))
        for name, text in (("ntx-test.service", SERVICE), ("ntx-test.target", TARGET), ("runner.sh", RUNNER)):
            with open(os.path.join(work, name), "w") as f:
                f.write(text % subst)
        entries = [("bin", stat.S_IFDIR | 0o755, b""), ("mods", stat.S_IFDIR | 0o755, b"")]
        with open("/bin/busybox", "rb") as f:
            entries.append(("bin/busybox", stat.S_IFREG | 0o755, f.read()))
        for m in MODULES:
            ko = subprocess.run(["modinfo", "-k", kver, "-n", m], capture_output=True, text=True).stdout.strip()
            if ko.endswith(".ko"):
                with open(ko, "rb") as f:
                    entries.append((f"mods/{m}.ko", stat.S_IFREG | 0o644, f.read()))
        entries.append(("init", stat.S_IFREG | 0o755, (INIT % subst).encode()))
        initrd = os.path.join(work, "initrd.cpio")
        with open(initrd, "wb") as f:
            f.write(_cpio(entries))
        cmd = ["qemu-system-x86_64", "-machine", "q35", "-accel", "tcg", "-cpu", "max", "-smp", "2", "-m", "2G",
               "-display", "none", "-monitor", "none", "-serial", "stdio", "-no-reboot",
               "-kernel", kernel, "-initrd", initrd,
               "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
               "-append", "console=ttyS0 rdinit=/init panic=-1 systemd.unit=ntx-test.target "
                          "systemd.show_status=0 quiet"]
        t0 = time.monotonic()
        log = os.path.join(work, "console.log")  # tail it while the guest runs
        with open(log, "wb") as out:
            guest = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
            try:
                while guest.poll() is None:  # stop early if the guest can only wait at a prompt
                    with open(log, "rb") as f:
                        seen = f.read()
                    if b"You are in rescue mode" in seen or b"You are in emergency mode" in seen \
                            or b"NTX-VM-ERROR" in seen or time.monotonic() - t0 > 600:
                        break
                    time.sleep(1)
            finally:
                if guest.poll() is None:
                    guest.kill()
                guest.wait()
        with open(log, "rb") as f:
            console = f.read().decode(errors="replace").replace("\r\n", "\n")
        print(f"guest ran {time.monotonic() - t0:.0f} s")
        tail = "\n".join(console.splitlines()[-60:])
        assert "NTX-VM-VERDICT=ok" in console, tail
        assert re.search(r"NTX-VM-SOCKET 660 ntransformer", console), tail
        assert "add your user to group ntransformer" in console.split("NTX-VM-NOBODY", 1)[1].split("\n", 1)[0], tail
        assert "NTX-VM-RESULT success inactive" in console, tail
        assert '"ids"' in console.split("NTX-VM-MEMBER ", 1)[1].split("\n", 1)[0], tail
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if model_dir:
            shutil.rmtree(model_dir, ignore_errors=True)
