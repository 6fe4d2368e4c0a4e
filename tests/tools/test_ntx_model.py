"""ntx-model: every quant type of the real model made by `quantize` loads and generates text.

Cost: the sweep is the slow part (14 types, ~10-15 s of CPU each: quantize, load, 8 tokens), and
most of each is gguf.GGUFReader parsing the 49152-token vocabulary, three times (the requantize
check, quantize_file, the run); six types quantize the whole model because they must still say
Paris, the others a 2-layer slice (KEEPS_PARIS below)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.tools.ntx_model import main
from ntransformerd.tools.synth import SHAPES

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


# Types whose greedy continuation must still name Paris: the whole model goes through `quantize`.
# The others only have to load and generate: a 2-layer `slice` (the same quantize_file, the same
# tensor shapes, and the same set of tensor types as the whole model but for q4_k's Q5_K, which
# q5_k has) costs ~60% as much (most of either is gguf.GGUFReader parsing the vocabulary).
KEEPS_PARIS = ("f32", "f16", "bf16", "q8_0", "q6_k", "q5_1")


@pytest.mark.slow
@pytest.mark.parametrize("ftype", list(TYPES))
def test_every_quant_type_generates(default_model_path, tmp_path, capsys, ftype):
    out = str(tmp_path / f"smol-{ftype}.gguf")
    if ftype in KEEPS_PARIS:
        argv = ["quantize", default_model_path, out]
    else:
        argv = ["slice", default_model_path, out, "--layers", "2"]
    assert main([*argv, "--type", ftype, "--quiet", "--allow-requantize"]) == 0
    m = GGUFModel(out)
    assert TYPES[ftype] in {t.qtype for t in m.tensors.values()}
    res = run_json(capsys, "run", out, "--prompt", PROMPT, "--max-tokens", "8", "--ignore-eos", "--json",
                   "--temperature", "0")
    assert len(res["ids"]) == 8 and res["text"].strip(), res
    if ftype in KEEPS_PARIS:
        assert "Paris" in res["text"], res["text"]


def test_run_json_and_dump_logits(default_model_path, tmp_path, capsys):
    dump = tmp_path / "logits.npy"
    res = run_json(capsys, "run", "--prompt", PROMPT, "--max-tokens", "4", "--json", "--dump-logits", str(dump),
                   "--temperature", "0")
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


@pytest.mark.parametrize("sampled", [False, True])
def test_run_goes_through_the_daemons_loop(default_model, capsys, monkeypatch, sampled):
    """`ntx-model run` generates through the scheduler's loop (as a daemon serving one client),
    and gives what the engine's one-sequence loop gives: greedy, and sampled with a seed."""
    from ntransformerd.engine.runtime.engine import Engine, EngineConfig, generate
    from ntransformerd.engine.generation.sampler import SamplingParams
    from ntransformerd.server.scheduler import Scheduler
    iterations = []
    real = Scheduler.iterate
    monkeypatch.setattr(Scheduler, "iterate", lambda self: iterations.append(1) or real(self))
    flags = ["--temperature", "0.9", "--seed", "11", "--top-k", "40"] if sampled else ["--temperature", "0"]
    res = run_json(capsys, "run", "--prompt", PROMPT, "--max-tokens", "12", "--json", "--ignore-eos", "--backend",
                   "cpu", "--max-batch", "1", *flags)
    assert len(iterations) >= 12, "ntx-model run did not go through the scheduler"
    e = Engine(default_model, config=EngineConfig(backend="cpu", max_batch=1, max_ctx=256))
    params = (SamplingParams(temperature=0.9, seed=11, top_k=40, max_tokens=12, ignore_eos=True) if sampled
              else SamplingParams.greedy(max_tokens=12, ignore_eos=True))
    assert res["ids"] == [ev.token for ev in generate(e, res["prompt_ids"], params)]


def test_run_chat_stops_at_end_of_turn(capsys):
    # the exact reference: its first token wins by 0.08 logits, inside the fast backend's
    # quantized-activation error (0.9 here), so on `cpu` the answer may start otherwise
    res = run_json(capsys, "run", "--prompt", "What is the capital of France?", "--chat", "--max-tokens", "40",
                   "--json", "--temperature", "0", "--backend", "cpu-ref")
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
    assert m.config.context_length == SHAPES["tiny"].context


def test_synth_context(tmp_path, capsys):
    """--context is the file's context_length; the Llama 3 shapes default to 3.1's 131072."""
    out = tmp_path / "c.gguf"
    assert main(["synth", str(out), "--shape", "tiny", "--context", "40000", "--quiet"]) == 0
    assert GGUFModel(out).config.context_length == 40000
    assert SHAPES["llama3-8b"].context == SHAPES["llama3-70b"].context == 131072
    assert main(["synth", str(tmp_path / "z.gguf"), "--context", "0", "--quiet"]) == 2
    assert "context 0" in capsys.readouterr().err and not (tmp_path / "z.gguf").exists()


# ---- writing model files: nothing lost ------------------------------------------------------------

def _copy(src, dst) -> bytes:
    data = open(src, "rb").read()
    with open(dst, "wb") as f:
        f.write(data)
    return data


def test_quantize_onto_its_input_is_refused(synth_model, tmp_path, capsys):
    x = tmp_path / "x.gguf"
    before = _copy(synth_model("tiny", "q8_0"), x)
    os.symlink(x, tmp_path / "alias.gguf")
    for out in (x, tmp_path / "alias.gguf"):
        assert main(["quantize", str(x), str(out), "--type", "q8_0"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is the input file" in err and "Traceback" not in err
    assert x.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alias.gguf", "x.gguf"]


def test_quantize_into_a_full_filesystem_leaves_nothing(synth_model, tmp_path):
    """A 1 MiB file-size limit stands for a full disk: the write fails part way."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    r = subprocess.run([sys.executable, "-m", "ntransformerd.tools.ntx_model", "quantize", synth_model("tiny", "q8_0"),
                        str(out_dir / "o.gguf"), "--type", "q8_0"], capture_output=True, text=True,
                       preexec_fn=limit, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("ntx-model: error: cannot write ") \
        and "nothing was written" in r.stderr, r.stderr
    assert r.stdout == "" and list(out_dir.iterdir()) == []


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="a private tmpfs needs root and unshare")
def test_quantize_onto_a_full_tmpfs_leaves_nothing(synth_model, tmp_path):
    """A real full filesystem: a 2 MiB tmpfs, mounted in a mount namespace of its own."""
    out_dir = tmp_path / "small"
    out_dir.mkdir()
    cmd = (f"mount -t tmpfs -o size=2m ntx-test {out_dir} && {sys.executable} -m ntransformerd.tools.ntx_model "
           f"quantize {synth_model('tiny', 'q8_0')} {out_dir}/o.gguf --type q8_0; rc=$?; ls -A {out_dir}; exit $rc")
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", cmd], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith(f"ntx-model: error: cannot write {out_dir}/o.gguf: ") and r.stderr.count("\n") == 1
    assert r.stderr.endswith("(nothing was written)\n"), r.stderr
    assert r.stdout == ""  # `ls -A` inside the namespace: no file, not even a partial one


def test_requantizing_needs_allow_requantize(synth_model, tmp_path, capsys):
    src, out = synth_model("tiny", "q4_0"), tmp_path / "q8.gguf"
    assert main(["quantize", src, str(out), "--type", "q8_0", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "already quantized" in err and "--allow-requantize" in err and "Q4_0 -> Q8_0" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert main(["quantize", src, str(out), "--type", "q8_0", "--allow-requantize"]) == 0
    cap = capsys.readouterr()
    assert cap.err.startswith("ntx-model: warning: ") and "already quantized" in cap.err
    assert cap.out == f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)\n"
    assert Q.Q8_0 in {t.qtype for t in GGUFModel(out).tensors.values()}
    # dequantizing, or keeping each tensor's own type, loses nothing more: no flag needed
    from ntransformerd.tools.quantize import requantized
    assert requantized(src, "f16") == {} and requantized(src, "f32") == {}
    assert requantized(src, "q4_0") == {}  # a q4_0 file is its own plan (token_embd Q6_K included)


def test_overwriting_an_output_keeps_its_mode_and_no_partial_file(synth_model, tmp_path, capsys):
    out = tmp_path / "o.gguf"
    out.write_bytes(b"old")
    out.chmod(0o640)
    assert main(["synth", str(out), "--shape", "tiny", "--type", "q8_0", "--quiet"]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out} (")
    assert oct(out.stat().st_mode & 0o777) == oct(0o640) and out.stat().st_size > 1 << 20
    assert [p.name for p in tmp_path.iterdir()] == ["o.gguf"]


def test_progress_only_on_a_terminal(synth_model, tmp_path, capsys):
    """Not a terminal (capsys): no progress line, only what was written."""
    assert main(["synth", str(tmp_path / "p.gguf"), "--shape", "tiny", "--type", "q8_0"]) == 0
    cap = capsys.readouterr()
    assert cap.err == "" and cap.out.count("\n") == 1 and cap.out.startswith("wrote ")


def test_progress_on_a_terminal_goes_to_stderr(tmp_path, monkeypatch, capsys):
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert main(["synth", str(tmp_path / "p.gguf"), "--shape", "tiny", "--type", "q8_0"]) == 0
    shown = term.getvalue()
    assert "\rsynth: " in shown and "(100%" in shown and shown.endswith("\r")  # erased before the last line
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'p.gguf'} (")


def test_plan_without_prompt(capsys):
    assert main(["run", "--plan"]) == 0
    assert capsys.readouterr().out.startswith("[cpu] ")
    with pytest.raises(SystemExit):
        main(["run"])
    assert "--prompt" in capsys.readouterr().err


def test_one_default_temperature_and_chat_penalty():
    from ntransformerd.engine.generation.sampler import SamplingParams
    from ntransformerd.tools.ntx_model import _sampling, build_parser
    from ntx_client import cli
    from ntx_client.client import CHAT_REPETITION_PENALTY, DEFAULT_TEMPERATURE

    assert SamplingParams().temperature == DEFAULT_TEMPERATURE  # the daemon's default for an unset one
    run = build_parser().parse_args(["run", "--prompt", "x"])
    gen = cli.parser().parse_args(["generate", "x"])
    assert run.temperature == cli.sampling_options(gen)["temperature"] == DEFAULT_TEMPERATURE
    assert _sampling(run).repetition_penalty == 1.0 and cli.sampling_options(gen)["repetition_penalty"] is None
    chat_run = build_parser().parse_args(["run", "--prompt", "x", "--chat", "--temperature", "0"])
    assert _sampling(chat_run).repetition_penalty == CHAT_REPETITION_PENALTY == cli.sampling_options(gen, chat=True)[
        "repetition_penalty"]
    off = build_parser().parse_args(["run", "--prompt", "x", "--chat", "--repeat-penalty", "1", "--presence-penalty",
                                     "0.5"])
    assert _sampling(off).repetition_penalty == 1.0 and _sampling(off).presence_penalty == 0.5


# ---- model files are regular files, in and out ----------------------------------------------------

def _fifo(path) -> str:
    os.mkfifo(path)
    return str(path)


def _socket(path) -> str:
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # the node stays on disk
    return str(path)


def _writers(src: str, out: str) -> list[list[str]]:
    return [["quantize", src, out, "--type", "q8_0", "--quiet"],
            ["slice", src, "--layers", "1", out, "--type", "q8_0", "--quiet"],
            ["synth", out, "--shape", "tiny", "--quiet"]]


def _assert_refused(capsys, argv: list[str], what: str) -> None:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ntx-model: error: ") and what in err, (argv, err)
    assert "Traceback" not in err


@pytest.mark.parametrize("kind", ["fifo", "socket", "directory"])
def test_writers_refuse_an_output_that_is_not_a_regular_file(synth_model, tmp_path, capsys, kind):
    out = tmp_path / "node"
    {"fifo": _fifo, "socket": _socket, "directory": os.mkdir}[kind](out)
    before = os.stat(out)
    for argv in _writers(synth_model("tiny", "q8_0"), str(out)):
        _assert_refused(capsys, argv, {"fifo": "is a FIFO, not a regular file", "socket": "is a socket, not a",
                                       "directory": "is a directory"}[kind])
        after = os.stat(out)
        assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino), argv
    assert [p.name for p in tmp_path.iterdir()] == ["node"]  # no temporary file left behind


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs root")
def test_writers_leave_a_device_node_intact(synth_model, tmp_path, capsys):
    """A character device with /dev/null's numbers, through a symlink too: the rename that
    writes the output would have put a regular file (mode 0666) in the node's place."""
    import stat

    dev = tmp_path / "null"
    os.mknod(dev, stat.S_IFCHR | 0o620, os.makedev(1, 3))
    os.chmod(dev, 0o620)  # past the umask
    os.symlink(dev, tmp_path / "alias.gguf")
    src = synth_model("tiny", "q8_0")
    for out in (dev, tmp_path / "alias.gguf"):
        for argv in _writers(src, str(out)) + [["run", "--prompt", "x", "--dump-logits", str(out)]]:
            _assert_refused(capsys, argv, "is a character device, not a regular file")
            st = os.stat(dev)
            assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3), argv
            assert stat.S_IMODE(st.st_mode) == 0o620, argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alias.gguf", "null"]


def test_library_writers_refuse_a_fifo(synth_model, tmp_path):
    """quantize_file and synthesize, called directly (bench scripts do), refuse it too."""
    from ntransformerd.tools.atomic import OutputError
    from ntransformerd.tools.quantize import quantize_file
    from ntransformerd.tools.synth import synthesize

    out = _fifo(tmp_path / "fifo")
    with pytest.raises(OutputError, match="is a FIFO"):
        quantize_file(synth_model("tiny", "q8_0"), out, "q8_0")
    with pytest.raises(OutputError, match="is a FIFO"):
        synthesize(out)


def test_readers_refuse_a_fifo_promptly(tmp_path):
    """Opening a FIFO for reading waits for a writer forever; every reading command refuses it
    (in a subprocess with a deadline, so a regression fails instead of hanging the suite)."""
    fifo = _fifo(tmp_path / "model.gguf")
    out = str(tmp_path / "o.gguf")
    for argv in (["info", fifo], ["tokenize", fifo, "hi"], ["run", fifo, "--prompt", "x"],
                 ["quantize", fifo, out, "--type", "q8_0"], ["slice", fifo, out, "--layers", "1"],
                 ["perplexity", "--file", fifo], ["run", "--prompt", "x", "--draft", fifo]):
        r = subprocess.run([sys.executable, "-m", "ntransformerd.tools.ntx_model", *argv], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2, (argv, r.stderr)
        assert r.stderr == f"ntx-model: error: {fifo} is a FIFO, not a regular file: give the path of " \
            f"{'a UTF-8 text file' if '--file' in argv else 'a GGUF model file'}\n", argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_slice_takes_options_between_its_paths(tmp_path, capsys):
    src = tmp_path / "src.gguf"
    assert main(["synth", str(src), "--shape", "tiny", "--type", "q8_0", "--quiet"]) == 0
    for i, argv in enumerate((["slice", str(src), "--layers", "1", "{out}", "--type", "q8_0"],
                              ["slice", "--layers", "1", str(src), "{out}", "--type", "q8_0"],
                              ["slice", str(src), "{out}", "--type", "q8_0", "--layers", "1"])):
        out = tmp_path / f"s{i}.gguf"
        assert main([a.format(out=out) for a in argv]) == 0, argv
        assert GGUFModel(out).config.n_layers == 1
    capsys.readouterr()
    with pytest.raises(SystemExit):  # a third path still has no place
        main(["slice", str(src), "--layers", "1", str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf")])
    assert "unrecognized arguments" in capsys.readouterr().err
