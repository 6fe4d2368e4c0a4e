"""Per-call thread CPU of a few engine functions in the daemon, written every 500 calls."""
import os, sys, time, threading
if os.environ.get("NTX_INSTR"):
    import importlib.abc
    STATS = {}
    LOG = os.environ["NTX_INSTR"]

    def wrap(cls, name, rows):
        f = getattr(cls, name)
        key = f"{cls.__name__}.{name}"
        st = STATS.setdefault(key, [0, 0.0, 0, 0.0])

        def w(*a, **k):
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                st[0] += 1; st[1] += time.thread_time() - c0; st[2] += rows(a); st[3] += time.perf_counter() - t0
                if st[0] % 100 == 0:
                    with open(LOG, "a") as fh:
                        fh.write(f"{os.getpid()} {key} calls {st[0]} cpu/call {st[1]/st[0]*1e6:.1f} wall/call {st[3]/st[0]*1e6:.1f} rows/call {st[2]/st[0]:.1f} cpu/row {st[1]/max(st[2],1)*1e6:.2f}\n")
        setattr(cls, name, w)

    def install():
        from ntransformerd.engine.runtime.engine import Engine
        from ntransformerd.engine.generation.sampler import SampleRows
        from ntransformerd.engine.generation import decode
        wrap(Engine, "_segments", lambda a: len(a[1]))
        SampleRows.of = classmethod(SampleRows.of.__func__)
        f = SampleRows.of.__func__
        st = STATS.setdefault("SampleRows.of", [0, 0.0, 0, 0.0])
        def of(cls, samplers, *a, **k):
            c0 = time.thread_time()
            try:
                return f(cls, samplers, *a, **k)
            finally:
                st[0] += 1; st[1] += time.thread_time() - c0; st[2] += len(samplers)
                if st[0] % 100 == 0:
                    with open(LOG, "a") as fh:
                        fh.write(f"{os.getpid()} SampleRows.of calls {st[0]} cpu/call {st[1]/st[0]*1e6:.1f} rows/call {st[2]/st[0]:.1f}\n")
        SampleRows.of = classmethod(of)
        for name in ("launch",):
            g = getattr(decode, name)
            st2 = STATS.setdefault("decode." + name, [0, 0.0, 0, 0.0])
            def lw(engine, rows, *a, _g=g, _st=st2, _n=name, **k):
                c0 = time.thread_time()
                try:
                    return _g(engine, rows, *a, **k)
                finally:
                    _st[0] += 1; _st[1] += time.thread_time() - c0; _st[2] += len(rows)
                    if _st[0] % 100 == 0:
                        with open(LOG, "a") as fh:
                            fh.write(f"{os.getpid()} decode.{_n} calls {_st[0]} cpu/call {_st[1]/_st[0]*1e6:.1f} rows/call {_st[2]/_st[0]:.1f} cpu/row {_st[1]/max(_st[2],1)*1e6:.2f}\n")
            setattr(decode, name, lw)

    class Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname == "ntransformerd.server.steps":
                sys.meta_path.remove(self)
                install()
            return None
    sys.meta_path.insert(0, Hook())

if os.environ.get("NTX_CHAINS"):
    import importlib.abc as _abc
    class _Hook2(_abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname == "ntransformerd.server.steps":
                sys.meta_path.remove(self)
                from ntransformerd.engine.generation import sampler
                f = sampler._Chains.of.__func__
                st = [0, 0]
                g = sampler.SampleRows.of.__func__
                def of(cls, samplers):
                    st[0] += 1
                    if st[0] % 100 == 0:
                        with open(os.environ["NTX_CHAINS"], "a") as fh:
                            fh.write(f"misses {st[0]} of {st[1]} calls; last key len {len(samplers)}\n")
                    return f(cls, samplers)
                def sof(cls, samplers, *a, **k):
                    st[1] += 1
                    return g(cls, samplers, *a, **k)
                sampler._Chains.of = classmethod(of)
                sampler.SampleRows.of = classmethod(sof)
            return None
    sys.meta_path.insert(0, _Hook2())
