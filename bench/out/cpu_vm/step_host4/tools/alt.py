"""Per-step host cost of decode.launch + Launched.finish on the engine alone (cpu backend, default
model), launched steps as on a device (Engine.overlaps forced, the pipeline's launch a stand-in
that hands back each row's draw at once), B decode rows:
  same: every step runs all B rows, each after the step in flight (runs ahead);
  alt:  the rows in two halves taking turns (step n one half, n+1 the other), as the overlapped
        loop's steps alternate where some rows need the host.
usage: alt.py ROOT B g|s same|alt [prof]. Prints us/step and the last ids of rows 0 and B-1."""
import cProfile, os, pstats, sys, time
root = sys.argv[1]
for p in ("daemon", "client", "proto", "bench"):
    sys.path.insert(0, os.path.join(root, p))
import numpy as np
from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.generation import decode
from ntransformerd.engine.generation.sampler import Drawn, SamplingParams

B, sampled, mode, prof = int(sys.argv[2]), sys.argv[3] == "s", sys.argv[4], len(sys.argv) > 5
eng = Engine.load(config=EngineConfig(backend="cpu", max_batch=B, max_ctx=2048))
V = eng.cfg.vocab_size


class Handle:
    def __init__(self, drawn):
        self.drawn = drawn

    def result(self):
        return self.drawn


def launch(batch, *, sample=None, all_logits=False, top=None, layers=None, after=None, rows=None):
    if after is not None:
        ids = after.drawn.ids
        for seg, j in zip(batch.segments, rows):
            if j >= 0:
                seg.tokens[-1] = ids[j]
    # each row's draw: a function of its token and its uniform (so the uniforms count in the ids)
    last = np.fromiter((int(s.tokens[-1]) for s in batch.segments), np.int64, len(batch.segments))
    u = np.nan_to_num(sample.uniform, nan=0.5)
    ids = (last * 7 + 1 + (u * 97).astype(np.int64)) % V
    return Handle(Drawn(np.where(sample.draws, ids, -1), np.zeros(len(ids), np.int8)))


eng.pipeline.launch = launch
Engine.overlaps = lambda self, n: True
params = SamplingParams(seed=1, ignore_eos=True, max_tokens=10**6) if sampled else \
    SamplingParams.greedy(ignore_eos=True, max_tokens=10**6)
seqs = [decode.Sequence(eng, [1, 2, 3, 4 + i], params) for i in range(B)]
for i, s in enumerate(seqs):
    s.sampler.rng = np.random.default_rng(i)
    s.open()
decode.step(eng, [s.row(64) for s in seqs])
halves = [seqs] if mode == "same" else [seqs[:B // 2], seqs[B // 2:]]
state = {"prev": None, "k": 0}


def one():
    group = halves[state["k"] % len(halves)]
    state["k"] += 1
    prev = state["prev"]
    cur = decode.launch(eng, [s.row(64) for s in group], prev)
    if prev is not None:
        prev.finish(cur)
    state["prev"] = cur


def run(n):
    for _ in range(n):
        one()


run(20)
if prof:
    pr = cProfile.Profile(); pr.runcall(run, 400); pstats.Stats(pr).sort_stats("tottime").print_stats(20); sys.exit()
best = []
for r in range(5):
    t = time.perf_counter(); run(200); best.append((time.perf_counter() - t) / 200)
state["prev"].finish()
print(f"B={B} {'sampled' if sampled else 'greedy'} {mode}: {min(best)*1e6:.0f} us/step (median {sorted(best)[2]*1e6:.0f}), "
      f"ids {seqs[0].history[-3:]} {seqs[-1].history[-3:]} len {len(seqs[0].history)}")
