"""The real-weights slice of the default model the GPU tests share (`ntx-model slice --layers 4`:
NTX_REAL_SLICE or .gpu-data/smollm2-4l.gguf where one was carried, else made from the default
model), and the greedy / teacher-forced runs they compare engines by."""
import os
import subprocess
import sys

import numpy as np
import pytest

from ntransformerd.engine.runtime.engine import Engine, default_model_path

CARRIED = (os.environ.get("NTX_REAL_SLICE"),
           os.path.join(os.path.dirname(__file__), "..", "..", ".gpu-data", "smollm2-4l.gguf"))


@pytest.fixture(scope="module")
def real_slice(tmp_path_factory) -> str:
    """The first 4 layers of the default model, real weights: a carried copy, or `ntx-model slice`."""
    for path in CARRIED:
        if path and os.path.exists(path):
            return path
    try:
        src = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"no real-weights slice carried and none can be made: {e}")
    out = str(tmp_path_factory.mktemp("slice") / "smollm2-4l.gguf")
    r = subprocess.run([sys.executable, "-m", "ntransformerd.tools.ntx_model", "slice", src, out, "--layers", "4",
                        "--quiet"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return out


def greedy(engine: Engine, prompt, n):
    """n greedy ids after `prompt`, one decode step each."""
    s = engine.open()
    try:
        logits, out = engine.prefill(s, prompt), []
        for _ in range(n):
            out.append(int(np.argmax(logits)))
            logits = engine.step([(s, [out[-1]])])[0]
        return out
    finally:
        engine.close(s)


def teacher_forced(engine: Engine, tokens):
    """Logits after each token, feeding the given tokens (one decode step each)."""
    s = engine.open()
    try:
        rows = [engine.prefill(s, tokens[:4])]
        for t in tokens[4:]:
            rows.append(engine.step([(s, [t])])[0])
        return np.stack(rows)
    finally:
        engine.close(s)
