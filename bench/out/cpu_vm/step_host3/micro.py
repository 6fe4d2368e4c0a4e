"""Per-step scheduler Python on the tests' FakeEngine (device-like, overlap): N decoding requests.
usage: micro.py TREE [N]"""
import sys, time
tree = sys.argv[1]; N = int(sys.argv[2]) if len(sys.argv) > 2 else 64
sys.path.insert(0, tree + "/tests/server"); sys.path.insert(0, tree + "/tests")
import test_scheduler as T
from ntransformerd.engine.runtime.engine import default_model_path
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.generation.tokenizer import Tokenizer
from ntransformerd.engine.generation.sampler import SamplingParams
tok = Tokenizer.from_metadata(GGUFModel(default_model_path()).metadata)
from ntransformerd.config import DaemonConfig
from ntransformerd.server.scheduler import Scheduler
from ntransformerd.server.systemd import Notifier
s = Scheduler(config=DaemonConfig(socket="/tmp/x.sock", prefix_cache=False, max_batch=N), notifier=Notifier(environ={}))
engine = T.FakeEngine(tok, slots=N, max_ctx=8192)
s.attach(engine); s.lifecycle.serving()
reqs = [s.schedule(list(range(10, 30)), SamplingParams.greedy(ignore_eos=True), max_tokens=8000) for _ in range(N)]
for _ in range(20):
    s.iterate()
assert all(r.seq.decoding for r in reqs), [r.state for r in reqs]
fn = getattr(s, "_running_all", None) or getattr(s, "_describe", None)
def best(f, n=300, reps=7):
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            f()
        out.append((time.perf_counter() - t) / n * 1e6)
    return min(out)
if fn is not None:
    print(f"_running_all  {best(lambda: fn(s._live)):7.1f} µs")
from ntransformerd.server import policy
run = fn(s._live) if fn else None
print("rows", len(s.compose()), "in flight", len(s.runner.in_flight or ()), "draws_ahead", s.runner.draws_ahead)
if run is not None: print(f"policy.compose {best(lambda: policy.compose(run, s.config.prefill_chunk, overlap=s.overlap)):7.1f} µs")
print(f"compose       {best(s.compose):7.1f} µs")
#print(f"iterate       {best(s.iterate, 150):7.1f} µs  (fake engine step included)")

print(f"retire        {best(lambda: s.retire() if False else s.retire()):7.1f} µs")
p = s.runner.pending
def setp():
    s.runner.pending = p
print(f"pending set   {best(setp):7.1f} µs")
s.stop()
