"""The kernels compiled at load for a model are those its weight types can launch (warm.needed)."""
from types import SimpleNamespace

from gguf import GGMLQuantizationType as Q

from ntransformerd.engine.backends.cuda import warm
from ntransformerd.engine.backends.cuda.warm import kernel_names


def test_a_model_compiles_its_own_types_and_every_untyped_kernel():
    names = kernel_names()
    q4km = warm.needed(names, {int(Q.F32), int(Q.Q4_K), int(Q.Q6_K)})
    q8 = warm.needed(names, {int(Q.F32), int(Q.Q8_0)})
    assert set(q4km) < set(names) and set(q8) < set(names)
    for family, name in q4km:
        assert "q8_0" not in name and not name.startswith(("dequant_rows<8,", "matvec_generic<8,")), name
    assert any("q4_k" in n for _, n in q4km) and any("q6_k" in n for _, n in q4km)
    assert any(n.startswith("dequant_rows<12,") for _, n in q4km)
    assert any("q8_0" in n for _, n in q8) and not any("q4_k" in n for _, n in q8)
    untyped = {k for k in names if not warm.TYPED.match(k[1]) and not any(s in k[1] for s in warm.TYPE_SUFFIX)}
    assert untyped and untyped <= set(q4km) and untyped <= set(q8)  # norms, attention, sampling: always
    assert any(f == "attention" for f, _ in untyped)


def test_a_model_compiles_the_attention_of_its_own_shape():
    """Of the attention instances, those of the model's head_dim and GQA group (either KV type)."""
    from ntransformerd.engine.backends.cuda import attention
    names = kernel_names()
    types = {int(Q.F32), int(Q.Q4_K), int(Q.Q6_K)}
    every = {n for _, n in warm.needed(names, types)}
    for hd, heads, kv in ((128, 32, 8), (64, 9, 3), (128, 64, 8)):  # the 8B, the default model, the 70B
        cfg = SimpleNamespace(head_dim=hd, n_heads=heads, n_kv_heads=kv)
        mine = {n for _, n in warm.needed(names, types, cfg)}
        attn = {n for n in mine if n.startswith(("attn_decode<", "attn_chunk<"))}
        assert {attention.decode_kernel(cfg, q8) for q8 in (False, True)} <= attn and len(attn) <= 4, sorted(attn)
        assert mine < every and all(n.startswith(("attn_decode<", "attn_chunk<")) for n in every - mine)


def test_every_typed_kernel_name_is_understood():
    """A fused matvec named after a weight type warm does not know would be dropped silently."""
    for family, name in kernel_names():
        head = name.split("<")[0]
        if any(head.startswith(p) for p in ("mvq_", "mma_", "mmh_")):
            assert head.split("_", 1)[1] in warm.TYPE_SUFFIX, name
