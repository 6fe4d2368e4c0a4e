"""ntx-model perplexity and calibrate-skip on small synthetic models; --skip-layers parsing,
resolution and the calibration cache."""

from __future__ import annotations

import json
import math
import os

import pytest

from ntransformerd.engine.calibration import layer_skip
from ntransformerd.tools.ntx_model import main

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "and a small model learns to predict the next word of every sentence it reads ").split()


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(" ".join(WORDS[i * 7 % len(WORDS)] for i in range(600)))
    return str(path)


def run_json(capsys, *argv) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_perplexity_command(synth_model, text_file, capsys):
    out = run_json(capsys, "perplexity", synth_model("tiny", "q8_0"), "--file", text_file, "--ctx", "32",
                   "--chunks", "3", "--json")
    assert out["chunks"] == 3 and out["tokens_scored"] == 3 * 15 and out["ctx"] == 32
    assert math.isfinite(out["perplexity"]) and out["perplexity"] > 1
    assert out["perplexity"] == pytest.approx(math.exp(out["nll"]))


def test_calibrate_skip_is_cached_and_read_by_skip_layers(synth_model, text_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NTX_STATE_DIR", str(tmp_path / "state"))
    model = str(tmp_path / "small.gguf")
    os.link(synth_model("small", "q8_0"), model)  # its own directory: the cache goes beside it
    cal = run_json(capsys, "calibrate-skip", model, "--file", text_file, "--ctx", "32", "--chunks", "2", "--json")
    assert len(cal["similarity"]) == 4 and [r["k"] for r in cal["table"]] == [0, 1]
    assert cal["saved"] == model + ".skip.json" and os.path.exists(cal["saved"])
    order = layer_skip.Calibration.from_dict(cal).order
    assert order and set(order) <= {1, 2}  # never the first or last layer
    skipped = run_json(capsys, "perplexity", model, "--file", text_file, "--ctx", "32", "--chunks", "2",
                       "--skip-layers", "1", "--json")
    assert skipped["skip_layers"] == [order[0]]
    assert skipped["perplexity"] == pytest.approx(cal["table"][1]["perplexity"], rel=1e-6)
    auto = run_json(capsys, "perplexity", model, "--file", text_file, "--ctx", "32", "--chunks", "2",
                    "--skip-layers", "auto:10", "--json")
    assert auto["skip_layers"] == cal["table"][1]["layers"]


def test_skip_layers_without_a_calibration_says_how_to_make_one(synth_model, text_file, tmp_path, capsys,
                                                                monkeypatch):
    monkeypatch.setenv("NTX_STATE_DIR", str(tmp_path / "state"))
    model = str(tmp_path / "tiny.gguf")
    os.link(synth_model("tiny", "q8_0"), model)
    assert main(["perplexity", model, "--file", text_file, "--ctx", "32", "--skip-layers", "auto"]) == 2
    assert "ntx-model calibrate-skip" in capsys.readouterr().err


def test_parse_skip():
    assert layer_skip.parse_skip(None) is None and layer_skip.parse_skip("none") is None
    assert layer_skip.parse_skip("auto").threshold == layer_skip.AUTO_THRESHOLD
    assert layer_skip.parse_skip("auto:0.05").threshold == 0.05
    assert layer_skip.parse_skip("4").count == 4
    assert layer_skip.parse_skip("11,3,7").layers == (3, 7, 11)
    for bad in ("auto:x", "3-7", "fast"):
        with pytest.raises(ValueError, match="skip-layers|threshold"):
            layer_skip.parse_skip(bad)


def test_auto_takes_the_most_layers_within_the_threshold():
    cal = layer_skip.Calibration("m", "t", 32, 1, [0.5, 0.9, 0.95, 0.8, 0.99, 0.3],
                                 [{"k": 0, "layers": [], "perplexity": 10.0},
                                  {"k": 1, "layers": [4], "perplexity": 10.2},
                                  {"k": 2, "layers": [2, 4], "perplexity": 10.29},
                                  {"k": 3, "layers": [1, 2, 4], "perplexity": 11.0}])
    assert cal.order == [4, 2, 1, 3]  # most similar first, never layer 0 or 5
    assert cal.auto(0.03) == (2, 4) and cal.auto(0.0) == () and cal.auto(0.5) == (1, 2, 4)
    assert layer_skip.resolve(layer_skip.parse_skip("2"), 6, cal) == (2, 4)
    with pytest.raises(ValueError, match="does not exist"):
        layer_skip.resolve(layer_skip.parse_skip("3,9"), 6, cal)
    with pytest.raises(ValueError, match="calibrate-skip"):
        layer_skip.resolve(layer_skip.parse_skip("auto"), 6, None)
