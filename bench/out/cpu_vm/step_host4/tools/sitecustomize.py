"""Per-call wall and thread CPU of a few engine calls in the daemon (NTX_INSTR=log): written at exit
and every 200 calls. Engine.copy_prefix (admission), SampleRows.of, Engine._segments, decode.launch."""
import os, resource, sys, time
if os.environ.get("NTX_INSTR"):
    import importlib.abc
    LOG = os.environ["NTX_INSTR"]
    STATS = {}

    def timed(key, f, rows):
        st = STATS.setdefault(key, [0, 0.0, 0.0, 0, 0])
        def w(*a, **k):
            c0, t0, f0 = time.thread_time(), time.perf_counter(), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            try:
                return f(*a, **k)
            finally:
                st[0] += 1; st[1] += time.thread_time() - c0; st[2] += time.perf_counter() - t0; st[3] += rows(a)
                st[4] += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0
                if st[0] % 200 == 0:
                    dump()
        return w

    def dump():
        with open(LOG, "a") as fh:
            for key, (n, c, t, r, fl) in STATS.items():
                if n:
                    fh.write(f"{os.getpid()} {key} calls {n} cpu/call {c/n*1e6:.1f} wall/call {t/n*1e6:.1f} rows/call {r/n:.1f} minflt/call {fl/n:.1f}\n")

    def install():
        import atexit
        from ntransformerd.engine.runtime.engine import Engine
        from ntransformerd.engine.generation.sampler import SampleRows
        from ntransformerd.engine.generation import decode
        Engine.copy_prefix = timed("Engine.copy_prefix", Engine.copy_prefix, lambda a: 1)
        Engine._segments = timed("Engine._segments", Engine._segments, lambda a: len(a[1]))
        f = SampleRows.of.__func__
        SampleRows.of = classmethod(timed("SampleRows.of", f, lambda a: len(a[1])))
        decode.launch = timed("decode.launch", decode.launch, lambda a: len(a[1]))
        atexit.register(dump)

    class Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname == "ntransformerd.server.steps":
                sys.meta_path.remove(self)
                install()
            return None
    sys.meta_path.insert(0, Hook())
