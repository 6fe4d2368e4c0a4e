"""ntx-admin: host setup, device discovery, staging and the VFIO NVMe driver, for root.

    ntx-admin devices [--json]                      NVMe devices and whether we may use them
    ntx-admin check                                 IOMMU, vfio, memlock, hugepages, GPU, SB
    ntx-admin setup [--dry-run] [--root DIR]        vfio at boot + IOMMU kernel arguments
    ntx-admin restore [--dry-run] [--root DIR]      undo exactly what setup did (and hand back a
                                                    drive the service left on vfio-pci)
    ntx-admin stage MODEL.gguf --device /dev/nvmeXnY [--yes-i-mean-SERIAL]
    ntx-admin bind /dev/nvmeXnY|PCI_ADDRESS          give the controller to vfio-pci
    ntx-admin unbind PCI_ADDRESS                     give it back to nvme
    ntx-admin bind --service [--config FILE]        the unit's start step: check and bind the
                                                    drive `storage = "nvme:SERIAL"` names
    ntx-admin unbind --service                      the unit's stop step: hand it back
    ntx-admin verify PCI_ADDRESS [--bench-bytes N]  read every extent through our driver
    ntx-admin model load [PATH] [--backend B]       the daemon loads PATH (default: the embedded model)
    ntx-admin model unload                          the daemon drops its model
    ntx-admin drain | resume | shutdown             stop admitting requests / admit again / exit

Exit status: 0 success, 1 failure or checksum mismatch, 2 refused (policy, confirmation, usage).

Thread rule: a one-shot CLI; single-threaded.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import sys
import threading
import time

import numpy as np

from ntx_client import AdminClient, Client, NtxError
from ntx_proto.ntransformer.v1 import inference_pb2 as pb

from . import staging
from .bind import BindError, bind_vfio, unbind_vfio
from .check import run_checks
from .config_file import DEFAULT_PATH as DEFAULT_CONFIG
from .ctrlr import CtrlrError
from .discovery import discover, find_device
from .hostsetup import restore, setup
from .policy import device_verdict
from .service import RUN_DIR, DriveRecord, Refused, ServiceConfig, notify_status, prepare, release
from .source import NvmeStagedSource
from .staging import StagingError
from .vfio import VfioError

EXIT_OK, EXIT_FAIL, EXIT_REFUSED = 0, 1, 2
CONFIRM_PREFIX = "--yes-i-mean-"


def _err(msg: str) -> None:
    print(f"ntx-admin: {msg}", file=sys.stderr)


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# --------------------------------------------------------------------------- devices

def cmd_devices(args) -> int:
    devices = discover()
    rows = [(d, device_verdict(d)) for d in devices]
    if args.json:
        print(json.dumps([dict(d.to_json(), allowed=v.allowed, reasons=v.reasons)
                          for d, v in rows], indent=1))
        return EXIT_OK
    if not rows:
        print("no NVMe controllers found")
        return EXIT_OK
    for d, v in rows:
        print(f"{d.devnode or d.controller or '-':<14} {d.pci_address}  driver={d.driver or '-'}"
              f"  group={d.iommu_group if d.iommu_group is not None else '-'}"
              f"  serial={d.serial or '-'}  model={d.model or '-'}  size={_human(d.size_bytes)}")
        print(f"    {'ALLOWED' if v.allowed else 'REFUSED'}"
              + ("" if v.allowed else ": " + "; ".join(v.reasons)))
    return EXIT_OK


def cmd_check(args) -> int:
    lines = run_checks(args.root)
    for line in lines:
        print(line)
    return EXIT_FAIL if any(x.status == "FAIL" for x in lines) else EXIT_OK


def cmd_setup(args) -> int:
    if args.root == "/" and os.geteuid() != 0 and not args.dry_run:
        _err("setup changes /etc: run it as root (or --dry-run, or --root DIR)")
        return EXIT_REFUSED
    setup(args.root, dry_run=args.dry_run)
    return EXIT_OK


def cmd_restore(args) -> int:
    # A drive the service's start step bound and no stop step handed back (the unit removed
    # by hand mid-run, say) goes back to nvme first: `restore` leaves the host as it was.
    run_dir = os.path.join(args.root, RUN_DIR.lstrip("/"))
    try:
        record = DriveRecord.load(run_dir)
    except Refused as exc:
        _err(str(exc))
        record = None
    if record is not None and record.release != "keep":
        if args.dry_run:
            print(f"restore: would hand {record.pci_address} (serial {record.serial}) back to nvme")
        else:
            try:
                print(f"restore: {release(record, sysfs=os.path.join(args.root, 'sys'), run_dir=run_dir)}")
            except (BindError, OSError) as exc:
                _err(f"cannot hand {record.pci_address} back to nvme: {exc}")
                return EXIT_FAIL
    restore(args.root, dry_run=args.dry_run)
    return EXIT_OK


# --------------------------------------------------------------------------- stage

def _lookup(ident: str):
    d = find_device(discover(), ident)
    return d, (device_verdict(d) if d else None)


def cmd_stage(args) -> int:
    d, verdict = _lookup(args.device)
    if d is None or d.devnode is None:
        _err(f"{args.device} is not an NVMe namespace bound to the nvme driver "
             f"(see `ntx-admin devices`)")
        return EXIT_REFUSED
    if not verdict.allowed:
        _err(f"refusing to stage onto {d.devnode}: " + "; ".join(verdict.reasons))
        return EXIT_REFUSED
    if args.confirm != d.serial:
        if args.confirm is not None:
            _err(f"{CONFIRM_PREFIX}{args.confirm} does not match {d.devnode}'s serial")
            return EXIT_REFUSED
        if not sys.stdin.isatty():
            _err(f"this erases {d.devnode} ({d.model}, serial {d.serial}); confirm with "
                 f"{CONFIRM_PREFIX}{d.serial}")
            return EXIT_REFUSED
        typed = input(f"This erases {d.devnode} ({d.model}, {_human(d.size_bytes)}). "
                      f"Type its serial ({d.serial}) to continue: ").strip()
        if typed != d.serial:
            _err("serial did not match; nothing written")
            return EXIT_REFUSED
    last = [-1]

    def progress(done: int, total: int) -> None:
        pct = done * 100 // max(total, 1)
        if pct // 10 != last[0] // 10 or done == total:
            last[0] = pct
            print(f"staging: {pct:3d}% ({_human(done)} / {_human(total)})", file=sys.stderr)

    try:
        report = staging.stage(d.devnode, args.model, lba_size=d.lba_size or 512,
                               device_size=d.size_bytes, progress=progress,
                               verify=not args.no_verify)
    except staging.StagingError as exc:
        _err(str(exc))
        return EXIT_FAIL
    lay = report.layout
    print(f"staged {lay.model_name} ({_human(lay.model_size)}, {len(lay.extents)} extents) "
          f"onto {d.devnode} in {report.seconds:.1f} s; sha256 {lay.model_sha256}")
    if args.no_verify:
        return EXIT_OK
    if not report.verified:
        _err(f"read-back verification FAILED for: {', '.join(report.bad_extents)}")
        return EXIT_FAIL
    print("read-back verified: every extent matches")
    return EXIT_OK


# --------------------------------------------------------------------------- bind / unbind

def _service_say(text: str) -> None:
    """A start/stop step's progress: stderr (the unit's journal) and STATUS=."""
    print(f"ntx-admin: {text}", file=sys.stderr, flush=True)
    notify_status(text)


def cmd_bind_service(args) -> int:
    try:
        cfg = ServiceConfig.from_toml(args.config)
        record = prepare(cfg, status=_service_say, bound_by="ntx-admin")
    except Refused as exc:
        _service_say(f"refused: {exc}")
        DriveRecord.forget()
        return EXIT_REFUSED
    except (BindError, OSError) as exc:
        _service_say(f"failed to bind the NVMe drive: {exc}")
        return EXIT_FAIL
    if record is None:
        print(f"ntx-admin: storage = {cfg.storage!r}: no NVMe drive to bind", file=sys.stderr)
    return EXIT_OK


def cmd_unbind_service(args) -> int:
    try:
        what = release(DriveRecord.load())
    except (Refused, BindError, OSError) as exc:
        _service_say(f"failed to hand the NVMe drive back: {exc} (then `ntx-admin unbind "
                     f"PCI_ADDRESS` by hand)")
        return EXIT_FAIL
    print(f"ntx-admin: {what}", file=sys.stderr)
    return EXIT_OK


def cmd_bind(args) -> int:
    if args.service:
        return cmd_bind_service(args)
    if not args.device:
        _err("bind needs a device (/dev/nvmeXnY or PCI address), or --service")
        return EXIT_REFUSED
    devices = discover()
    key = os.path.basename(args.device) if args.device.startswith("/dev/") else args.device
    mine = [d for d in devices if key in (d.pci_address, d.namespace, d.controller)]
    if not mine:
        _err(f"{args.device}: no such NVMe device (see `ntx-admin devices`)")
        return EXIT_REFUSED
    addr = mine[0].pci_address
    ctrl_devs = [d for d in devices if d.pci_address == addr]
    refused = [(d, device_verdict(d)) for d in ctrl_devs]
    refused = [(d, v) for d, v in refused if not v.allowed]
    if refused:
        for d, v in refused:
            _err(f"refusing to bind {addr}: {d.devnode or d.controller}: " + "; ".join(v.reasons))
        return EXIT_REFUSED
    try:
        before = bind_vfio(addr)
    except BindError as exc:
        _err(str(exc))
        return EXIT_FAIL
    print(f"{addr}: {before or 'no driver'} -> vfio-pci")
    return EXIT_OK


def cmd_unbind(args) -> int:
    if args.service:
        return cmd_unbind_service(args)
    if not args.pci_address:
        _err("unbind needs a PCI address, or --service")
        return EXIT_REFUSED
    try:
        unbind_vfio(args.pci_address)
    except BindError as exc:
        _err(str(exc))
        return EXIT_FAIL
    print(f"{args.pci_address}: vfio-pci -> nvme")
    return EXIT_OK


# --------------------------------------------------------------------------- verify

def _pinned(n: int) -> tuple[mmap.mmap, np.ndarray]:
    mem = mmap.mmap(-1, n, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    return mem, np.frombuffer(mem, np.uint8)


def cmd_verify(args) -> int:
    try:
        src = NvmeStagedSource.open(args.pci_address, noiommu=args.noiommu,
                                    queue_depth=args.depth, queues=args.queues)
    except (VfioError, CtrlrError, StagingError, OSError) as exc:
        _err(f"cannot open {args.pci_address}: {exc}")
        return EXIT_FAIL
    result = {"pci_address": args.pci_address, "model": src.layout.model_name,
              "controller": src.ctrl.identity.model, "serial": src.ctrl.identity.serial,
              "max_transfer": src.ctrl.max_transfer, "queue_depth": args.depth,
              "iommu": "noiommu" if args.noiommu else "type1"}
    try:
        extents = src.layout.extents
        biggest = max(e.length for e in extents)
        mem, buf = _pinned(max(biggest, 1 << 20))
        src.register_buffer(buf)
        bad, read_s, total = [], 0.0, 0
        for e in extents:
            t0 = time.perf_counter()
            src.read_into(e.offset, e.length, buf)
            read_s += time.perf_counter() - t0
            total += e.length
            if hashlib.sha256(buf[:e.length]).hexdigest() != e.sha256:
                bad.append(e.name)
        result.update(extents=len(extents), bytes=total, seconds=read_s,
                      gbps=total / read_s / 1e9 if read_s else 0.0, bad_extents=bad,
                      bytes_direct=src.bytes_direct)
        if args.bench_bytes:
            result.update(_bench(src, args.bench_bytes))
        src.unregister_buffer(buf)
    finally:
        src.close()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"verify {args.pci_address}: {result['extents']} extents, {_human(total)} in "
              f"{read_s:.3f} s = {result['gbps']:.3f} GB/s "
              f"({'all sha256 match' if not bad else 'MISMATCH: ' + ', '.join(bad)})")
        if args.bench_bytes:
            print(f"bench: {_human(result['bench_bytes'])} raw read in "
                  f"{result['bench_seconds']:.3f} s = {result['bench_gbps']:.3f} GB/s")
    return EXIT_FAIL if bad else EXIT_OK


def _bench(src, nbytes: int, repeat: int = 2) -> dict:
    """Raw sequential read of `nbytes` from the start of the namespace into a registered
    buffer, MDTS commands with the source's queue depth: comparable to dd iflag=direct.
    Best of `repeat` runs (the first also warms the host's cache of the image in a VM)."""
    chunk = min(64 << 20, nbytes)       # several queue depths per call: the pipeline stays full
    mem, buf = _pinned(chunk)
    region = src.t.dma_map(buf)
    nbytes -= nbytes % src.lba_size
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        pos = 0
        while pos < nbytes:
            n = min(chunk, nbytes - pos)
            src.ctrl.read_into(src.io, pos, n, region, depth=src.queue_depth)
            pos += n
        runs.append(nbytes / (time.perf_counter() - t0) / 1e9)
    src.t.dma_free(region)
    return {"bench_bytes": nbytes, "bench_seconds": nbytes / max(runs) / 1e9,
            "bench_gbps": max(runs), "bench_runs_gbps": runs}


# --------------------------------------------------------------------------- the daemon's admin verbs

def _admin(args):
    return AdminClient(args.admin_socket, timeout=args.timeout)


def _daemon_verb(run) -> int:
    try:
        return run()
    except NtxError as e:
        _err(str(e))
        return EXIT_FAIL


def cmd_model_load(args) -> int:
    path = os.path.abspath(args.path) if args.path else ""
    if path and not os.path.isfile(path):
        _err(f"no model file at {path}: give the path of a .gguf file")
        return EXIT_REFUSED

    def run():
        with _admin(args) as admin:
            done = threading.Event()
            if sys.stderr.isatty():  # the load itself is one blocking call: show its progress beside it
                threading.Thread(target=_show_load_progress, args=(admin.socket, done), daemon=True).start()
            try:
                info = admin.load_model(path, args.backend or "")
            finally:
                done.set()
            print(f"loaded {info.path} ({info.n_layers} layers, {info.backend} backend)")
        return EXIT_OK
    return _daemon_verb(run)


def _show_load_progress(socket: str, done) -> None:
    width = 0
    with Client(socket, timeout=2) as c:
        while not done.wait(0.3):
            try:
                s = c.status()
            except NtxError:
                continue
            if s.load_progress and s.state == pb.SERVING_STATE_LOADING:
                text = f"{s.load_progress} ({s.load_fraction:.0%})"
                sys.stderr.write("\r" + text.ljust(width))
                sys.stderr.flush()
                width = len(text)
    if width:
        sys.stderr.write("\r" + " " * width + "\r")


def cmd_model_unload(args) -> int:
    def run():
        with _admin(args) as admin:
            admin.unload_model(args.drain_timeout or 0)
        print("model unloaded")
        return EXIT_OK
    return _daemon_verb(run)


def cmd_drain(args) -> int:
    def run():
        with _admin(args) as admin:
            r = admin.drain(args.drain_timeout or 0)
        print(f"draining: {r.finished} requests finished, {r.cancelled} cancelled; no new ones until "
              "ntx-admin resume")
        return EXIT_OK
    return _daemon_verb(run)


def cmd_resume(args) -> int:
    def run():
        with _admin(args) as admin:
            admin.resume()
        print("admitting requests again")
        return EXIT_OK
    return _daemon_verb(run)


def cmd_shutdown(args) -> int:
    def run():
        with _admin(args) as admin:
            admin.shutdown(args.drain_timeout or 0)
        print("ntransformerd is draining and will exit")
        return EXIT_OK
    return _daemon_verb(run)


def _add_daemon_verbs(sub) -> None:
    def common(s, *, drain: bool = False):
        s.add_argument("--admin-socket", help="the daemon's admin socket (default $NTX_ADMIN_SOCKET, else as "
                       "root admin.sock next to the user socket, as another user the one in $XDG_RUNTIME_DIR)")
        s.add_argument("--timeout", type=float, help="seconds before the call gives up")
        if drain:
            s.add_argument("--drain-timeout", type=float, metavar="S",
                           help="seconds in-flight requests get to finish (default: the daemon's drain_timeout)")

    m = sub.add_parser("model", help="load or unload the daemon's model").add_subparsers(dest="verb", required=True)
    s = m.add_parser("load", help="load a GGUF (in-flight requests finish first)")
    s.add_argument("path", nargs="?", metavar="PATH", help="GGUF file (default: the embedded model)")
    s.add_argument("--backend", choices=("cpu", "cpu-ref", "cuda", "auto"), help="default: the daemon's")
    common(s)
    s.set_defaults(func=cmd_model_load)
    s = m.add_parser("unload", help="drop the model; requests get FAILED_PRECONDITION until a load")
    common(s, drain=True)
    s.set_defaults(func=cmd_model_unload)
    for name, func, text in (("drain", cmd_drain, "stop admitting requests; finish or cancel in-flight ones"),
                             ("resume", cmd_resume, "admit requests again after a drain"),
                             ("shutdown", cmd_shutdown, "drain, then the daemon exits 0 (as SIGTERM)")):
        s = sub.add_parser(name, help=text)
        common(s, drain=name != "resume")
        s.set_defaults(func=func)


# --------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ntx-admin", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("devices", help="list NVMe devices and whether they may be used")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_devices)
    s = sub.add_parser("check", help="check IOMMU, vfio, memlock, hugepages, GPU, Secure Boot")
    s.add_argument("--root", default="/", help=argparse.SUPPRESS)
    s.set_defaults(func=cmd_check)
    for name, func in (("setup", cmd_setup), ("restore", cmd_restore)):
        s = sub.add_parser(name, help=f"{name} host configuration (backed up, undoable)")
        s.add_argument("--dry-run", action="store_true", help="print the diff, change nothing")
        s.add_argument("--root", default="/", help="apply under this directory tree")
        s.set_defaults(func=func)
    s = sub.add_parser("stage", help="write a GGUF onto a dedicated NVMe namespace")
    s.add_argument("model")
    s.add_argument("--device", required=True)
    s.add_argument("--no-verify", action="store_true")
    s.set_defaults(func=cmd_stage)
    s = sub.add_parser("bind", help="give the controller to vfio-pci")
    s.add_argument("device", nargs="?", help="/dev/nvmeXnY or PCI address")
    s.add_argument("--service", action="store_true",
                   help="the drive ntransformerd's config names, after every check (the unit's "
                        "ExecStartPre)")
    s.add_argument("--config", default=DEFAULT_CONFIG,
                   help=f"ntransformerd's config (with --service; default {DEFAULT_CONFIG})")
    s.set_defaults(func=cmd_bind)
    s = sub.add_parser("unbind", help="give the controller back to nvme")
    s.add_argument("pci_address", nargs="?")
    s.add_argument("--service", action="store_true",
                   help="hand back the drive the service's start step bound (ExecStopPost)")
    s.set_defaults(func=cmd_unbind)
    s = sub.add_parser("verify", help="read the staged model through our driver")
    s.add_argument("pci_address")
    s.add_argument("--noiommu", action="store_true", help="no-IOMMU mode (unsafe; explicit)")
    s.add_argument("--depth", type=int, default=32, help="commands in flight per queue")
    s.add_argument("--queues", type=int, default=1, help="I/O queue pairs")
    s.add_argument("--bench-bytes", type=int, default=0,
                   help="also time a raw read of this many bytes")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_verify)
    _add_daemon_verbs(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    confirm = None
    for a in list(argv):
        if a.startswith(CONFIRM_PREFIX):
            confirm = a[len(CONFIRM_PREFIX):]
            argv.remove(a)
    args = build_parser().parse_args(argv)
    args.confirm = confirm
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
