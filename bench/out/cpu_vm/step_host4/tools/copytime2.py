import os, sys, time
root = sys.argv[1]; sys.path.insert(0, os.path.join(root, "daemon"))
from ntransformerd.engine.runtime.engine import Engine, EngineConfig
eng = Engine.load(config=EngineConfig(backend="cpu", max_batch=64, max_ctx=512))
src = eng.open(); eng.step([(src, list(range(1, 41)))])
import resource, subprocess
for rnd in range(3):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; v0 = open('/proc/vmstat').read().split('thp_fault_alloc ')[1].split()[0]
    ds = [eng.open() for _ in range(63)]
    hold = [eng.open() for _ in range(0)]
    ts = []
    for d in ds:
        c, t = time.thread_time(), time.perf_counter()
        eng.copy_prefix(src, d, 40)
        eng.kv.reserve(d, 40 + 128)
        ts.append((time.perf_counter() - t) * 1e6)
    ts.sort()
    v1 = open('/proc/vmstat').read().split('thp_fault_alloc ')[1].split()[0]
    print("minflt", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0, "thp", int(v1) - int(v0))
    print(f"{root} round {rnd}: copy_prefix us median {ts[31]:.0f} min {ts[0]:.0f} max {ts[-1]:.0f}")
    for d in ds:
        eng.close(d)
