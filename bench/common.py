"""What every benchmark shares: its arguments, its JSON output, its smoke run.

    p = common.parser(__file__, __doc__)       # --smoke, --json PATH (default bench/out/<script>.json)
    p.add_argument(...)                         # the script's own
    args = p.parse_args()
    ...
    common.write_json(args.json, result)

A smoke run (`--smoke`) takes the script's whole path once on tiny synthetic models
(`ntx-model synth --shape tiny`, made by `synthetic`) and a few steps, in seconds: its figures
mean nothing; it proves that the script still runs against today's engine. tests/bench/
test_smoke.py runs every script that way (the GPU ones where there is a GPU). A GPU script on a
host without one says so and exits with SKIP (`require_gpu`), before it touches anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "out")  # ignored by git
SKIP = 77  # exit status of a script that cannot run on this host (automake's "skipped")


def parser(script: str, doc: str | None) -> argparse.ArgumentParser:
    """The script's parser with the shared flags; the first paragraph of doc describes it."""
    name = os.path.splitext(os.path.basename(script))[0]
    p = argparse.ArgumentParser(prog=f"bench/{name}.py", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="tiny synthetic models and a few steps: proves the script runs (the figures mean nothing)")
    p.add_argument("--json", metavar="PATH", default=os.path.join(OUT, f"{name}.json"),
                   help=f"where the results go (default: bench/out/{name}.json)")
    return p


def write_json(path: str, data) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {path}", flush=True)


def synthetic(directory: str, shape: str = "tiny", ftype: str = "q8_0", *, seed: int = 0,
              vocab: int | None = None, n_layers: int | None = None, context: int | None = None) -> str:
    """The synthetic model `shape` (synth.SHAPES: tiny, small, llama3-8b, llama3-70b) in `ftype`
    with random weights, written into directory if missing (as `ntx-model synth` writes it).
    vocab: keep only the first tokens of the default model's vocabulary (a smaller file, a
    faster load); None keeps all 49152, which prompts of real token ids need. n_layers, context
    (the file's context_length): other than the shape's. The file is named by what differs from
    the shape, so a name means one file: the llama3 shapes' context became 131072 (Llama 3.1) on
    2026-12-05, and a file of theirs made before then, under the same name, says 8192 (remove it)."""
    # Imported here, not at the top: a script may first choose which checkout's ntransformerd
    # it imports (bench/ab_decode.py --code, bench/sample_top.py --code).
    from ntransformerd.tools import synth

    os.makedirs(directory, exist_ok=True)
    name = f"{shape}-{ftype}" + (f"-v{vocab}" if vocab else "") + (f"-l{n_layers}" if n_layers else "") + \
        (f"-c{context}" if context else "") + (f"-s{seed}" if seed else "")
    path = os.path.join(directory, name + ".gguf")
    if not os.path.exists(path):
        s = synth.SHAPES[shape]
        s = dataclasses.replace(s, vocab=vocab or s.vocab, n_layers=n_layers or s.n_layers, context=context or s.context)
        t = time.perf_counter()
        # written beside, then renamed: a script waiting for the file never opens half of it
        part = path + f".part{os.getpid()}"
        synth.synthesize(part, shape=s, ftype=ftype, seed=seed)
        os.replace(part, path)
        print(f"synthesized {path} in {time.perf_counter() - t:.1f} s", flush=True)
    return path


def gpu_missing() -> str | None:
    """Why CUDA work cannot run here, or None."""
    try:
        import cupy  # optional: the gpu extra
    except ImportError:
        return "CuPy is not installed (pip install 'ntransformer[gpu]')"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver
        return f"CuPy sees no CUDA device ({e.__class__.__name__})"
    return None if n > 0 else "CuPy sees no CUDA device"


def require_gpu(script: str) -> None:
    """Exit with SKIP, saying why, unless CuPy sees a CUDA device."""
    why = gpu_missing()
    if why:
        print(f"bench/{os.path.basename(script)}: skipped: it needs a CUDA GPU and {why}", file=sys.stderr)
        raise SystemExit(SKIP)


def start_daemon(directory: str, flags: list[str], program: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """An unprivileged ntransformerd (`--config /dev/null`, no socket group) with its socket and
    log (daemon.log) in directory, given `flags`, serving: (process, socket). Exits with the log's
    tail if the daemon does. program: what runs it (default: python -m ntransformerd.main), given
    the daemon's flags."""
    from ntx_client import Client  # imported here: scripts choose the checkout they import first

    sock, log = os.path.join(directory, "d.sock"), os.path.join(directory, "daemon.log")
    program = program or [sys.executable, "-m", "ntransformerd.main"]
    proc = subprocess.Popen([*program, "--socket", sock, "--socket-group", "", "--config", os.devnull, *flags],
                            stderr=open(log, "w"))
    while not os.path.exists(sock):
        if proc.poll() is not None:
            with open(log) as f:
                raise SystemExit(f"ntransformerd exited {proc.returncode}: {f.read()[-2000:]}")
        time.sleep(0.05)
    with Client(sock) as c:
        c.wait_ready(600)
    return proc, sock


def stop_daemon(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)

