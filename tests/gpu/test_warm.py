"""A model's kernels compile at load, once per machine: the second load compiles nothing."""
import pytest

cp = pytest.importorskip("cupy")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from ntransformerd.engine.backends.cuda import warm  # noqa: E402

pytestmark = pytest.mark.gpu


def test_second_load_compiles_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path))  # a machine whose marker is not there yet
    types = {int(Q.F32), int(Q.Q8_0)}
    first = warm.compile_for(types, jobs=4)
    assert first > 0 and len(list((tmp_path / "cuda-kernels").iterdir())) == 1
    assert warm.compile_for(types, jobs=4) == 0
    assert warm.compile_for(types | {int(Q.Q4_K)}, jobs=4) > 0  # another model's types: its own marker
