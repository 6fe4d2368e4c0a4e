import os, sys, time
root = sys.argv[1]; sys.path.insert(0, os.path.join(root, "daemon"))
from ntransformerd.engine.runtime.engine import Engine, EngineConfig
eng = Engine.load(config=EngineConfig(backend="cpu", max_batch=64, max_ctx=512))
src = eng.open(); eng.step([(src, list(range(1, 41)))])
for rnd in range(3):
    ds = [eng.open() for _ in range(63)]
    ts = []
    for d in ds:
        c, t = time.thread_time(), time.perf_counter()
        eng.copy_prefix(src, d, 40)
        ts.append((time.perf_counter() - t) * 1e6)
    ts.sort()
    print(f"{root} round {rnd}: copy_prefix us median {ts[31]:.0f} min {ts[0]:.0f} max {ts[-1]:.0f}")
    for d in ds:
        eng.close(d)
