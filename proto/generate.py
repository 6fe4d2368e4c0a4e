#!/usr/bin/env python3
"""Generate the Python stubs of proto/ntx_proto/ntransformer/v1/*.proto beside the .proto files.

The package ntx_proto holds the API: the .proto files and their stubs (`from
ntx_proto.ntransformer.v1 import inference_pb2`), what the daemon, the client and other services
import. The stubs are committed; tests/proto/test_stubs.py regenerates them into a temporary
directory and fails if the committed ones differ. After editing a .proto run:

    python proto/generate.py            (needs grpcio-tools: pip install 'ntransformer[test]')
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

PROTO_ROOT = pathlib.Path(__file__).resolve().parent / "ntx_proto"  # protoc's -I: names stay ntransformer/v1/…
DEFAULT_OUT = PROTO_ROOT
PACKAGE = "ntx_proto"  # where `ntransformer.v1` lands inside the installed tree


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(PROTO_ROOT.glob("ntransformer/v1/*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out}",
            f"--pyi_out={out}", f"--grpc_python_out={out}", *map(str, protos)]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed (see above)")
    written = []
    for d in (out / "ntransformer", out / "ntransformer" / "v1"):
        (d / "__init__.py").write_text("")
        written.append(d / "__init__.py")
    for f in sorted((out / "ntransformer" / "v1").glob("*_pb2*.py*")):
        # protoc writes absolute imports (`from ntransformer.v1 import x_pb2`); the stubs live
        # inside ntx_proto, so point them there instead of adding a top-level package.
        text = re.sub(r"^from ntransformer\.v1 import", f"from {PACKAGE}.ntransformer.v1 import",
                      f.read_text(), flags=re.M)
        text = text.replace("import ntransformer.v1.", f"import {PACKAGE}.ntransformer.v1.")
        f.write_text(text)
        written.append(f)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    for f in generate(args.out):
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
