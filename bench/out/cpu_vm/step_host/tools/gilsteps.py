import sys, os, signal
root = sys.argv[1]
for p in ("daemon", "client", "proto", "bench"):
    sys.path.insert(0, os.path.join(root, p))
from host_share import InstantStep
from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.generation import decode
from ntransformerd.engine.generation.sampler import SamplingParams
B = int(sys.argv[2]); sampled = sys.argv[3] == "s"
eng = Engine.load(config=EngineConfig(backend="cpu", max_batch=B, max_ctx=2048))
eng.pipeline.step = InstantStep(eng.cfg.vocab_size)
params = SamplingParams(seed=1, ignore_eos=True, max_tokens=100000) if sampled else SamplingParams.greedy(ignore_eos=True, max_tokens=100000)
seqs = [decode.Sequence(eng, [1, 2, 3, 4 + i], params) for i in range(B)]
for s in seqs:
    s.open()
for _ in range(3):
    decode.step(eng, [s.row(64) for s in seqs])
os.kill(os.getpid(), signal.SIGUSR1)
for _ in range(3):
    decode.step(eng, [s.row(64) for s in seqs])
os.kill(os.getpid(), signal.SIGUSR2)
