"""Runs inside the VM guest: a list of steps in ONE Python process, because each Python start
costs ~10 s under TCG.  Steps come as JSON [[name, kind, args], ...]; kind "admin" calls
ntx_system.admin.main(args), "sh" runs a shell command, "reader" opens the staged device with
our driver and reads extents forever (the SIGKILL test), touching READY_FILE once reading.
Prints '@@ name' before and '@@ rc=N' after each step."""
import json
import os
import subprocess
import sys


def reader(pci, ready_file):
    import mmap

    import numpy as np

    from ntx_system.source import NvmeStagedSource
    src = NvmeStagedSource.open(pci, queue_depth=32)
    mem = mmap.mmap(-1, 64 << 20)
    buf = np.frombuffer(mem, np.uint8)
    src.register_buffer(buf)
    extents = list(src.extents().values())
    first = True
    while True:                      # killed from outside; never returns
        for off, length in extents:
            src.read_into(off, min(length, buf.nbytes), buf)
            if first:
                open(ready_file, "w").close()
                first = False


def intact(dev):
    """After unbind: the kernel driver reads the staged model back and every extent matches."""
    import time

    from ntx_system import staging
    for _ in range(100):
        if os.path.exists(dev):
            break
        time.sleep(0.1)
    layout = staging.read_layout(dev)
    read_at = staging.direct_reader(dev)
    bad = staging.verify_extents(read_at, layout)
    print("INTACT" if not bad else f"BAD {bad}", layout.model_sha256)
    return 0 if not bad else 1


def main():
    if sys.argv[1] == "--intact":
        sys.exit(intact(sys.argv[2]))
    sys.stderr = sys.stdout
    sys.stdin = open(os.devnull)
    from ntx_system import admin
    steps = json.load(open(sys.argv[1]))
    for name, kind, args in steps:
        print(f"@@ {name}", flush=True)
        try:
            if kind == "admin":
                rc = admin.main(args)
            elif kind == "sh":
                rc = subprocess.run(args, shell=True, stdout=sys.stdout,
                                    stderr=subprocess.STDOUT).returncode
            elif kind == "reader":
                reader(*args)
                rc = 0
            else:
                raise ValueError(kind)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except Exception as exc:          # report and carry on: later steps may still run
            print(f"step {name} raised {type(exc).__name__}: {exc}")
            rc = 99
        sys.stdout.flush()
        print(f"@@ rc={rc}", flush=True)


if __name__ == "__main__":
    main()
