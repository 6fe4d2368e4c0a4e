"""GIL releases (PyEval_SaveThread, counted by gdb between SIGUSR1 and SIGUSR2) of the engine's
KV copies on the cpu backend: copy_prefix of a 40-position prompt (2 blocks shared, the third
copied), and a catch-up copy_prefix whose start falls inside a block (rows copied)."""
import os, signal, sys
root = sys.argv[1]; sys.path.insert(0, os.path.join(root, "daemon"))
from ntransformerd.engine.runtime.engine import Engine, EngineConfig
eng = Engine.load(config=EngineConfig(backend="cpu", max_batch=8, max_ctx=512))
src = eng.open(); eng.step([(src, list(range(1, 41)))])
which = sys.argv[2]
dsts = [eng.open() for _ in range(6)]
if which == "catchup":
    for d in dsts:
        eng.step([(d, list(range(1, 21)))])
os.kill(os.getpid(), signal.SIGUSR1)
for d in dsts[:5]:
    if which == "share":
        eng.copy_prefix(src, d, 40)
    else:  # catch-up: d holds 20 positions of its own, takes 20..40
        eng.copy_prefix(src, d, 40)
os.kill(os.getpid(), signal.SIGUSR2)
