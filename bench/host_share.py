"""The host's serial cost of a daemon step: the scheduler loop with the real engine whose device
step returns at once, so what is left is the host's share (issue 24).

    python bench/host_share.py                          # default model, 1 16 64 clients, greedy and sampled
    python bench/host_share.py --clients 16 --profile   # and where the time goes (cProfile, top 15)
    python bench/host_share.py --smoke                  # a tiny synthetic model: does it run?

The default model is loaded on the CPU backend; its pipeline step (model.forward, every layer and
the output) is replaced by a step that returns what a device step would hand the host at once:
each row's top ids (`top`), or ids drawn as a device sampler would (`sample`: sampler.sample_rows
on a stand-in TopLogits, counted as device time, not the host's). Everything else runs as in the
daemon: Scheduler.iterate (retire, admit, compose), decode.step (SampleRows, Engine.step's
checks and KV reservations, advance), and the streamer on its own thread (as beside a GPU). N
requests of --tokens tokens each (ignore_eos) are queued at once; the figure is the mean host
time of an iteration whose batch holds all N (ms per step, µs per row). A GPU step of S ms then
runs at S / (S + host) of its rate where the host's work does not overlap the step.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

import numpy as np

import common
from ntransformerd.config import DaemonConfig
from ntransformerd.engine.runtime.engine import Engine, EngineConfig, default_model_path
from ntransformerd.engine.generation.sampler import Drawn, SamplingParams, TopLogits, sample_rows
from ntransformerd.server.scheduler import Scheduler
from ntransformerd.server.systemd import Notifier
from ntx_proto.states import RequestState


class InstantStep:
    """A pipeline step that costs the host nothing beyond handing back its result: per-row top
    ids from a table made once (each row's peak follows its last token), ids drawn from them
    where the engine asks for draws (a device sampler's work, not timed as the host's)."""

    def __init__(self, vocab: int, n: int = 256, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.vals = np.sort(rng.standard_normal(n).astype(np.float32) * 3)[::-1].copy()
        self.device_s = 0.0  # time spent standing in for the device's draws

    def _top(self, batch, n: int) -> TopLogits:
        last = np.asarray([int(s.tokens[-1]) for s in batch.segments], np.int64)
        ids = (last[:, None] * 7 + 1 + np.arange(n)) % self.vocab
        return TopLogits(ids, np.broadcast_to(self.vals[:n], ids.shape).copy(), np.zeros(len(last), np.int64),
                         sort=False)

    def __call__(self, batch, *, layers=None, all_logits=False, top=None, sample=None):
        if sample is not None:  # the device draws: stand in for it, off the host's clock
            t = time.perf_counter()
            drawn = sample_rows(self._top(batch, max(1, int(sample.need.max()) or 1)), sample) \
                if (sample.need[sample.draws] > 0).all() else None
            self.device_s += time.perf_counter() - t
            if drawn is not None:
                return drawn
        if top is not None:
            return self._top(batch, top)
        rows = len(batch.tokens) if all_logits else len(batch.segments)
        out = np.zeros((rows, self.vocab), np.float32)
        out[np.arange(rows), (np.arange(rows) * 7 + 1) % self.vocab] = 1.0
        return out


def measure(engine, clients: int, tokens: int, params: SamplingParams, profile: bool) -> dict:
    step = InstantStep(engine.cfg.vocab_size)
    engine.pipeline.step = step
    s = Scheduler(config=DaemonConfig(socket="/tmp/host-share.sock", max_batch=clients, max_queue=clients),
                  notifier=Notifier(environ={}))
    s.attach(engine)
    s.streamer.inline = False  # as beside a GPU: text and writes on the streaming thread
    s.lifecycle.serving()
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    reqs = [s.schedule(prompt, params, max_tokens=tokens) for _ in range(clients)]
    full, full_s, prof = 0, 0.0, cProfile.Profile() if profile else None
    while any(r.state != RequestState.DONE for r in reqs):
        d0, steady = step.device_s, all(r.state == RequestState.DECODE for r in reqs)
        if prof is not None and steady:  # the steady state only: every request decoding
            prof.enable()
        t = time.perf_counter()
        s.iterate()
        dt = time.perf_counter() - t - (step.device_s - d0)
        if prof is not None:
            prof.disable()
        if steady and s.metrics.last_batch == clients:
            full, full_s = full + 1, full_s + dt
    s.stop()
    got = [sum(len(o.token_ids) for o in r.stream()) for r in reqs]
    if got != [tokens] * clients:
        raise SystemExit(f"requests streamed {got} tokens, not {tokens} each")
    out = {"clients": clients, "sampled": not params.is_greedy, "steps": full,
           "host_ms_per_step": 1e3 * full_s / max(full, 1), "host_us_per_row": 1e6 * full_s / max(full, 1) / clients}
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
        out["profile"] = buf.getvalue()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--model", help="GGUF file (default: the embedded default model)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--profile", action="store_true", help="print cProfile's top functions per level")
    a = ap.parse_args(argv)
    path = a.model
    if a.smoke:
        a.clients, a.tokens = [1, 4], 6
        path = common.synthetic(os.path.join(common.OUT, "smoke"), "tiny")
    engine = Engine.load(path or default_model_path(), config=EngineConfig(backend="cpu", max_batch=max(a.clients),
                                                                           max_ctx=256))
    sampled = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=7, ignore_eos=True)
    out = {"smoke": a.smoke, "model": os.path.basename(engine.model.path), "tokens": a.tokens, "levels": []}
    for params in (SamplingParams.greedy(ignore_eos=True), sampled):
        for n in a.clients:
            row = measure(engine, n, a.tokens, params, a.profile)
            out["levels"].append({k: v for k, v in row.items() if k != "profile"})
            print(f"{n:3d} clients, {'sampled' if row['sampled'] else 'greedy '}: host {row['host_ms_per_step']:.3f} "
                  f"ms/step = {row['host_us_per_row']:.1f} us/row ({row['steps']} full steps)", flush=True)
            if a.profile:
                print(row["profile"])
    common.write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
