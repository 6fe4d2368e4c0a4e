"""The daemon outlives every request and every model: bad sampling parameters, a model file with
corrupt scales (refused at load) and a model whose scales are finite but whose logits are not
(its requests fail, the daemon stops serving it, a good load brings it back)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from ntransformerd.engine.gguf_file import GGUFModel, nonfinite_scales
from ntx_client import Client, NtxError
from ntx_client import cli
from ntx_proto.states import ServingState
from ntx_system import admin


def _generate_ok(socket: str) -> str:
    """A normal request from a fresh client, answered (the timeout is a hang guard)."""
    with Client(socket, timeout=120) as c:
        done = c.complete("Hello", max_tokens=2, temperature=0, ignore_eos=True)
    assert len(done.ids) == 2
    return done.text


@pytest.mark.parametrize("penalty", ["1e-300", "1e-40"])
def test_a_penalty_that_would_empty_the_distribution_is_refused_and_others_are_served(daemon, penalty, capsys):
    rc = cli.main(["--socket", daemon.socket, "--timeout", "10", "generate", "--repeat-penalty", penalty,
                   "--max-tokens", "4", "Hello"])
    err = capsys.readouterr().err
    assert rc == 1 and "repetition_penalty must be in [0.01, 100]" in err and "INVALID_ARGUMENT" not in err, err
    _generate_ok(daemon.socket)


def _corrupt(src: str, dst: str, tensor: str, data: bytes) -> str:
    shutil.copy(src, dst)
    t = GGUFModel(src).tensors[tensor]
    with open(dst, "r+b") as f:
        f.seek(t.offset)
        f.write(data)
    return dst


@pytest.fixture(scope="module")
def models(synth_model, tmp_path_factory):
    """(good, random bytes in its weights, finite scales but NaN logits) copies of a tiny model."""
    good = synth_model("tiny", "q8_0")
    d = tmp_path_factory.mktemp("bad-models")
    noise = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    random = _corrupt(good, str(d / "random.gguf"), "blk.0.attn_q.weight", noise)
    t = GGUFModel(random).tensors["blk.0.attn_q.weight"]
    assert nonfinite_scales(t) is not None  # 4 KB of noise holds ~120 Q8_0 scales: some NaN or inf
    norm = GGUFModel(good).tensors["output_norm.weight"]
    huge = _corrupt(good, str(d / "huge.gguf"), "output_norm.weight",
                    np.full(norm.nbytes // 4, 3e38, np.float32).tobytes())  # finite; x * 3e38 is not
    assert all(nonfinite_scales(t) is None for t in GGUFModel(huge).tensors.values())
    return good, random, huge


def test_bad_models_are_refused_or_stop_serving_and_a_good_load_recovers(new_daemon, models, capsys):
    good, random, huge = models
    d = new_daemon("--model", good, "--max-ctx", "128").wait_ready()
    verb = ["--admin-socket", d.admin_socket, "--timeout", "60"]
    try:
        before = _generate_ok(d.socket)
        # corrupt scales: refused at load, the loaded model keeps serving
        assert admin.main(["model", "load", random, *verb]) == 1
        err = capsys.readouterr().err
        assert "tensor 'blk.0.attn_q.weight' (Q8_0)" in err and "NaN or infinite" in err, err
        assert _generate_ok(d.socket) == before

        # finite scales, NaN logits: accepted, then its first request fails and the daemon stops serving it
        assert admin.main(["model", "load", huge, *verb]) == 0
        capsys.readouterr()
        with Client(d.socket, timeout=10) as c:
            with pytest.raises(NtxError) as e:
                c.complete("Hello", max_tokens=4)
            assert e.value.code == grpc.StatusCode.INTERNAL
            assert "model 'synthetic tiny q8_0 seed 0' produced invalid logits" in str(e.value)
            assert c.health() == "NOT_SERVING"
            s = c.status()
            assert s.state == ServingState.FAILED and "ntx-admin model load" in s.error
            with pytest.raises(NtxError, match="produced invalid logits") as e:
                c.complete("Hello", max_tokens=4)
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert d.proc.poll() is None

        # a good load: serving again
        assert admin.main(["model", "load", good, *verb]) == 0
        assert _generate_ok(d.socket) == before
        with Client(d.socket) as c:
            assert c.health() == "SERVING" and c.status().state == ServingState.SERVING and not c.status().error
    finally:
        d.cleanup()


# ---- start and stop ----------------------------------------------------------------------------

def _socket_appears(d, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(d.socket):
        assert d.proc.poll() is None, d.log()
        assert time.monotonic() < end, d.log()
        time.sleep(0.002)


def test_a_client_in_the_start_window_hears_starting_and_wait_succeeds(new_daemon, synth_model, tmp_path, capsys):
    d = new_daemon("--model", synth_model("tiny", "q8_0"), "--max-ctx", "128",
                   env={"NTX_STATE_DIR": str(tmp_path)})
    try:
        _socket_appears(d)
        with Client(d.socket, timeout=10) as c:
            s = c.status()  # at once: the first load may not have begun
            assert s.state == ServingState.LOADING, s
            try:
                c.complete("Hello", max_tokens=1)
            except NtxError as e:  # not "no model is loaded"
                assert "starting" in str(e) or "loading" in str(e), e
        rc = cli.main(["--socket", d.socket, "generate", "--wait", "--wait-timeout", "120", "--raw",
                       "--temperature", "0", "--max-tokens", "2", "Hello"])
        assert rc == 0, capsys.readouterr().err
    finally:
        d.cleanup()


# The daemon's own main() with every layer's load slowed: a load long enough to stop in the
# middle of (each layer is mmapped in microseconds otherwise).
SLOW_LOAD = """
import sys, time
from ntransformerd.engine import gguf_file
from ntransformerd import main
loaded = gguf_file.GGUFModel.layer_loaded
per_layer, first_layer = float(sys.argv[1]), float(sys.argv[2])
def slow(self, i):
    time.sleep(per_layer if i else first_layer)
    loaded(self, i)
gguf_file.GGUFModel.layer_loaded = slow
sys.exit(main.main(sys.argv[3:]))
"""


@pytest.mark.parametrize("per_layer, first_layer, during, words", [
    (1.0, 1.0, "loading layer 1/30", "the load stopped"),  # stops at its next layer
    (1.0, 120.0, "checking the model's scales", "did not stop within"),  # stuck in one long step: left behind
])
def test_sigterm_during_a_load_exits_0_without_waiting_for_it(default_model_path, tmp_path, per_layer, first_layer, during,
                                                  words):
    sock = str(tmp_path / "d.sock")
    log_path = tmp_path / "log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", SLOW_LOAD, str(per_layer), str(first_layer), "--socket", sock, "--backend", "cpu",
             "--config", os.devnull, "--socket-group", "", "--model", default_model_path],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "NTX_STATE_DIR": str(tmp_path)})
    try:
        end = time.monotonic() + 60
        while not os.path.exists(sock):
            assert proc.poll() is None and time.monotonic() < end, log_path.read_text()
            time.sleep(0.01)
        with Client(sock, timeout=10) as c:
            while c.status().load_progress != during:
                assert time.monotonic() < end, log_path.read_text()
                time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)  # far less than the stuck step's 120 s: it did not wait for the load
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert rc == 0, (rc, text)
    assert words in text and "loaded " not in text and not os.path.exists(sock), text
