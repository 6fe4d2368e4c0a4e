"""VM tests: the whole NVMe path inside a QEMU guest (TCG, intel-iommu, emulated NVMe).

One boot runs the scenario end to end (boots and Python start-ups are the slow part under TCG,
so every check below reads the same guest transcript):

  two emulated controllers: "ntxdata" (blank, the dedicated device) and "ntxboot" (ext4,
  mounted at /boot in the guest) → devices lists both, refuses ntxboot (backs /boot) →
  stage refuses ntxboot, refuses ntxdata without confirmation, stages onto ntxdata with
  --yes-i-mean-ntxdata → dd iflag=direct throughput with the kernel driver → bind → verify
  through our driver (sha256 per extent, raw read throughput) → no DMAR fault in dmesg →
  a second reader is SIGKILLed mid-read → unbind → nvme owns the device again and the staged
  contents still verify through the kernel driver.

Packages: qemu-system-x86 linux-image-amd64 busybox-static (skips cleanly without them).

Cost: ~2 min on 2 cores (115-130 s measured with other work on the cores), all of it the one
guest: a busybox boot is seconds, each Python start under TCG ~10 s (guest_steps.py runs the
steps in as few as it can). Only a guest has an IOMMU, an NVMe controller to bind and a kernel
driver to hand it back to.
"""
import json
import os
import re
import sys

import pytest

from . import vmguest
from .ggufgen import write_synthetic_gguf

pytestmark = [pytest.mark.vm, pytest.mark.slow]

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DATA_MIB = 128
BENCH_MIB = 64

GUEST_SCRIPT = r"""
PY=%(python)s
export PYTHONPATH=%(syspath)s
modprobe -a nvme ext4 2>/dev/null
ctrl_of() { for c in /sys/class/nvme/nvme*; do
  [ "$(cat $c/serial | tr -d ' ')" = "$1" ] && basename $c; done; }
for i in $(seq 100); do
  [ -n "$(ctrl_of ntxdata)" ] && [ -n "$(ctrl_of ntxboot)" ] && \
  [ -e /dev/$(ctrl_of ntxdata)n1 ] && [ -e /dev/$(ctrl_of ntxboot)n1 ] && break; sleep 0.1; done
DC=$(ctrl_of ntxdata); BC=$(ctrl_of ntxboot)
DATA=/dev/${DC}n1; BOOT=/dev/${BC}n1
PCI=$(basename $(readlink -f /sys/class/nvme/$DC/device))
G=$(basename $(readlink /sys/bus/pci/devices/$PCI/iommu_group))
mount -t ext4 $BOOT /boot
echo "@@ info data=$DATA boot=$BOOT pci=$PCI group=$G"
M=%(model)s
cat > /run/tmp/steps1.json <<EOF
[["devices", "admin", ["devices", "--json"]],
 ["devices-table", "admin", ["devices"]],
 ["stage-boot", "admin", ["stage", "$M", "--device", "$BOOT", "--yes-i-mean-ntxboot"]],
 ["stage-noconfirm", "admin", ["stage", "$M", "--device", "$DATA"]],
 ["stage-wrong", "admin", ["stage", "$M", "--device", "$DATA", "--yes-i-mean-nope"]],
 ["stage", "admin", ["stage", "$M", "--device", "$DATA", "--yes-i-mean-ntxdata"]],
 ["dd", "sh", "dd if=$DATA of=/dev/null bs=1M count=%(bench_mib)d iflag=direct"],
 ["dd2", "sh", "dd if=$DATA of=/dev/null bs=1M count=%(bench_mib)d iflag=direct"],
 ["bind", "admin", ["bind", "$DATA"]],
 ["driver", "sh", "basename \$(readlink /sys/bus/pci/devices/$PCI/driver)"],
 ["verify", "admin", ["verify", "$PCI", "--json", "--bench-bytes", "%(bench_bytes)d"]],
 ["verify-text", "admin", ["verify", "$PCI"]]]
EOF
$PY %(steps)s /run/tmp/steps1.json
echo "@@ dmar $(dmesg | grep -c 'DMAR: \[DMA')"
dmesg | grep 'DMAR: \[DMA' | head -3
echo "@@ kill"
echo '[["reader", "reader", ["'$PCI'", "/run/tmp/reading"]]]' > /run/tmp/steps2.json
$PY %(steps)s /run/tmp/steps2.json &
KPID=$!
for i in $(seq 600); do [ -e /run/tmp/reading ] && break; sleep 0.1; done
sleep 0.5
echo "@@ killed-while-open $(ls -l /proc/$KPID/fd 2>/dev/null | grep -c /dev/vfio/$G)"
kill -9 $KPID; wait $KPID; echo "@@ kill-status $?"
cat > /run/tmp/steps3.json <<EOF
[["unbind", "admin", ["unbind", "$PCI"]],
 ["driver-after", "sh", "basename \$(readlink /sys/bus/pci/devices/$PCI/driver)"],
 ["intact", "sh", "$PY %(steps)s --intact $DATA"]]
EOF
$PY %(steps)s /run/tmp/steps3.json
echo "@@ dmar-final $(dmesg | grep -c 'DMAR: \[DMA')"
"""


def _sections(output: str) -> dict[str, str]:
    """Split the transcript at '@@ name' markers into name -> text (incl. the '@@ rc=' line)."""
    out: dict[str, str] = {}
    current = None
    for line in output.splitlines():
        m = re.match(r"@@ (\S+)(.*)", line)
        if m and not m.group(1).startswith("rc="):
            current = m.group(1)
            out[current] = m.group(2).strip() + "\n"
        elif current is not None:
            out[current] += line + "\n"
    return out


def _rc(text: str) -> int | None:
    m = re.search(r"@@ rc=(\d+)", text)
    return int(m.group(1)) if m else None


@pytest.fixture(scope="module")
def guest(tmp_path_factory):
    reason = vmguest.vm_missing()
    if reason:
        pytest.skip(reason)
    d = tmp_path_factory.mktemp("vm")
    model = write_synthetic_gguf(d / "model.gguf", n_layers=6, width=128, big=250_000)
    data_img = d / "data.img"
    with open(data_img, "wb") as f:
        f.truncate(DATA_MIB << 20)
    boot_img = d / "boot.img"
    with open(boot_img, "wb") as f:
        f.truncate(32 << 20)
    import subprocess
    subprocess.run(["mkfs.ext4", "-q", "-F", str(boot_img)], check=True)   # an image file
    script = GUEST_SCRIPT % {
        "python": sys.executable, "syspath": os.path.join(REPO, "system"), "model": model,
        "steps": os.path.join(os.path.dirname(__file__), "guest_steps.py"),
        "bench_mib": BENCH_MIB, "bench_bytes": BENCH_MIB << 20}
    res = vmguest.run_guest(script, workdir=str(d), timeout_s=280, disks=[
        vmguest.NvmeDisk(str(data_img), "ntxdata"), vmguest.NvmeDisk(str(boot_img), "ntxboot")])
    if res.rc is None:
        pytest.fail("guest did not finish:\n" + res.console[-4000:])
    sections = _sections(res.output)
    results_path = os.environ.get("NTX_VM_RESULTS")
    if results_path:
        with open(results_path, "w") as f:
            f.write(res.output + f"\n@@ boot-to-poweroff-seconds {res.seconds:.1f}\n")
    return {"res": res, "s": sections, "model": model,
            "model_sha": __import__("hashlib").sha256(open(model, "rb").read()).hexdigest()}


def test_devices_shows_emulated_nvme_and_refuses_guest_boot(guest):
    s = guest["s"]
    assert _rc(s["devices"]) == 0, s["devices"]
    rows = json.loads(s["devices"].split("\n", 1)[1].rsplit("@@ rc=", 1)[0])
    by_serial = {r["serial"]: r for r in rows}
    assert by_serial["ntxdata"]["allowed"] and by_serial["ntxdata"]["model"] == "QEMU NVMe Ctrl"
    assert by_serial["ntxdata"]["iommu_group"] is not None
    boot = by_serial["ntxboot"]
    assert not boot["allowed"] and any("backs /boot" in r for r in boot["reasons"])
    assert "REFUSED: backs /boot" in s["devices-table"]


def test_stage_refusals(guest):
    s = guest["s"]
    assert _rc(s["stage-boot"]) == 2 and "backs /boot" in s["stage-boot"]
    assert _rc(s["stage-noconfirm"]) == 2 and "--yes-i-mean-ntxdata" in s["stage-noconfirm"]
    assert _rc(s["stage-wrong"]) == 2 and "does not match" in s["stage-wrong"]


def test_stage_with_kernel_driver(guest):
    s = guest["s"]
    assert _rc(s["stage"]) == 0, s["stage"]
    assert "read-back verified" in s["stage"] and "100%" in s["stage"]
    assert guest["model_sha"] in s["stage"]


def test_bind_and_verify_through_our_driver(guest):
    s = guest["s"]
    assert _rc(s["bind"]) == 0, s["bind"]
    assert s["driver"].split()[0] == "vfio-pci"
    assert _rc(s["verify"]) == 0, s["verify"]
    v = json.loads(next(line for line in s["verify"].splitlines() if line.startswith("{")))
    assert v["bad_extents"] == [] and v["extents"] >= 8 and v["bytes_direct"] > 0
    assert v["controller"] == "QEMU NVMe Ctrl" and v["serial"] == "ntxdata"


def test_no_dmar_faults(guest):
    s = guest["s"]
    assert s["dmar"].split()[0] == "0", s["dmar"]
    assert s["dmar-final"].split()[0] == "0", s["dmar-final"]


def test_throughput_vs_dd_is_reported(guest, record_property):
    s = guest["s"]
    dd_runs = []
    for key in ("dd", "dd2"):
        m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", s[key])
        assert m, s[key]
        dd_runs.append(int(m.group(1)) / float(m.group(2)) / 1e9)
    dd_gbps = max(dd_runs)                  # best of two, as the driver's figure is
    v = json.loads(next(line for line in s["verify"].splitlines() if line.startswith("{")))
    ratio = v["bench_gbps"] / dd_gbps
    record_property("dd_gbps", dd_gbps)
    record_property("ntx_gbps", v["bench_gbps"])
    record_property("ratio", ratio)
    print(f"dd iflag=direct {dd_gbps:.3f} GB/s, ntx driver {v['bench_gbps']:.3f} GB/s, "
          f"ratio {ratio:.2f}")
    # The figures are reported, not judged: under TCG on a shared 2-core machine both swing 2-3x
    # between runs (system/VM-RESULTS.md); bench/nvme_read.py is where they are measured.


def test_sigkill_then_unbind_returns_device_intact(guest):
    s = guest["s"]
    assert s["killed-while-open"].split()[0] == "1", "reader was not inside VFIO when killed"
    assert s["kill-status"].split()[0] == "137"
    assert _rc(s["unbind"]) == 0, s["unbind"]
    assert s["driver-after"].split()[0] == "nvme"
    assert "INTACT" in s["intact"] and guest["model_sha"] in s["intact"], s["intact"]
