"""A running daemon and `ntx-model` writing over the file it serves: the daemon keeps serving
the model it loaded (the write goes to a new inode, renamed over the old one)."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil

from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.tools import ntx_model
from ntx_client import Client
from ntx_proto.ntransformer.v1 import inference_pb2 as pb


@contextlib.contextmanager
def _file_size_limit(nbytes: int):
    """A soft RLIMIT_FSIZE in this process, standing for a full disk (ntx-model's main makes
    the write fail with EFBIG instead of SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_daemon_survives_quantize_of_its_own_model(new_daemon, synth_model, tmp_path, capsys):
    served = tmp_path / "served.gguf"
    shutil.copyfile(synth_model("tiny", "q8_0", seed=0), served)
    other = synth_model("tiny", "q8_0", seed=1)  # same shape and type, other weights
    d = new_daemon("--model", str(served), "--max-ctx", "256")
    try:
        d.wait_ready()
        with Client(d.socket) as c:
            def ids():
                return c.complete("The capital of France is", max_tokens=8, temperature=0, ignore_eos=True).ids
            before = ids()
            inode = os.stat(served).st_ino
            # cut short by a file-size limit: the served file must stay whole
            with _file_size_limit(1 << 20):
                assert ntx_model.main(["quantize", other, str(served), "--type", "q8_0"]) == 1
            assert "nothing was written" in capsys.readouterr().err
            assert os.stat(served).st_ino == inode and ids() == before
            # a complete write replaces the path; the daemon still serves what it loaded
            assert ntx_model.main(["quantize", other, str(served), "--type", "q8_0"]) == 0
            assert os.stat(served).st_ino != inode
            assert GGUFModel(str(served)).metadata["general.name"].endswith("seed 1")
            assert ids() == before
            assert c.status().state == pb.SERVING_STATE_SERVING
        assert d.proc.poll() is None, d.log()
    finally:
        d.cleanup()
