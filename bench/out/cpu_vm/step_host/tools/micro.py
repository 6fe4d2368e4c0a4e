"""Per-step host cost of decode.step for B decode rows on an instant pipeline (engine only)."""
import sys, os, time, cProfile, pstats
root = sys.argv[1]
for p in ("daemon", "client", "proto", "bench"):
    sys.path.insert(0, os.path.join(root, p))
import numpy as np
from host_share import InstantStep
from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.generation import decode
from ntransformerd.engine.generation.sampler import SamplingParams

B = int(sys.argv[2]); sampled = sys.argv[3] == "s"; prof = len(sys.argv) > 4
eng = Engine.load(config=EngineConfig(backend="cpu", max_batch=B, max_ctx=2048))
eng.pipeline.step = InstantStep(eng.cfg.vocab_size)
params = SamplingParams(seed=1, ignore_eos=True, max_tokens=100000) if sampled else SamplingParams.greedy(ignore_eos=True, max_tokens=100000)
seqs = [decode.Sequence(eng, [1, 2, 3, 4 + i], params) for i in range(B)]
for s in seqs:
    s.open()
decode.step(eng, [s.row(64) for s in seqs])
def run(n):
    for _ in range(n):
        decode.step(eng, [s.row(64) for s in seqs])
run(20)
if prof:
    pr = cProfile.Profile(); pr.runcall(run, 300); pstats.Stats(pr).sort_stats("tottime").print_stats(25); sys.exit()
best = []
for r in range(5):
    t = time.perf_counter(); run(200); best.append((time.perf_counter() - t) / 200)
dev = eng.pipeline.step.device_s / (20 + 1000 + 1)
print(f"dev~{dev*1e6:.0f}us B={B} {'sampled' if sampled else 'greedy'}: {min(best)*1e6:.0f} us/step, {min(best)*1e6/B:.1f} us/row  ids {seqs[0].history[-3:]}")
