"""What the paged CUDA KV cache decides on the host, checked without a GPU: the kv_dtype and
kv_blocks settings the cuda backend honours, the captured buckets of wide decode steps, and the
cache's layer answering the host layer's calls (the GPU side: tests/gpu/test_kv_paged.py)."""

from __future__ import annotations

import contextlib
import importlib
import types

import pytest

from ntransformerd.engine import backends
from ntransformerd.engine.runtime import devices
from ntransformerd.engine.backends import cuda
from ntransformerd.engine.runtime.kv_cache import KVLayer
from ntransformerd.settings import SettingError

graphs = importlib.import_module("ntransformerd.engine.backends.cuda.graphs")  # the package's `graphs` is a function


def test_cuda_honours_q8_0_and_refuses_f32_naming_kv_dtype():
    assert backends.settle(backends.Cuda, kv_dtype="q8_0", storage=None) == "q8_0"
    assert backends.settle(backends.Cuda, kv_dtype="auto", storage=None) == "f16"
    with pytest.raises(SettingError, match="kv_dtype") as e:
        backends.settle(backends.Cuda, kv_dtype="f32", storage=None)
    assert e.value.setting == "kv_dtype"
    assert set(backends.Cuda.kv_dtypes) == set(cuda.CUDA_KV_DTYPES)


def test_cuda_kv_cache_takes_a_pool_of_any_size():
    """kv_blocks reaches the cuda cache (no refusal of a pool other than max_batch × max_ctx)."""
    asked = {}

    class Module:
        cp = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda d: contextlib.nullcontext()))

        @staticmethod
        def kv_cache(cfg, **kw):
            asked.update(kw)
            return "cache"

    b = backends.Cuda(Module)
    assert b.kv_cache(None, n_slots=4, max_ctx=1024, dtype="q8_0", n_blocks=37) == "cache"
    assert asked == dict(n_slots=4, max_ctx=1024, dtype="q8_0", n_blocks=37)


@pytest.mark.parametrize("rows,tokens,bucket", [
    (1, 1, (1, 1)), (3, 1, (4, 1)), (32, 1, (32, 1)), (33, 1, (64, 1)), (64, 1, (64, 1)), (65, 1, None),
    (16, 2, (16, 2)), (17, 2, None), (4, 8, (4, 8)), (2, 16, (2, 16)), (3, 16, None), (1, 3, None)])
def test_captured_buckets_reach_64_one_token_rows(rows, tokens, bucket):
    g = graphs.StepGraphs.__new__(graphs.StepGraphs)
    g.kv = types.SimpleNamespace(max_ctx=4096)
    assert g.bucket(rows, tokens) == bucket


def test_cuda_layer_answers_the_host_layers_calls():
    calls = {n for n in vars(KVLayer) if not n.startswith("_")} - {"k", "v"}
    assert not {n for n in calls if not hasattr(cuda.CudaKVLayer, n)}
    assert not {n for n in vars(devices.KVLayer) if not n.startswith("_") and not hasattr(cuda.CudaKVLayer, n)} - {
        "k", "v"}
    assert cuda.CudaKVCache.layer_class is cuda.CudaKVLayer
