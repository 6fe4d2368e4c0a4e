"""The planner counts KV by blocks (engine/tiers: kv_pool): a 70B-shaped Q4_K_M at 24 GiB with
4 sequences of up to 32768 positions fits and shows its resident layers, and what a smaller KV
type buys (layers resident at the same pool). Sizes only: no model file, no GPU."""

from __future__ import annotations

import json
import math
import types

import pytest

from ntransformerd.engine import tiers
from ntransformerd.engine.runtime import kv_cache
from ntransformerd.engine.runtime.engine import EngineConfig
from ntransformerd.engine.gguf_file import LlamaConfig
from ntransformerd.engine.quants import QUANT_BLOCKS
from ntransformerd.engine.tiers.planner import VRAM, PlanError
from ntransformerd.tools.synth import SHAPES, tensor_shapes, tensor_types

GiB = 1 << 30


def shaped(shape: str, ftype: str):
    """(a stand-in model with the shape's config and non-layer tensor sizes, its layer bytes)."""
    s = SHAPES[shape]
    shapes, qtypes = tensor_shapes(s), tensor_types(s, ftype)
    nb = {n: math.prod(shp) // QUANT_BLOCKS[qtypes[n]][0] * QUANT_BLOCKS[qtypes[n]][1] for n, shp in shapes.items()}
    cfg = LlamaConfig(n_layers=s.n_layers, d_model=s.d_model, d_ff=s.d_ff, n_heads=s.n_heads, n_kv_heads=s.n_kv_heads,
                      head_dim=s.d_model // s.n_heads, vocab_size=s.vocab, context_length=131072, rms_eps=1e-5,
                      rope_base=5e5, rope_dim=s.d_model // s.n_heads, rope_neox=False, rope_scale=1.0,
                      tied_output="output.weight" not in nb)
    t = types.SimpleNamespace
    model = t(config=cfg, tensors={n: t(nbytes=b) for n, b in nb.items() if not n.startswith("blk.")})
    return model, [sum(v for k, v in nb.items() if k.startswith(f"blk.{i}.")) for i in range(s.n_layers)]


M70, L70 = shaped("llama3-70b", "q4_k_m")
M8, L8 = shaped("llama3-8b", "q4_k_m")


def plan(model, sizes, **over):
    kw = dict(backend="cpu", max_batch=4, max_ctx=32768, kv_dtype="f16", vram_budget="24GiB") | over
    return tiers.model_plan(model, EngineConfig(**kw), backend="cuda", vram_free=139 * GiB, layer_bytes=sizes,
                            ram_available=120 * GiB)


def test_70b_at_24gib_with_4_sequences_of_32k_fits_and_shows_the_trade():
    assert kv_cache.bytes_per_token(M70.config, "f16") == 320 << 10
    p = plan(M70, L70)
    kv, resident = p.kv, len(p.layers(VRAM))
    assert kv.tokens >= 32768 and kv.bytes == p.kv_bytes < 4 * 32768 * (320 << 10)  # one sequence's max_ctx, not 4
    assert 10 <= resident < 80 and p.vram_bytes <= 24 * GiB
    trade = dict(kv.resident)
    assert trade["f16"] == resident and trade["q8_0"] > resident and trade["q4_0"] >= trade["q8_0"]
    text = p.explain()
    assert "KV cache       f16, 320.0 KiB per token; pool 2048 blocks x 16 = 32768 tokens, 10.00 GiB" in text, text
    assert f"layers resident at this pool: f16 KV {resident}, q8_0 KV {trade['q8_0']}" in text, text
    assert p.to_dict()["kv"]["resident"]["q8_0"] == trade["q8_0"]
    # the reservation of old: every sequence at max_ctx (40 GiB) does not fit
    with pytest.raises(PlanError, match="cannot hold the fixed weights"):
        plan(M70, L70, kv_blocks=4 * 32768 // 16)


def test_q8_0_keeps_as_many_layers_as_f16_at_half_the_context():
    q8 = plan(M70, L70, kv_dtype="q8_0")
    f16_half = plan(M70, L70, max_ctx=16384)
    f16 = plan(M70, L70)
    assert len(q8.layers(VRAM)) >= len(f16_half.layers(VRAM)) > len(f16.layers(VRAM)), \
        (q8.explain(), f16_half.explain())
    assert q8.kv.tokens >= 32768


def test_the_plan_says_what_the_kv_type_keeps_resident():
    """The KV trade line: the plan's own type against the other (f16 or q8_0), each planned with
    the pool the config would give it; a type whose pool leaves no room says it would not fit."""
    q8, f16 = plan(M70, L70, kv_dtype="q8_0"), plan(M70, L70)
    gain = len(q8.layers(VRAM)) - len(f16.layers(VRAM))
    assert gain > 0 and q8.kv.against == ("f16", len(f16.layers(VRAM)))
    assert f"each type with its own pool, q8_0 KV keeps +{gain} layers resident against f16" in q8.explain()
    assert f"q8_0 KV would keep +{gain} layers resident against f16" in f16.explain()
    assert q8.to_dict()["kv"]["against"] == {"dtype": "f16", "resident": len(f16.layers(VRAM)),
                                             "trade": f"q8_0 KV keeps +{gain} layers resident against f16"}
    # 4 sequences of 32k at once in q8_0 (21.25 GiB) leave no layer resident; in f16 (40 GiB) nothing fits
    full = plan(M70, L70, kv_dtype="q8_0", kv_blocks=4 * 32768 // 16)
    assert full.layers(VRAM) == [] and full.kv.against == ("f16", None)
    assert "f16 KV would not fit" in full.explain()


def test_the_default_pool():
    """Everything fits: every sequence's max_ctx (nothing waits). Every layer fits with at
    least one sequence's: the rest of the budget. Layers stream: a share of the budget, at least
    one max_ctx, at most all. kv_blocks is the pool as given; a host pool is every max_ctx."""
    full = plan(M8, L8, max_batch=8, max_ctx=4096)
    assert full.kv.blocks == 8 * 4096 // 16 and full.all_resident
    rest = plan(M8, L8, max_batch=8, max_ctx=32768)
    assert rest.all_resident and 32768 <= rest.kv.tokens < 8 * 32768
    assert 24 * GiB - rest.vram_bytes < rest.kv.block_size * rest.kv.token_bytes  # the budget to the last block
    streaming = plan(M70, L70, max_batch=4, max_ctx=4096)
    assert streaming.kv.blocks == 4 * 4096 // 16  # the share would be more than all of them
    assert plan(M70, L70, kv_blocks=100).kv.blocks == 100 == plan(M70, L70, kv_blocks=100).kv_bytes // (16 * (320 << 10))
    host = tiers.model_plan(M8, EngineConfig(backend="cpu", max_batch=8, max_ctx=32768),
                            backend="cpu", layer_bytes=L8, ram_available=120 * GiB)
    assert host.kv.blocks == 8 * 32768 // 16 and host.kv.dtype == "f32"


def test_the_pool_over_two_devices():
    mp = tiers.model_plan_devices(M70, EngineConfig(backend="cpu", max_batch=4, max_ctx=32768, kv_dtype="f16",
                                                    vram_budget="24GiB"), backend="cuda", vram_free=[139 * GiB] * 2,
                                  layer_bytes=L70, ram_available=120 * GiB)
    assert mp.kv.tokens >= 32768 and sum(p.kv_bytes for p in mp.devices) >= mp.kv.bytes
    assert "KV cache       f16, 320.0 KiB per token" in mp.explain() and mp.to_dict()["kv"]["blocks"] == mp.kv.blocks


def test_ntx_model_plan_shows_the_pool(synth_model, capsys):
    from ntransformerd.tools import ntx_model
    path = synth_model("small", "q4_k_m")
    args = ["run", path, "--plan", "--backend", "cpu", "--ctx", "256", "--max-batch", "4"]
    assert ntx_model.main(args + ["--kv-blocks", "40"]) == 0
    out = capsys.readouterr().out
    assert "pool 40 blocks x 16 = 640 tokens" in out and "layers resident at this pool: f32 KV" in out, out
    assert ntx_model.main(args + ["--json", "--kv-dtype", "q8_0"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kv"]["blocks"] == 4 * 256 // 16 and d["kv"]["dtype"] == "q8_0" and "f16" in d["kv"]["resident"]


def test_the_engine_gets_the_pool_the_plan_counted():
    assert tiers.kv_blocks_of(plan(M70, L70)) == 2048 and tiers.kv_blocks_of(None) is None
