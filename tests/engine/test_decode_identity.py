"""Every decode path gives, id for id, what it gave when tests/golden/decode_smollm2.json was
made (tests/golden/make_decode_golden.py): `engine.generate`, `speculative.generate` with two
draft sources, and the daemon's scheduler serving twelve requests at once, with and without
speculation, prefix cache on and off, greedy, seeded sampling (top ids and whole rows, with
penalties), stop strings, and a context that ends mid-generation. A change to the decode loop
that moves one draw, one stop or one context check fails here, naming the case."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "golden", "make_decode_golden.py")

pytestmark = pytest.mark.slow  # ~45 s on two cores


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


def test_every_decode_path_gives_the_golden_ids():
    mod = _golden_module()
    with open(mod.GOLDEN) as f:
        want = _flat(json.load(f))
    got = _flat(mod.outputs(*mod.engines()))
    assert set(got) == set(want), f"cases differ: {sorted(set(got) ^ set(want))[:5]}"
    wrong = [k for k in want if got[k] != want[k]]
    detail = [f"{k}: ids {got[k]['ids']} finish {got[k]['finish']} != {want[k]['ids']} finish {want[k]['finish']}"
              for k in wrong[:3]]
    assert not wrong, f"{len(wrong)} of {len(want)} outputs changed:\n" + "\n".join(detail)
