"""The hybrid's ceiling on this machine: how fast the host's DRAM feeds the link and the host's cores at once.

    python3 bench/host_link.py --dir /tmp/ntx [--threads 16] [--seconds 2]
    python3 bench/host_link.py --smoke          # small buffers: does it run?

Where layers stream, every decode token reads each streamed layer from host RAM once: by the
GPU's DMA (the link: pinned RAM → device) or by the host's cores (the layers the host computes).
Both draw on the same DRAM, so the hybrid's bound is not the link's rate plus the host's rate
measured apart, but what the two get together. This measures, each for --seconds:
  - the link alone: pinned → device copies of --buffer bytes, back to back on one stream;
  - the host alone: `--threads` threads summing a pageable buffer (the kernels' read probe,
    ntx_read_probe, as bench/cpu.py reports it);
  - both at once: the same copies in a thread while the cores read; each rate over the overlap.
Then, for the 8B-shaped Q4_K_M (bench/common.py's file in --dir, made if missing) at N resident
layers, the decode bound the together-figures allow: streamed bytes / (link + host together),
beside the bound from the apart-figures that the load-time placement assumes. The byte bound
ignores the resident layers' compute and the hand-offs, so it is a ceiling, not a prediction.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "daemon"))


class LinkLoop:
    """Pinned → device copies of one buffer, back to back on a stream of their own, in a thread:
    (time, bytes) after each copy, so a rate over any window can be read back."""

    def __init__(self, cp, nbytes: int):
        self.cp, self.nbytes = cp, nbytes
        self.host = np.frombuffer(cp.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes)
        self.host.fill(1)
        self.dev = cp.empty(nbytes, np.uint8)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.marks: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def copy(self) -> None:
        rt = self.cp.cuda.runtime
        rt.memcpyAsync(self.dev.data.ptr, self.host.ctypes.data, self.nbytes, rt.memcpyHostToDevice, self.stream.ptr)
        self.stream.synchronize()

    def _run(self) -> None:
        total = 0
        self.marks.append((time.perf_counter(), 0))
        while not self._stop.is_set():
            self.copy()
            total += self.nbytes
            self.marks.append((time.perf_counter(), total))

    def start(self) -> None:
        self.copy()  # warm
        self.marks.clear()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def rate(self, t0: float, t1: float) -> float:
        """Bytes per second of the copies that finished within [t0, t1] (counted from the first one
        to finish in it: whole copies only)."""
        inside = [(t, b) for t, b in self.marks if t0 <= t <= t1]
        if len(inside) < 2:
            raise SystemExit("bench/host_link.py: fewer than two copies finished in the window: raise --seconds "
                             "or lower --buffer")
        (ta, ba), (tb, bb) = inside[0], inside[-1]
        return (bb - ba) / (tb - ta)


def host_reads(lib, buf: np.ndarray, threads: int, seconds: float) -> tuple[float, float, float]:
    """(bytes per second, start, end): `threads` threads summing buf, whole passes, for about `seconds`."""
    lib.read_probe(buf.ctypes.data, buf.nbytes, 1, threads)  # warm: pages present, threads up
    t0 = time.perf_counter()
    passes = 0
    while time.perf_counter() - t0 < seconds:
        lib.read_probe(buf.ctypes.data, buf.nbytes, 1, threads)  # ctypes lets go of the GIL meanwhile
        passes += 1
    t1 = time.perf_counter()
    return passes * buf.nbytes / (t1 - t0), t0, t1


def streamed_bytes(path: str, resident: int) -> tuple[int, int]:
    """(bytes of the layers past the first `resident`, layers) of the file as the cuda backend holds them."""
    from ntransformerd.engine.backends import cuda
    from ntransformerd.engine.gguf_file import GGUFModel
    model = GGUFModel(path)
    sizes = [cuda.layer_nbytes(model, i) for i in range(model.config.n_layers)]
    return sum(sizes[resident:]), len(sizes)


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__file__, __doc__)
    p.add_argument("--dir", default="/tmp/ntx", help="where the synthetic 8B file is (made if missing)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="host threads reading (default: every core)")
    p.add_argument("--seconds", type=float, default=2.0, help="length of each measurement")
    p.add_argument("--buffer", type=int, default=1 << 30, help="bytes of each buffer (pinned and pageable)")
    p.add_argument("--resident", type=int, nargs="+", default=[24, 16, 8, 0],
                   help="resident layers of the 8B rows whose bound is printed")
    p.add_argument("--rounds", type=int, default=2, help="alone / together measurements, alternated")
    a = p.parse_args(argv)
    common.require_gpu(__file__)
    import cupy as cp
    from ntransformerd.engine.backends.host import native
    if a.smoke:
        a.seconds, a.buffer, a.rounds, a.resident = 0.3, 64 << 20, 1, [1, 0]
    lib = native.load()
    link = LinkLoop(cp, a.buffer)
    buf = np.ones(a.buffer // 8, np.int64)
    rounds = []
    for r in range(a.rounds):
        link.start()
        time.sleep(a.seconds)
        link.stop()
        link_alone = link.rate(link.marks[0][0], link.marks[-1][0])
        host_alone = host_reads(lib, buf, a.threads, a.seconds)[0]
        link.start()
        time.sleep(0.05)  # the copies under way before the reads begin
        host_with, t0, t1 = host_reads(lib, buf, a.threads, a.seconds)
        link.stop()
        link_with = link.rate(t0, t1)
        row = {"link_alone_Bps": link_alone, "host_alone_Bps": host_alone, "link_together_Bps": link_with,
               "host_together_Bps": host_with, "together_Bps": link_with + host_with}
        rounds.append(row)
        print(f"round {r}: link alone {link_alone / 1e9:.1f} GB/s, host alone {host_alone / 1e9:.1f} GB/s "
              f"({a.threads} threads); together link {link_with / 1e9:.1f} + host {host_with / 1e9:.1f} = "
              f"{(link_with + host_with) / 1e9:.1f} GB/s", flush=True)
    med = {k: float(np.median([r[k] for r in rounds])) for k in rounds[0]}
    path = common.synthetic(a.dir, "tiny" if a.smoke else "llama3-8b", "q4_k_m")
    bounds = []
    for n in a.resident:
        nbytes, layers = streamed_bytes(path, n)
        apart = (med["link_alone_Bps"] + med["host_alone_Bps"]) / nbytes if nbytes else None
        together = med["together_Bps"] / nbytes if nbytes else None
        link_only = med["link_alone_Bps"] / nbytes if nbytes else None
        bounds.append({"resident": n, "layers": layers, "streamed_bytes": nbytes, "bound_link_only_tok_s": link_only,
                       "bound_apart_tok_s": apart, "bound_together_tok_s": together})
        if nbytes:
            print(f"8B Q4_K_M, {n} of {layers} resident: {nbytes / 2**30:.2f} GiB streamed a token; bound "
                  f"{link_only:.1f} tok/s by the link alone, {together:.1f} with the host beside it "
                  f"({apart:.1f} from the figures apart)", flush=True)
    common.write_json(a.json, {"threads": a.threads, "buffer": a.buffer, "seconds": a.seconds, "rounds": rounds,
                               "median": med, "bounds": bounds, "smoke": a.smoke})
    return 0


if __name__ == "__main__":
    sys.exit(main())
