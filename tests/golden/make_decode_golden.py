"""Make a decode-identity golden file: what every decode path gives on the default model.

The paths are the ones a change to the decode loop must leave alone: `engine.generate`
(`ntx-model run`), `speculative.generate` (`ntx-model run --speculative`) and the daemon's
scheduler serving a dozen requests at once (continuous batching, a queue, prompts that share
prefixes), with and without speculation, prefix cache on and off, and again on a context that
ends mid-generation. Each case records token ids, text and finish reason, for greedy, seeded
sampling from the top ids (top-k 40), seeded sampling from whole rows (penalties) and a
greedy case with stop strings.

tests/engine/test_decode_identity.py runs the same `outputs()` and compares. The file is
made once from the code before a change to the loop, then kept: the test then proves the
change kept every id. Sampled speculation depends on draft lengths, so the cost table is fixed
(FLAT) rather than measured.

One golden per kind of CPU kernels. The "cpu" backend's kernels are compiled per instruction
set (backends/host/native.py, VARIANTS) and each variant sums in its own order, so the logits
differ in their last bits and, over 24 tokens, about half the outputs differ between avx512,
avx2 and generic. Nothing else on the machine moved an id: the thread count (1, 2, 5),
OpenBLAS's kernel (OPENBLAS_CORETYPE) and numpy's SIMD dispatch (NPY_DISABLE_CPU_FEATURES)
left every output alone. So tests/golden/decode_smollm2_<variant>.json holds the outputs of
that variant's kernels and, under "numerics", what they were made with: the variant, the
machine, the compiler (null where not recorded).

The golden of the variant this machine runs (the best its CPU has, as the daemon picks):

    PYTHONPATH=$PWD/daemon:$PWD/client:$PWD/system:$PWD/proto .venv/bin/python tests/golden/make_decode_golden.py

and of another variant the CPU runs (an AVX-512 machine makes both x86 goldens):

    ... tests/golden/make_decode_golden.py --variant avx512   # AVX-512 with VNNI: decode_smollm2_avx512.json
    ... tests/golden/make_decode_golden.py --variant avx2     # AVX2, FMA, F16C: decode_smollm2_avx2.json

About 30 s on two cores (avx2; generic about 3 min). Before committing a new golden, make it
twice and `cmp` the two files: a machine's outputs must not change from one run to the next.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
N = 24  # tokens per request
SMALL_CTX = 40  # the engine whose context ends mid-generation


def golden_path(variant: str) -> str:
    """The golden file of the CPU kernels' `variant` (a native.VARIANTS name)."""
    return os.path.join(HERE, f"decode_smollm2_{variant}.json")


def numerics(cpu_kernels: str = "auto") -> dict:
    """What this process's outputs depend on: the variant of the CPU kernels the engines run
    (the cpu_kernels setting), and for the record the machine and the compiler that built them."""
    from ntransformerd.engine.backends.host import native

    cc = native.compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    return {"kernel_variant": native.load(cpu_kernels).variant.name, "machine": platform.machine(),
            "compiler": version.splitlines()[0] if version else cc}


def check_variant(name: str) -> None:
    """A --variant the CPU cannot run (or no variant at all) stops here, before any engine loads."""
    from ntransformerd.engine.backends.host import native

    try:
        native.choose(name)
    except ValueError as e:  # an unknown name, or native.UnsupportedVariant
        raise SystemExit(f"--variant {name}: {e}") from None


def cases():
    """(name, SamplingParams) of every case."""
    from ntransformerd.engine.generation.sampler import SamplingParams

    return [
        ("greedy", SamplingParams.greedy(max_tokens=N, ignore_eos=True)),
        ("sampled", SamplingParams(temperature=0.8, seed=1234, max_tokens=N, ignore_eos=True)),
        ("penalised", SamplingParams(temperature=1.0, top_k=0, top_p=0.9, min_p=0.02, repetition_penalty=1.3,
                                     frequency_penalty=0.2, presence_penalty=0.1, seed=7, max_tokens=N)),
        ("stops", SamplingParams.greedy(max_tokens=N, stop=(" the", ", 1", "\n\n"))),
    ]


def prompts(engine) -> dict[str, list[int]]:
    with open(os.path.join(HERE, "forward_smollm2.json")) as f:
        by_name = {p["name"]: p["prompt_ids"] for p in json.load(f)["prompts"]}
    with open(os.path.join(HERE, "code_edit_prompt.json")) as f:
        code = json.load(f)
    return {"numbers": by_name["numbers"], "chat": by_name["chat"], "code_edit": engine.encode_chat(code["messages"])}


def flat_costs():
    """A PCIe-bound stream's cost shape, fixed so that draft lengths do not depend on timing."""
    from ntransformerd.engine.generation import speculative as sp
    return sp.StepCosts({1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2})


def engines(cpu_kernels: str = "auto"):
    """(the engine every case runs on, one whose context ends at SMALL_CTX positions), on the
    CPU kernels of `cpu_kernels`."""
    from ntransformerd.engine.runtime.engine import Engine, EngineConfig
    big = Engine.load(None, config=EngineConfig(backend="cpu", max_batch=8, max_ctx=1024, prefill_chunk=128,
                                                cpu_kernels=cpu_kernels))
    small = Engine.load(None, config=EngineConfig(backend="cpu", max_batch=2, max_ctx=SMALL_CTX, prefill_chunk=16,
                                                  cpu_kernels=cpu_kernels))
    return big, small


def result(ids, texts, finish) -> dict:
    return {"ids": [int(i) for i in ids], "text": "".join(texts), "finish": finish}


def solo(engine, ids, params, mode: str | None) -> dict:
    """engine.generate, or speculative.generate with `mode`'s draft."""
    from ntransformerd.engine.generation import speculative as sp
    from ntransformerd.engine.runtime.engine import generate

    if mode is None:
        events = list(generate(engine, ids, params))
    else:
        spec = sp.Speculator(engine, sp.make_draft(mode, engine), costs=flat_costs())
        events = list(sp.generate(engine, ids, params, spec))
    return result([e.token for e in events], [e.text for e in events], events[-1].finish_reason)


SPEC_MODES = ("off", "ngram", "prefix:15")  # a speculating batch: the requests take turns


def spec_mode(i: int, speculate: bool) -> str:
    """The speculation mode of request i of a served batch ("off": none)."""
    return SPEC_MODES[i % len(SPEC_MODES)] if speculate else "off"


def served(engine, work: list[tuple[list[int], object]], *, prefix_cache: bool, speculate: bool,
           max_batch: int, rounds: int = 1) -> list[dict]:
    """Every request of `work` queued at once on the daemon's scheduler (in this process, one
    iteration at a time), `rounds` times over (a second round meets the prefix cache)."""
    from ntransformerd.config import DaemonConfig
    from ntransformerd.engine.generation.speculative import Mode
    from ntransformerd.server.scheduler import Scheduler
    from ntransformerd.server.systemd import Notifier
    from ntx_proto.states import RequestState

    config = DaemonConfig(socket="/tmp/ntx-golden.sock", max_batch=max_batch, max_queue=64,
                          prefix_cache=prefix_cache, prefill_chunk=engine.config.prefill_chunk)
    s = Scheduler(config=config, notifier=Notifier(environ={}))
    s.attach(engine, costs=flat_costs())
    s.lifecycle.serving()
    out = []
    try:
        for _ in range(rounds):
            reqs = [s.schedule(ids, params, max_tokens=params.max_tokens,
                               speculative=Mode.parse(spec_mode(i, speculate)))
                    for i, (ids, params) in enumerate(work)]
            while any(r.state != RequestState.DONE for r in reqs):  # retired: every slot is free again
                s.iterate()
            for r in reqs:
                outs = list(r.stream())
                out.append(result([i for o in outs for i in o.token_ids], [o.text for o in outs],
                                  outs[-1].finish_reason))
    finally:
        s.stop()
    return out


def outputs(big, small) -> dict:
    """Every case's output, by path."""
    ps = prompts(big)
    got: dict = {}
    for mode in (None, "ngram", "prefix:15"):
        path = f"generate/{mode or 'plain'}"
        got[path] = {f"{p}/{c}": solo(big, ids, params, mode) for p, ids in ps.items() for c, params in cases()}
    work = [(ids, params) for ids in ps.values() for _, params in cases()]
    names = [f"{p}/{c}" for p in ps for c, _ in cases()]
    for prefix_cache in (False, True):
        for speculate in (False, True):
            res = served(big, work, prefix_cache=prefix_cache, speculate=speculate, max_batch=8,
                         rounds=2 if prefix_cache else 1)
            path = f"scheduler/prefix_cache={'on' if prefix_cache else 'off'}/speculation={'on' if speculate else 'off'}"
            got[path] = {f"{n}#{k // len(work)}": r for k, (n, r) in enumerate(zip(names * 2, res))}
    from ntransformerd.engine.generation.sampler import SamplingParams
    full = SamplingParams.greedy(max_tokens=SMALL_CTX, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=SMALL_CTX, ignore_eos=True)
    ids = ps["numbers"]
    got["context_end"] = {
        "generate/greedy": solo(small, ids, full, None), "generate/sampled": solo(small, ids, sampled, None),
        "speculative/ngram": solo(small, ids, full, "ngram"),
        "scheduler": dict(zip(("greedy", "sampled"), served(small, [(ids, full), (ids, sampled)], prefix_cache=True,
                                                            speculate=False, max_batch=2))),
        "scheduler/speculation": dict(zip(("greedy", "ngram"), served(small, [(ids, full), (ids, full)],
                                                                     prefix_cache=True, speculate=True,
                                                                     max_batch=2))),
    }
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description="Write the decode-identity golden of this machine's CPU kernels.")
    ap.add_argument("--variant", default="auto", help="run the kernels of this variant (avx512, avx2, generic: "
                                                      "EngineConfig.cpu_kernels) instead of the best this CPU has; "
                                                      "the CPU must run it")
    args = ap.parse_args()
    check_variant(args.variant)
    made = numerics(args.variant)
    got = outputs(*engines(args.variant))
    path = golden_path(made["kernel_variant"])
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"numerics": made, **got}, f, indent=1, ensure_ascii=False)
        f.write("\n")
    n = sum(len(v) for v in got.values())
    print(f"wrote {path}: {n} outputs, {made}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
