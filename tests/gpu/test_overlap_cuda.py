"""The scheduler's overlapped loop on a CUDA engine: steps launched ahead (their tokens the
previous step's draws, still on the device), against the synchronous loop on the same engine
(tests/server/test_scheduler.py checks the late ends against solo runs on the CPU)."""
import pytest

cp = pytest.importorskip("cupy")

from ntransformerd.config import DaemonConfig  # noqa: E402
from ntransformerd.engine.runtime.engine import Engine, EngineConfig  # noqa: E402
from ntransformerd.engine.generation.sampler import SamplingParams  # noqa: E402
from ntransformerd.server.scheduler import Scheduler  # noqa: E402
from ntransformerd.server.systemd import Notifier  # noqa: E402
from ntransformerd.tools.synth import synthesize  # noqa: E402
from ntx_proto.states import RequestState  # noqa: E402


def serve(engine, prompts, params, *, overlap: bool) -> list[list[int]]:
    s = Scheduler(config=DaemonConfig(socket="/tmp/x.sock", max_batch=8, prefix_cache=False),
                  notifier=Notifier(environ={}))
    s.attach(engine)
    s.overlap = overlap
    s.lifecycle.serving()
    reqs = [s.schedule(p, q, max_tokens=q.max_tokens) for p, q in zip(prompts, params)]
    for _ in range(5000):
        if all(r.state == RequestState.DONE for r in reqs):
            break
        s.iterate()
    s.stop()
    return [[t for o in r.stream() for t in o.token_ids] for r in reqs]


def test_overlapped_steps_on_the_device_give_the_outputs_of_the_synchronous_loop(tmp_path, monkeypatch):
    """Every request in every step (one length, ignore_eos: the same batches either way, so the
    same captured steps): greedy and seeded rows, the end found a step late by all at once."""
    path = str(tmp_path / "tiny.gguf")
    synthesize(path, shape="tiny", ftype="q8_0", seed=0)
    engine = Engine.load(path, config=EngineConfig(backend="cuda", max_batch=8, max_ctx=256))
    try:
        texts = ["The capital of France is", "Once upon a time", "def main():", "2 + 2 =", "My favourite colour is",
                 "The quick brown fox", "In 1905, Albert Einstein", "Dear diary"]
        prompts = [engine.tokenizer.encode(t) for t in texts]
        params = [SamplingParams.greedy(max_tokens=40, ignore_eos=True) if i % 2 else
                  SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=i, max_tokens=40, ignore_eos=True)
                  for i in range(len(texts))]
        assert engine.overlaps(8)
        want = serve(engine, prompts, params, overlap=False)
        devices = []
        real = engine.pipeline.launch
        monkeypatch.setattr(engine.pipeline, "launch", lambda *a, **k: devices.append(1) or real(*a, **k))
        got = serve(engine, prompts, params, overlap=True)
        assert len(devices) > 30  # launched on the device, ahead
        assert got == want and all(len(g) == 40 for g in got)
        assert engine.kv.free_slots == 8
    finally:
        engine.unload()


def test_verify_steps_and_prompt_chunks_in_the_overlapped_loop_give_the_outputs_of_the_synchronous_loop(tmp_path):
    """Speculating rows (n-gram) beside plain rows and prompts longer than a chunk: the
    overlapped loop launches verify steps and chunks behind the step in flight (those kinds run at
    once on a CUDA engine for now: Pipeline.launch launches draw steps only), and, on the
    deterministic engine (a row's arithmetic its own whatever shares its step), every request's
    ids are the synchronous loop's."""
    from ntransformerd.engine.generation import speculative
    from ntransformerd.engine.generation.speculative import Mode
    path = str(tmp_path / "tiny.gguf")
    synthesize(path, shape="tiny", ftype="q8_0", seed=0)
    engine = Engine.load(path, config=EngineConfig(backend="cuda", max_batch=8, max_ctx=256, deterministic=True))
    costs = speculative.StepCosts({1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2})
    try:
        texts = ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "The capital of France is",
                 "The cat sat on the mat. The cat sat on the mat. The cat sat on the", "Dear diary",
                 "a b c d e f g a b c d e f g a b c d", "Once upon a time, once upon a time,"]
        prompts = [engine.tokenizer.encode(t) for t in texts]
        params = [SamplingParams.greedy(max_tokens=30, ignore_eos=True) if i % 2 else
                  SamplingParams(temperature=0.8, top_k=40, seed=i, max_tokens=30, ignore_eos=True)
                  for i in range(len(texts))]
        modes = [Mode.parse("ngram") if i % 3 != 1 else None for i in range(len(texts))]

        def run(overlap: bool) -> list[list[int]]:
            s = Scheduler(config=DaemonConfig(socket="/tmp/x.sock", max_batch=8, prefix_cache=False, prefill_chunk=8),
                          notifier=Notifier(environ={}))
            s.attach(engine, costs=costs)
            s.overlap = overlap
            s.lifecycle.serving()
            reqs = [s.schedule(p, q, max_tokens=q.max_tokens, speculative=m) for p, q, m in zip(prompts, params, modes)]
            for _ in range(5000):
                if all(r.state == RequestState.DONE for r in reqs):
                    break
                s.iterate()
            s.stop()
            return [[t for o in r.stream() for t in o.token_ids] for r in reqs]
        want = run(False)
        got = run(True)
        assert got == want and all(len(g) == 30 for g in got)
        assert engine.kv.free_slots == 8
    finally:
        engine.unload()
