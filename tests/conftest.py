"""Shared fixtures: the default model (opened once per session) and small synthetic models.

The CPU backend's OpenMP teams, here and in every daemon and script the tests start (they inherit
the environment): under pytest-xdist every worker is a process of its own on the same cores, so
each gets one thread and two workers never spin against each other's barriers; and a team never
spins while it waits (OMP_WAIT_POLICY=PASSIVE), since a test and the daemon it drives share the
cores too (two test_e2e tests, one process: 34 s of CPU spinning, 14 s passive). Both are read
when the backend's library loads, after this."""

from __future__ import annotations

import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_collection_modifyitems(config, items):
    """Modules that boot a guest first, then those with slow tests, each module kept whole (its
    module fixtures run once): under xdist (tests/run keeps this order) the longest modules start
    at once and overlap the rest instead of finishing last (a guest started last added ~10 min)."""
    rank: dict = {}
    for item in items:
        r = 0 if item.get_closest_marker("vm") else 1 if item.get_closest_marker("slow") else 2
        rank[item.path] = min(rank.get(item.path, 2), r)
    items.sort(key=lambda item: rank[item.path])  # stable: collection order within a rank


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from ntransformerd.engine.runtime.engine import default_model_path as find

    try:
        return find()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def default_model(default_model_path):
    from ntransformerd.engine.gguf_file import GGUFModel

    return GGUFModel(default_model_path)


@pytest.fixture(scope="session")
def default_engine(default_model):
    from ntransformerd.engine.runtime.engine import Engine, EngineConfig

    return Engine(default_model, config=EngineConfig(backend="cpu-ref", max_batch=8, max_ctx=1024))


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("synth")


@pytest.fixture(scope="session")
def synth_model(synth_dir):
    """make(shape, ftype) -> path of a synthetic model, written once per session."""
    from ntransformerd.tools.synth import synthesize

    def make(shape: str = "tiny", ftype: str = "q8_0", seed: int = 0) -> str:
        path = os.path.join(synth_dir, f"{shape}-{ftype}-{seed}.gguf")
        if not os.path.exists(path):
            synthesize(path, shape=shape, ftype=ftype, seed=seed)
        return path

    return make


@pytest.fixture(autouse=True)
def kv_owner_check(monkeypatch):
    """Every KV write in every in-process test checks its owner (kv_cache.BlockTable.check_owners):
    the slot is live and holds the blocks written alone."""
    from ntransformerd.engine.runtime import kv_cache

    monkeypatch.setattr(kv_cache.BlockTable, "check_owners", True)
