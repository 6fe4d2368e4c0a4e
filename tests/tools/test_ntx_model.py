"""ntx-model: every quant type of the real model made by `quantize` loads and generates text."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.tools.ntx_model import main

PROMPT = "The capital of France is"
# type → a tensor type the requantized SmolLM2 must contain. Its 576-wide rows are not a multiple
# of 256, so K types land only on ffn_down (1536 wide), and llama.cpp's q2_k mix gives ffn_down
# Q3_K: no tensor of this model can be Q2_K (tests/engine/test_model.py runs Q2_K on a synthetic
# model whose rows are multiples of 256).
TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0,
         "q5_1": Q.Q5_1, "q8_0": Q.Q8_0, "q2_k": Q.Q3_K, "q3_k": Q.Q3_K, "q4_k": Q.Q4_K, "q5_k": Q.Q5_K,
         "q6_k": Q.Q6_K, "q4_k_m": Q.Q6_K}


def run_json(capsys, *argv) -> dict:
    assert main(list(argv)) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    return json.loads(lines[-1])


@pytest.mark.slow
@pytest.mark.parametrize("ftype", list(TYPES))
def test_every_quant_type_generates(default_model_path, tmp_path, capsys, ftype):
    out = str(tmp_path / f"smol-{ftype}.gguf")
    assert main(["quantize", default_model_path, out, "--type", ftype, "--quiet"]) == 0
    m = GGUFModel(out)
    assert TYPES[ftype] in {t.qtype for t in m.tensors.values()}
    res = run_json(capsys, "run", out, "--prompt", PROMPT, "--max-tokens", "8", "--ignore-eos", "--json")
    assert len(res["ids"]) == 8 and res["text"].strip(), res
    if ftype in ("f32", "f16", "bf16", "q8_0", "q6_k", "q5_1"):
        assert "Paris" in res["text"], res["text"]


def test_run_json_and_dump_logits(default_model_path, tmp_path, capsys):
    dump = tmp_path / "logits.npy"
    res = run_json(capsys, "run", "--prompt", PROMPT, "--max-tokens", "4", "--json", "--dump-logits", str(dump))
    assert res["prompt_ids"] == [504, 3575, 282, 4649, 314]
    assert res["ids"][0] == 7042 and res["text"].startswith(" Paris")
    logits = np.load(dump)
    assert logits.shape == (49152,) and logits.dtype == np.float32 and int(np.argmax(logits)) == 7042


def test_run_seed_is_repeatable(capsys):
    args = ["run", "--prompt", "Once upon a time", "--temperature", "1.0", "--max-tokens", "12", "--json",
            "--ignore-eos"]
    a = run_json(capsys, *args, "--seed", "7")
    b = run_json(capsys, *args, "--seed", "7")
    c = run_json(capsys, *args, "--seed", "8")
    assert a["ids"] == b["ids"] and a["ids"] != c["ids"]


def test_run_chat_stops_at_end_of_turn(capsys):
    res = run_json(capsys, "run", "--prompt", "What is the capital of France?", "--chat", "--max-tokens", "40",
                   "--json")
    assert res["finish_reason"] == "eos" and "Paris" in res["text"]
    assert res["prompt_ids"][:1] == [1]  # <|im_start|> of the ChatML system turn


def test_tokenize_prints_ids(capsys):
    assert main(["tokenize", "Hello <|im_end|>"]) == 0
    assert json.loads(capsys.readouterr().out) == [19556, 216, 2]


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "layers 30" in out and "Q4_1" in out


def test_errors_are_clear(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    assert main(["info", str(bad)]) == 2
    assert "not a GGUF file" in capsys.readouterr().err
    assert main(["run", "--prompt", "x", "--temperature", "nan"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["quantize", str(bad), str(tmp_path / "o.gguf"), "--type", "q9_9"]) == 2


def test_synth_command(tmp_path, capsys):
    out = tmp_path / "t.gguf"
    assert main(["synth", str(out), "--shape", "tiny", "--type", "q4_k_m", "--quiet"]) == 0
    m = GGUFModel(out)
    assert m.config.n_layers == 2 and {Q.Q4_K, Q.Q6_K} <= {t.qtype for t in m.tensors.values()}
