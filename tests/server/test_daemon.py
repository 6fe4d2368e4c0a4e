"""The daemon outlives every request and every model: bad sampling parameters, a model file with
corrupt scales (refused at load) and a model whose scales are finite but whose logits are not
(its requests fail, the daemon stops serving it, a good load brings it back)."""

from __future__ import annotations

import shutil
import time

import grpc
import numpy as np
import pytest

from ntransformerd.engine.gguf_file import GGUFModel, nonfinite_scales
from ntx_client import Client, NtxError
from ntx_client import cli
from ntx_system import admin


def _generate_ok(socket: str, within: float = 10.0) -> str:
    """A normal request from a fresh client, answered within `within` seconds."""
    t0 = time.monotonic()
    with Client(socket, timeout=within) as c:
        done = c.complete("Hello", max_tokens=4, temperature=0, ignore_eos=True)
    assert len(done.ids) == 4 and time.monotonic() - t0 < within
    return done.text


@pytest.mark.parametrize("penalty", ["1e-300", "1e-40"])
def test_a_penalty_that_would_empty_the_distribution_is_refused_and_others_are_served(daemon, penalty, capsys):
    rc = cli.main(["--socket", daemon.socket, "--timeout", "10", "generate", "--repeat-penalty", penalty,
                   "--max-tokens", "4", "Hello"])
    err = capsys.readouterr().err
    assert rc == 1 and "INVALID_ARGUMENT" in err and "repetition_penalty must be in [0.01, 100]" in err, err
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
            assert s.state == cli.FAILED and "ntx-admin model load" in s.error
            with pytest.raises(NtxError, match="produced invalid logits") as e:
                c.complete("Hello", max_tokens=4)
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert d.proc.poll() is None

        # a good load: serving again
        assert admin.main(["model", "load", good, *verb]) == 0
        assert _generate_ok(d.socket) == before
        with Client(d.socket) as c:
            assert c.health() == "SERVING" and c.status().state == cli.SERVING and not c.status().error
    finally:
        d.cleanup()
