"""The daemon's NVMe-tier read rate against `dd iflag=direct`, on the same emulated drive.

    sudo .venv/bin/python bench/nvme_read.py [--runs 5] [--queues 1] [--depth 32] [--json out.json]
                                             [--model PATH]
    sudo .venv/bin/python bench/nvme_read.py --smoke    # one run of a 4-layer model: does it run?

Boots one QEMU guest (TCG, intel-iommu, an emulated NVMe; tests/system/vmguest.py), stages a
model onto the drive with `ntx-admin stage` (by default a synthetic 16-layer Q8_0 one of 52 MB
with a 2048-token vocabulary, which a TCG guest opens in seconds; the default model's
49152-token metadata alone takes minutes there), then, median of `--runs` runs each:

  dd        dd if=/dev/nvmeXn1 bs=1M iflag=direct over the staged bytes (the kernel's driver)
  ntx tier  every layer read the way the streaming tier reads it each step: the layer's planned
            reads (tiers.cpu_stream.layer_reads) through the daemon's StorageHandle into
            registered, page-aligned staging buffers, our driver after `ntx-admin bind`

Under TCG both figures are the emulator's, not a drive's: read them as a ratio, for the record
(bench/RESULTS.md). Every write goes to the guest's emulated drive (an image file in a temporary
directory); nothing on the host is touched.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

import common  # noqa: E402
from ntransformerd.tools import synth  # noqa: E402
from tests.system import vmguest  # noqa: E402

GUEST = r"""
PY=%(python)s
modprobe -a nvme vfio-pci vfio_iommu_type1 2>/dev/null
for i in $(seq 100); do [ -e /dev/nvme0n1 ] && break; sleep 0.1; done
export PCI=$(basename $(readlink -f /sys/class/nvme/nvme0/device))
%(bin)s/ntx-admin stage %(model)s --device /dev/nvme0n1 --yes-i-mean-ntxbench 2>&1 | tail -1
MIB=$(( $(stat -c %%s %(model)s) / 1048576 + 1 ))
for r in $(seq %(runs)d); do
  echo "@@ dd $(dd if=/dev/nvme0n1 of=/dev/null bs=1M count=$MIB iflag=direct 2>&1 | tail -1)"
done
%(bin)s/ntx-admin bind /dev/nvme0n1
$PY - <<'PYEOF'
import os
import time
from ntx_system.source import NvmeStagedSource
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.tiers.cpu_stream import layer_reads
from ntransformerd.engine.tiers.sources import HostMemory
from ntransformerd.server.storage import StorageHandle
model = GGUFModel("%(model)s")
reads = [layer_reads(model, i, 4096) for i in range(model.config.n_layers)]
staged = NvmeStagedSource.open(os.environ["PCI"], queue_depth=%(depth)d, queues=%(queues)d)
handle = StorageHandle.for_drive(staged, kind="nvme:" + os.environ["PCI"], name="nvme")
bufs = [HostMemory().alloc(max(r.nbytes for r in reads)) for _ in range(2)]   # the ring's depth 2
for b in bufs:
    handle.register(b)
for run in range(%(runs)d):
    t0 = time.perf_counter()
    n = 0
    for i, r in enumerate(reads):
        r.fill(handle, bufs[i %% 2])
        n += r.nbytes
    dt = time.perf_counter() - t0
    print(f"@@ ntx {n} bytes {dt:.6f} s", flush=True)
st = handle.stats()
print(f"@@ stats commands={st['commands']} max_in_flight={st['max_in_flight']} errors={st['errors']}")
handle.close()
staged.close()
PYEOF
%(bin)s/ntx-admin unbind $PCI
echo "@@ dmar $(dmesg | grep -c 'DMAR: \[DMA')"
"""


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__file__, __doc__)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--queues", type=int, default=1)
    p.add_argument("--depth", type=int, default=32)
    p.add_argument("--model", help="GGUF to stage (default: a synthetic one, see above)")
    args = p.parse_args(argv)
    why = vmguest.vm_missing()
    if why:
        print(f"bench/nvme_read.py: skipped: it boots a QEMU guest and {why}", file=sys.stderr)
        return common.SKIP
    n_layers = 16
    if args.smoke:
        args.runs, n_layers = 1, 4
    bindir = os.path.dirname(sys.executable)
    with tempfile.TemporaryDirectory(prefix="ntx-bench-") as d:
        model = args.model
        if model is None:
            model = os.path.join(d, f"bench{n_layers}.gguf")
            synth.synthesize(model, shape=synth.Shape(n_layers=n_layers, d_model=512, d_ff=1536, n_heads=8,
                                                      n_kv_heads=2, vocab=2048), ftype="q8_0")
        img = os.path.join(d, "drive.img")
        with open(img, "wb") as f:
            f.truncate(os.path.getsize(model) + (64 << 20))
        script = GUEST % dict(python=sys.executable, bin=bindir, model=model, runs=args.runs,
                              depth=args.depth, queues=args.queues)
        res = vmguest.run_guest(script, disks=[vmguest.NvmeDisk(img, "ntxbench")], workdir=d,
                                timeout_s=900)
    out = res.output
    dd = []
    for m in re.finditer(r"@@ dd (\d+) bytes .* copied, ([\d.]+) s", out):
        dd.append(int(m.group(1)) / float(m.group(2)) / 1e9)
    ntx = [int(m.group(1)) / float(m.group(2)) / 1e9 for m in re.finditer(r"@@ ntx (\d+) bytes ([\d.]+) s", out)]
    dmar = re.search(r"@@ dmar (\d+)", out)
    if len(dd) != args.runs or len(ntx) != args.runs or not dmar:
        print(out[-4000:] or res.console[-4000:], file=sys.stderr)
        print("nvme_read: the guest did not report every run", file=sys.stderr)
        return 1
    row = dict(smoke=args.smoke, dd_gbps=statistics.median(dd), ntx_gbps=statistics.median(ntx), dd_runs=dd, ntx_runs=ntx,
               ratio=statistics.median(ntx) / statistics.median(dd), queues=args.queues, depth=args.depth,
               dmar_faults=int(dmar.group(1)), guest_seconds=res.seconds, model=os.path.basename(model),
               stats=(re.search(r"@@ stats (.*)", out) or [None, ""])[1])
    print(f"{'reader':<10} {'median GB/s':>12}  runs")
    print(f"{'dd direct':<10} {row['dd_gbps']:>12.3f}  {' '.join(f'{x:.3f}' for x in dd)}")
    print(f"{'ntx tier':<10} {row['ntx_gbps']:>12.3f}  {' '.join(f'{x:.3f}' for x in ntx)}")
    print(f"ratio ntx/dd {row['ratio']:.2f}; {row['stats']}; DMAR faults {row['dmar_faults']}; "
          f"guest {res.seconds:.0f} s")
    common.write_json(args.json, row)
    return 0 if row["dmar_faults"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
