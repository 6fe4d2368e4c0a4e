"""Host layers' attention on the GPU, measured by its parts: does the round trip cost less than
the host's own attention?

    python3 bench/attention_split.py [--threads 16] [--contexts 512 1024 4096 16384] [--json F]
    python3 bench/attention_split.py --smoke          # small shapes: does it run?

Where the host computes a layer (the hybrid's host share), it also runs that layer's attention
over the keys and values of every earlier position: a read that grows with the context, on the
same DRAM that feeds the link (bench/host_link.py). The other way to split such a layer is the
one ktransformers uses for MoE layers: the host does the weight-bound matmuls, the GPU keeps the
layer's KV and does the attention. Each layer then costs a round trip: the row's q, k and v
(q_dim + 2 kv_dim floats) over the link, the fused RoPE + append + attention launch
(attn_decode, as a decode step runs it), and the output (q_dim floats) back, before the host can
go on. The engine does not run layers that way; this measures whether it would pay, per layer
and one row (a decode step of one sequence), at each context:

  - host: the kernels' ntx_attention on --threads threads over a paged cache (AttentionProbe,
    the figure the load-time placement times);
  - trip: the round trip above, eager (one layer at a time, as a split layer would run it), a
    median over --layers layers after a warm-up, the link idle;
  - trip, link busy: the same while pinned → device copies of --buffer bytes run back to back
    on another stream (bench/host_link.py's LinkLoop): the hybrid's link streams weights while
    the host computes, and the round trip's small copies queue beside them.

Then the step time the split would save (or add) for --host-layers host layers, and the GPU
memory it needs: each host layer's KV on the GPU. Pass --dtype q8_0 for a q8_0 cache.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from host_link import LinkLoop  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "daemon"))

from ntransformerd.engine.gguf_file import LlamaConfig  # noqa: E402


def config(heads: int, kv: int, hd: int, max_ctx: int) -> LlamaConfig:
    return LlamaConfig(n_layers=1, d_model=heads * hd, d_ff=64, n_heads=heads, n_kv_heads=kv, head_dim=hd,
                       vocab_size=100, context_length=max_ctx, rms_eps=1e-5, rope_base=500000.0, rope_dim=hd,
                       rope_neox=False, rope_scale=1.0, tied_output=True)


def kv_bytes(cfg: LlamaConfig, dtype: str, ctx: int) -> int:
    """K and V bytes of one layer and one sequence of ctx positions."""
    row = cfg.head_dim * 2 if dtype == "f16" else cfg.head_dim // 32 * 34
    return 2 * ctx * cfg.n_kv_heads * row


class Trip:
    """One layer's attention on the GPU for a row the host computes: q, k, v from pinned host
    memory to the device, attn_decode (RoPE, append, attention), the output back to pinned
    memory, on a stream of its own, waited for."""

    def __init__(self, cp, cuda, cfg: LlamaConfig, dtype: str, ctx: int, max_ctx: int):
        self.cp, self.cuda, self.cfg, self.ctx = cp, cuda, cfg, ctx
        self.kv = cuda.CudaKVCache(cfg, n_slots=1, max_ctx=max_ctx, dtype=dtype, n_blocks=-(-ctx // 16))
        self.kv.reserve(0, ctx)
        self.kv.tables.refresh()
        self.layer = self.kv.layer(0)
        if dtype == "f16":  # values of a model's scale; the q8_0 cache's zeros cost the same reads
            self.layer.k[:] = cp.random.standard_normal(self.layer.k.shape, dtype=cp.float32).astype(cp.float16)
            self.layer.v[:] = cp.random.standard_normal(self.layer.v.shape, dtype=cp.float32).astype(cp.float16)
        self.width = cfg.q_dim + 2 * cfg.kv_dim
        self.host_in = self._pinned(self.width)
        self.host_in[:] = np.random.default_rng(0).standard_normal(self.width, dtype=np.float32)
        self.host_out = self._pinned(cfg.q_dim)
        self.qkv = cp.empty((1, self.width), cp.float32)
        self.out = cp.empty((1, cfg.q_dim), cp.float32)
        self.slots = cp.zeros((1,), cp.int32)
        self.pos = cp.full((1,), ctx - 1, cp.int32)  # the row's own key is the last position
        self.scratch = cuda.attention_scratch(1, cfg, max_ctx)
        self.freqs = cuda.CudaOps(cfg).freqs
        self.stream = cp.cuda.Stream(non_blocking=True)
        cp.cuda.Device().synchronize()  # the fills and the tables (default stream) before this stream reads them

    def _pinned(self, n: int) -> np.ndarray:
        return np.frombuffer(self.cp.cuda.alloc_pinned_memory(4 * n), np.float32, n)

    def once(self) -> None:
        rt, s, c = self.cp.cuda.runtime, self.stream, self.cfg
        rt.memcpyAsync(self.qkv.data.ptr, self.host_in.ctypes.data, self.host_in.nbytes, rt.memcpyHostToDevice, s.ptr)
        with s:
            self.cuda.attention_decode_(self.qkv, self.qkv[:, c.q_dim + c.kv_dim:], self.layer, self.slots, self.pos,
                                        self.freqs, c, n=1, ld=self.width, ldv=self.width, out=self.out,
                                        scratch=self.scratch)
        rt.memcpyAsync(self.host_out.ctypes.data, self.out.data.ptr, self.host_out.nbytes, rt.memcpyDeviceToHost, s.ptr)
        s.synchronize()

    def seconds(self, layers: int, repeats: int) -> float:
        """Median wall seconds of one trip over `repeats` runs of `layers` trips each, after a warm-up."""
        for _ in range(3):
            self.once()
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(layers):
                self.once()
            runs.append((time.perf_counter() - t0) / layers)
        return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__file__, __doc__)
    p.add_argument("--dir", default="/tmp/ntx", help="unused (every GPU script takes it)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="host threads of the host's attention")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 4096, 16384])
    p.add_argument("--dtype", choices=("f16", "q8_0"), default="f16", help="the cache's type")
    p.add_argument("--layers", type=int, default=16, help="trips per timed run (one per host layer)")
    p.add_argument("--host-layers", type=int, default=16,
                   help="host layers of the step the saving is reckoned for (the 8B at 16 resident: 16)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--buffer", type=int, default=256 << 20, help="bytes of each busy-link copy")
    a = p.parse_args(argv)
    common.require_gpu(__file__)
    import cupy as cp
    from ntransformerd.engine.backends import cuda
    from ntransformerd.engine.backends.host import native
    from ntransformerd.engine.backends.host.attention import AttentionProbe
    if a.smoke:
        shape, a.contexts, a.layers, a.repeats, a.buffer = (8, 2, 64), [16, 300], 4, 3, 16 << 20
    else:
        shape = (32, 8, 128)  # Llama 3 8B / 70B per layer: 32 (64) q heads over 8 kv heads of 128
    max_ctx = max(a.contexts)
    cfg = config(*shape, max_ctx)
    lib = native.load()
    link = LinkLoop(cp, a.buffer)
    rows = []
    for ctx in a.contexts:
        host_s = AttentionProbe(cfg, dtype=a.dtype, positions=ctx, lib=lib).seconds(threads=a.threads,
                                                                                 repeats=a.repeats)
        trip = Trip(cp, cuda, cfg, a.dtype, ctx, max_ctx)
        idle_s = trip.seconds(a.layers, a.repeats)
        link.start()
        try:
            busy_s = trip.seconds(a.layers, a.repeats)
        finally:
            link.stop()
        link_Bps = link.rate(link.marks[0][0], link.marks[-1][0])
        del trip
        cp.get_default_memory_pool().free_all_blocks()
        save_ms = a.host_layers * (host_s - busy_s) * 1e3
        row = {"context": ctx, "host_us": host_s * 1e6, "trip_us": idle_s * 1e6, "trip_busy_us": busy_s * 1e6,
               "link_busy_GBps": link_Bps / 1e9, "host_layers": a.host_layers, "step_saving_ms": save_ms,
               "gpu_kv_bytes": a.host_layers * kv_bytes(cfg, a.dtype, ctx), "gpu_wins": busy_s < host_s}
        rows.append(row)
        print(f"context {ctx:6d}: host attention {host_s * 1e6:8.1f} us a layer ({a.threads} threads); GPU round "
              f"trip {idle_s * 1e6:7.1f} us, {busy_s * 1e6:7.1f} with the link busy ({link_Bps / 1e9:.1f} GB/s); "
              f"{a.host_layers} host layers: {'saves' if save_ms >= 0 else 'adds'} {abs(save_ms):.2f} ms a step, "
              f"{row['gpu_kv_bytes'] / 2**20:.0f} MiB of KV on the GPU a sequence", flush=True)
    wins = [r["context"] for r in rows if r["gpu_wins"]]
    print(f"the GPU's attention wins at contexts {wins}" if wins else "the host's own attention wins at every context",
          flush=True)
    common.write_json(a.json, {"threads": a.threads, "dtype": a.dtype, "shape": list(shape), "layers": a.layers,
                               "repeats": a.repeats, "rows": rows, "smoke": a.smoke})
    return 0


if __name__ == "__main__":
    sys.exit(main())
