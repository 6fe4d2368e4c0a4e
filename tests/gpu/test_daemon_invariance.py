"""The same answer whatever else runs, on the GPU, through the daemon with `--deterministic` (issue
35's acceptance): the six reference prompts and the code edit, 64 greedy tokens each, give the ids
they give alone when the seven run at once (mixed lengths), with every draft source, from the
prefix cache, and after their KV was spilled to host RAM and restored; a sampled request (fixed
seed) gives what it gives alone. "Alone" is the same daemon serving one request at a time without
speculation.

The model: NTX_FULL_MODEL (bench/session_round.sh's PHASE=checks puts the default model there),
else the default model where installed, else the carried 4-layer real-weights slice (fewer
layers, same shapes: the property under test does not depend on depth).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os

import pytest

from .real_weights import CARRIED

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
if not cp.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

_spec = importlib.util.spec_from_file_location(
    "server_conftest", os.path.join(os.path.dirname(__file__), os.pardir, "server", "conftest.py"))
_server = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_server)
DaemonProcess = _server.DaemonProcess  # the CPU tests' daemon in a subprocess; its flags come last

GOLDEN = os.path.join(os.path.dirname(__file__), os.pardir, "golden")
N = 64
MODES = ("ngram", "prefix:15", "skip:8,12,16,20", "auto")


def _model() -> str:
    full = os.environ.get("NTX_FULL_MODEL")
    if full and os.path.exists(full):
        return full
    try:
        from ntransformerd.engine.runtime.engine import default_model_path
        return default_model_path()
    except FileNotFoundError:
        pass
    for path in CARRIED:
        if path and os.path.exists(path):
            return path
    pytest.skip("no real model: set NTX_FULL_MODEL or carry .gpu-data/smollm2-4l.gguf")


def _prompts() -> list[tuple[str, list[int] | None, list[dict] | None, bool]]:
    """(name, prompt ids, chat messages, ignore_eos): the six reference prompts, the code edit."""
    with open(os.path.join(GOLDEN, "forward_smollm2.json")) as f:
        ref = [(p["name"], p["prompt_ids"], None, True) for p in json.load(f)["prompts"]]
    with open(os.path.join(GOLDEN, "code_edit_prompt.json")) as f:
        code = json.load(f)
    return ref + [("code_edit", None, code["messages"], False)]


def _fit_mode(mode: str, n_layers: int) -> str:
    """A draft mode whose layers exist in this model (the slice has 4): skip layers below n_layers,
    a prefix draft shorter than the model."""
    if mode.startswith("skip:") and n_layers <= 20:
        return "skip:" + ",".join(str(i) for i in range(1, n_layers, 2))
    if mode.startswith("prefix:") and int(mode.split(":")[1]) >= n_layers:
        return f"prefix:{max(1, n_layers // 2)}"
    return mode


@pytest.fixture(scope="module")
def gpu_daemon():
    model = _model()
    d = DaemonProcess("--backend", "cuda", "--model", model, "--max-ctx", "2048", "--max-batch", "8",
                      "--prefill-chunk", "256", "--kv-spill", "256MiB", "--deterministic")
    try:
        yield d.wait_ready(timeout=300)
    finally:
        d.cleanup()


def _ask(sock: str, prompt, *, speculative: str = "off", **kw):
    from ntx_client import Client
    name, ids, messages, ignore_eos = prompt
    with Client(sock) as c:
        args = dict(prompt_ids=ids) if ids is not None else dict(messages=messages)
        return c.complete(max_tokens=N, temperature=kw.pop("temperature", 0), ignore_eos=ignore_eos,
                          speculative=speculative, **args, **kw).ids


def _together(sock: str, prompts, modes) -> list[list[int]]:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda i: _ask(sock, prompts[i], speculative=modes[i % len(modes)]),
                             range(len(prompts))))


def _n_layers(path: str) -> int:
    from ntransformerd.engine.gguf_file import GGUFModel
    return GGUFModel(path).config.n_layers


def test_seven_prompts_give_their_alone_ids_whatever_else_runs(gpu_daemon):
    sock = gpu_daemon.socket
    prompts = _prompts()
    alone = [_ask(sock, p) for p in prompts]
    assert all(len(ids) == N or not p[3] for ids, p in zip(alone, prompts)), [len(a) for a in alone]
    failures = []

    def check(what: str, got: list[list[int]]):
        for p, a, g in zip(prompts, alone, got):
            if g != a:
                first = next((i for i, (x, y) in enumerate(zip(a, g)) if x != y), min(len(a), len(g)))
                failures.append(f"{what}: {p[0]} differs from token {first}")

    check("7 at once", _together(sock, prompts, ["off"]))
    layers = _n_layers(_model())
    for mode in MODES:
        m = _fit_mode(mode, layers)
        check(f"alone, {m}", [_ask(sock, p, speculative=m) for p in prompts])
    check("7 at once, mixed draft sources", _together(sock, prompts, [_fit_mode(m, layers) for m in MODES]))
    # the same prompts again start from the prefix cache (the same caller's finished sequences)
    check("from the prefix cache", [_ask(sock, p) for p in prompts])
    check("from the prefix cache, 7 at once", _together(sock, prompts, ["off"]))
    assert not failures, "\n".join(failures)


def test_after_a_spill_and_sampled_alone_equals_among_others(gpu_daemon):
    """A pool of few blocks makes finished prompts spill to host RAM; their repeats restore."""
    model = _model()
    d = DaemonProcess("--backend", "cuda", "--model", model, "--max-ctx", "2048", "--max-batch", "8",
                      "--prefill-chunk", "256", "--kv-blocks", "40", "--kv-spill", "256MiB", "--deterministic")
    try:
        sock = d.wait_ready(timeout=300).socket
        prompts = _prompts()
        alone = [_ask(sock, p) for p in prompts]  # each pushes the previous ones' blocks out
        again = [_ask(sock, p) for p in prompts]  # restored (or re-prefilled where none was kept)
        assert again == alone
        from ntx_client import Client
        with Client(sock) as c:
            s = c.status()
        assert s.kv.spilled_blocks_total > 0 and s.kv.restored_blocks_total > 0, s.kv
        seeded = dict(temperature=0.8, seed=1234)
        solo = _ask(sock, prompts[0], **seeded)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(_ask, sock, prompts[0], **seeded)] + [pool.submit(_ask, sock, p) for p in prompts[1:4]]
            among = futs[0].result()
            for f in futs[1:]:
                f.result()
        assert among == solo
    finally:
        d.cleanup()
