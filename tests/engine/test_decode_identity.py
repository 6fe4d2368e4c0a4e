"""Every decode path gives, id for id, what it gave when its golden was made
(tests/golden/make_decode_golden.py): `engine.generate`, `speculative.generate` with two
draft sources, and the daemon's scheduler serving twelve requests at once, with and without
speculation, prefix cache on and off, greedy, seeded sampling (top ids and whole rows, with
penalties), stop strings, and a context that ends mid-generation. A change to the decode loop
that moves one draw, one stop or one context check fails here, naming the case.

The ids depend on which variant of the CPU kernels runs (avx512, avx2, generic: each sums in
its own order), so there is one golden per variant, and the run is compared with the golden of
the variant this machine runs. Where there is none (a generic build, say), that test skips and
the paths are still checked against each other wherever the loop promises the same ids."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from ntransformerd.engine.backends import host

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "golden", "make_decode_golden.py")

pytestmark = [pytest.mark.slow,  # ~45 s on two cores
              pytest.mark.skipif(not host.available(), reason="no C compiler for the CPU kernels")]


def _golden_module():
    spec = importlib.util.spec_from_file_location("make_decode_golden", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and "ids" not in v:
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.fixture(scope="module")
def run():
    """(the golden script, this machine's numerics, every case's output flattened), run once."""
    mod = _golden_module()
    return mod, mod.numerics(), _flat(mod.outputs(*mod.engines()))


def test_every_decode_path_gives_the_golden_ids(run):
    mod, made, got = run
    path = mod.golden_path(made["kernel_variant"])
    if not os.path.exists(path):
        pytest.skip(f"no decode golden for the {made['kernel_variant']} CPU kernels this machine runs: "
                    f"make {os.path.relpath(path)} with tests/golden/make_decode_golden.py")
    with open(path, encoding="utf-8") as f:
        want = json.load(f)
    golden = want.pop("numerics")
    if golden["machine"] != made["machine"]:
        pytest.skip(f"{os.path.relpath(path)} was made on {golden['machine']}, this is {made['machine']}: "
                    f"the same variant compiles to other arithmetic there")
    want = _flat(want)
    assert set(got) == set(want), f"cases differ: {sorted(set(got) ^ set(want))[:5]}"
    wrong = [k for k in want if got[k] != want[k]]
    detail = [f"{k}: ids {got[k]['ids']} finish {got[k]['finish']} != {want[k]['ids']} finish {want[k]['finish']}"
              for k in wrong[:3]]
    assert not wrong, (f"{len(wrong)} of {len(want)} outputs changed (golden made with {golden}, this run with "
                       f"{made}):\n" + "\n".join(detail))


def _must_equal(mod, got: dict) -> dict[str, str]:
    """{case: the case whose output it must equal}. A greedy request (stop strings too) gets
    generate/plain's output on every path: speculation's greedy output is exact and a row's
    logits do not depend on the batch around it. A seeded sampled request gets it on every path
    where it does not speculate (a speculating one also draws from residuals). Where the
    context ends: greedy on every path, sampled on the scheduler."""
    greedy = {name for name, params in mod.cases() if params.temperature == 0}
    plain = "generate/plain/"
    served = [k.removeprefix(plain) for k in got if k.startswith(plain)]  # prompt/case, as the scheduler queues them
    pairs = {}
    for key in got:
        parts = key.split("/")
        if parts[0] == "generate" and parts[1] != "plain":  # generate/<draft>/<prompt>/<case>
            name, speculates = "/".join(parts[2:]), True
        elif parts[0] == "scheduler":  # scheduler/prefix_cache=…/speculation=…/<prompt>/<case>#<round>
            name = "/".join(parts[3:]).split("#")[0]
            speculates = mod.spec_mode(served.index(name), parts[2] == "speculation=on") != "off"
        else:
            continue
        if name.split("/")[-1] in greedy or not speculates:
            pairs[key] = plain + name
    end = "context_end/"
    pairs.update({end + k: end + "generate/greedy" for k in ("speculative/ngram", "scheduler/greedy",
                                                             "scheduler/speculation/greedy",
                                                             "scheduler/speculation/ngram")})
    pairs[end + "scheduler/sampled"] = end + "generate/sampled"
    return pairs


def test_decode_paths_agree_where_they_must(run):
    """What holds on every kind of kernels, a golden or not: the paths against each other."""
    mod, _, got = run
    pairs = _must_equal(mod, got)
    assert len(pairs) > len(got) // 2, f"only {len(pairs)} of {len(got)} outputs are compared: cases renamed?"
    wrong = [f"{k}: ids {got[k]['ids']} finish {got[k]['finish']} != {ref}: ids {got[ref]['ids']} finish "
             f"{got[ref]['finish']}" for k, ref in pairs.items() if got[k] != got[ref]]
    assert not wrong, (f"{len(wrong)} of {len(pairs)} outputs differ from the path they must equal:\n"
                       + "\n".join(wrong[:3]))
