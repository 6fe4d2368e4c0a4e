"""Status shows the KV pool (server/servicer.py: kv_status) and ntx-client prints it: bytes per
token, the pool's blocks and tokens, blocks in use and shared, the layers resident with each KV
type at the pool, and the host pool's spill counters."""

from __future__ import annotations

import types

from ntransformerd.engine import tiers
from ntransformerd.engine.runtime import kv_cache
from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.server.servicer import kv_status
from ntx_client import cli
from ntx_proto.ntransformer.v1 import inference_pb2 as pb


def test_status_shows_the_pool_and_the_trade(synth_model, capsys):
    model = GGUFModel(synth_model("small", "q4_k_m"))
    config = EngineConfig(backend="cpu-ref", max_batch=3, max_ctx=64, kv_dtype="f16", kv_blocks=10, max_vram_layers=1)
    plan = tiers.model_plan(model, config, backend="cpu")
    e = Engine(model, config=config, plan=plan)
    e.kv.spill_limit = 1 << 20
    a = e.open()
    e.prefill(a, list(range(1, 40)))  # 3 blocks
    b = e.open()
    e.copy_prefix(a, b, 39)  # 2 shared, the third copied
    s = kv_status(e)
    per_token = kv_cache.bytes_per_token(model.config, "f16")
    assert (s.dtype, s.bytes_per_token, s.block_size, s.blocks) == ("f16", per_token, 16, 10)
    assert s.pool_tokens == 160 and s.pool_bytes == 160 * per_token and s.max_ctx == 64
    assert (s.used_blocks, s.shared_blocks) == (4, 2)
    assert s.resident_layers == 1 and s.resident_by_dtype["f16"] == 1 and set(s.resident_by_dtype) == {"f16", "q8_0", "q4_0"}
    assert s.spill_limit_bytes == 1 << 20 and s.spilled_bytes == 0
    cli.cmd_status(types.SimpleNamespace(status=lambda: pb.StatusResponse(model="m", kv=s)),
                   types.SimpleNamespace(json=False))
    out = capsys.readouterr().out
    assert (f"KV: f16, {per_token / 1024:.1f} KiB per token; pool 10 blocks x 16 = 160 tokens" in out
            and "4 in use (2 shared); max_ctx 64 per sequence; 1 layers resident (with " in out
            and "q8_0 1" in out and "spill 0 B of 1.0 MiB, 0 blocks out, 0 restored" in out), out
    e.unload()


def test_status_of_an_engine_without_a_plan(synth_model):
    e = Engine(GGUFModel(synth_model("tiny", "q8_0")), config=EngineConfig(backend="cpu-ref", max_batch=2, max_ctx=32))
    s = kv_status(e)
    assert s.dtype == "f32" and s.blocks == 4 and s.resident_layers == e.cfg.n_layers and not s.resident_by_dtype
    assert s.used_blocks == 0 and s.spill_limit_bytes == 0
