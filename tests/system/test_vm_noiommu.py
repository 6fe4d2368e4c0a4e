"""VM test in no-IOMMU mode: no intel-iommu in the guest, vfio.ko rebuilt with
CONFIG_VFIO_NOIOMMU and loaded with enable_unsafe_noiommu_mode=1, our driver using physical
addresses from /proc/self/pagemap (one PRP entry per page, rings of one page).

Packages: those of test_vm.py plus linux-source-6.1 and linux-headers-<guest kernel>.

Cost: ~1 min on 2 cores (50-70 s measured), the guest and its Python starts under TCG; the
vfio.ko build happens once per kernel and is kept in the VM cache."""
import json
import os
import sys
import tempfile

import pytest

from . import vmguest
from .ggufgen import write_synthetic_gguf

pytestmark = [pytest.mark.vm, pytest.mark.slow]

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

SCRIPT = r"""
PY=%(python)s
export PYTHONPATH=%(syspath)s
modprobe nvme
for i in $(seq 100); do [ -e /dev/nvme0n1 ] && break; sleep 0.1; done
PCI=$(basename $(readlink -f /sys/class/nvme/nvme0/device))
insmod %(vfio_ko)s enable_unsafe_noiommu_mode=1
echo "@@ noiommu-param $(cat /sys/module/vfio/parameters/enable_unsafe_noiommu_mode)"
cat > /run/tmp/steps.json <<EOF
[["stage", "admin", ["stage", "%(model)s", "--device", "/dev/nvme0n1", "--yes-i-mean-ntxnoio"]],
 ["bind", "admin", ["bind", "/dev/nvme0n1"]],
 ["verify", "admin", ["verify", "$PCI", "--noiommu", "--json", "--bench-bytes", "33554432"]],
 ["unbind", "admin", ["unbind", "$PCI"]],
 ["intact", "sh", "$PY %(steps)s --intact /dev/nvme0n1"]]
EOF
$PY %(steps)s /run/tmp/steps.json
echo "@@ devnode $(ls /dev/vfio/ 2>&1 | tr '\n' ' ')"
"""


@pytest.fixture(scope="module")
def guest(tmp_path_factory):
    reason = vmguest.vm_missing() or vmguest.noiommu_missing()
    if reason:
        pytest.skip(reason)
    d = tmp_path_factory.mktemp("vmnoio")
    vfio_ko = vmguest.build_noiommu_vfio(os.path.join(tempfile.gettempdir(), "ntx-vm-cache"))
    model = write_synthetic_gguf(d / "model.gguf", n_layers=4, width=128, big=100_000)
    img = d / "data.img"
    with open(img, "wb") as f:
        f.truncate(64 << 20)
    script = SCRIPT % {"python": sys.executable, "syspath": os.path.join(REPO, "system"),
                       "steps": os.path.join(os.path.dirname(__file__), "guest_steps.py"),
                       "model": model, "vfio_ko": vfio_ko}
    res = vmguest.run_guest(script, workdir=str(d), timeout_s=240, iommu=False,
                            disks=[vmguest.NvmeDisk(str(img), "ntxnoio")])
    if res.rc is None:
        pytest.fail("guest did not finish:\n" + res.console[-4000:])
    results_path = os.environ.get("NTX_VM_RESULTS_NOIOMMU")
    if results_path:
        with open(results_path, "w") as f:
            f.write(res.output)
    from .test_vm import _sections
    return _sections(res.output)


def test_noiommu_stage_bind_verify_unbind(guest):
    s = guest
    assert s["noiommu-param"].split()[0] == "Y"
    assert "@@ rc=0" in s["stage"] and "@@ rc=0" in s["bind"], s
    assert "@@ rc=0" in s["verify"], s["verify"]
    v = json.loads(next(line for line in s["verify"].splitlines() if line.startswith("{")))
    assert v["iommu"] == "noiommu" and v["bad_extents"] == [] and v["bench_gbps"] > 0
    assert "@@ rc=0" in s["unbind"], s["unbind"]
    assert "INTACT" in s["intact"], s["intact"]
