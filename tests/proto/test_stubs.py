"""The committed stubs in proto/ntx_proto are what proto/generate.py makes now, and they import."""

import importlib.util
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "proto" / "ntx_proto"
# Lines that name the generator's own version: a newer grpcio-tools changes them and nothing else.
VERSION_LINE = re.compile(r"Protobuf Python Version|GRPC_GENERATED_VERSION = |^\s*\d+,\s*$|_runtime_version\.")


def _normalized(path: pathlib.Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if not VERSION_LINE.search(line)]


def test_committed_stubs_are_fresh(tmp_path):
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpcio-tools is not installed (pip install 'ntransformer[test]')")
    sys.path.insert(0, str(ROOT / "proto"))
    try:
        import generate
    finally:
        sys.path.pop(0)
    generate.generate(tmp_path)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    # what protoc writes lives under ntransformer/ beside the .proto sources; the package's own
    # modules (paths, wire) sit above it
    committed = sorted(p.relative_to(COMMITTED) for p in (COMMITTED / "ntransformer").rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".proto")
    assert fresh == committed, "stub files differ: run python proto/generate.py"
    for rel in fresh:
        assert _normalized(tmp_path / rel) == _normalized(COMMITTED / rel), (
            f"{rel} is stale: run python proto/generate.py and commit the result")


def test_stubs_import_and_name_the_services():
    from ntx_proto.ntransformer.v1 import admin_pb2, inference_pb2
    names = {s.full_name for s in (*inference_pb2.DESCRIPTOR.services_by_name.values(),
                                   *admin_pb2.DESCRIPTOR.services_by_name.values())}
    assert names == {"ntransformer.v1.Inference", "ntransformer.v1.Admin"}
