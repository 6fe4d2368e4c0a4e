"""The engine on the CUDA backend against the CPU backend, through Engine.step (which routes
one-token steps to the captured decode graphs): synthetic models, and a real-weights slice of
the default model (`ntx-model slice --layers 4`, carried to the GPU machine in .gpu-data/)."""
import os

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from ntransformerd.engine.engine import Engine, EngineConfig  # noqa: E402
from ntransformerd.engine.gguf_file import GGUFModel  # noqa: E402
from ntransformerd.engine.synth import synthesize  # noqa: E402

SLICE = os.environ.get("NTX_REAL_SLICE", os.path.join(os.path.dirname(__file__), "..", "..", ".gpu-data",
                                                      "smollm2-4l.gguf"))


def greedy(engine: Engine, prompt, n):
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


@pytest.mark.parametrize("ftype", ["q8_0", "q4_k_m"])
def test_engine_cuda_agrees_with_cpu(tmp_path, ftype):
    path = str(tmp_path / f"small-{ftype}.gguf")
    synthesize(path, shape="small", ftype=ftype, seed=3)
    m = GGUFModel(path)
    cfg = EngineConfig(max_seqs=2, max_ctx=256)
    cpu_e = Engine(m, config=cfg)
    gpu_e = Engine(m, config=EngineConfig(backend="cuda", max_seqs=2, max_ctx=256))
    assert gpu_e.backend_name == "cuda" and gpu_e._decoder is not None
    tokens = [int(x) for x in np.random.default_rng(0).integers(100, 40000, 68)]
    a, b = teacher_forced(cpu_e, tokens), teacher_forced(gpu_e, tokens)
    rel = np.abs(a - b).max() / np.abs(a).max()
    top1 = float((a.argmax(-1) == b.argmax(-1)).mean())
    assert rel < 2e-2, rel
    assert top1 >= 0.99, top1


def test_real_slice_greedy_identical():
    if not os.path.exists(SLICE):
        pytest.skip(f"no real-weights slice at {SLICE} (ntx-model slice .gpu-data/smollm2-4l.gguf --layers 4)")
    m = GGUFModel(SLICE)
    cpu_e = Engine(m, config=EngineConfig(max_seqs=1, max_ctx=256))
    gpu_e = Engine(m, config=EngineConfig(backend="cuda", max_seqs=1, max_ctx=256))
    for text in ("The capital of France is", "def fibonacci(n):"):
        prompt = cpu_e.tokenizer.encode(text)
        assert greedy(gpu_e, prompt, 32) == greedy(cpu_e, prompt, 32), text
