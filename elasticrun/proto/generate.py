"""Regenerate the Python stubs of every .proto in this folder: `python -m elasticrun.proto.generate`.

The stubs are committed so that installing elasticrun needs no protoc;
`tests/test_proto_stubs.py` regenerates them into a temporary folder and fails when the
committed ones are stale.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from elasticrun.errors import ElasticrunError

PROTO_DIR = Path(__file__).resolve().parent


def generate(out_dir: Path = PROTO_DIR) -> list[Path]:
    """Write `*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py` for each proto into `out_dir`."""
    # grpcio-tools is a development dependency: imported here, not at module import.
    from grpc_tools import protoc

    protos = sorted(PROTO_DIR.glob("*.proto"))
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(p.name for p in protos),
    ]
    if protoc.main(args) != 0:
        raise ElasticrunError(f"protoc failed on {', '.join(p.name for p in protos)}")
    written = []
    for proto in protos:
        stem = proto.stem
        grpc_file = out_dir / f"{stem}_pb2_grpc.py"
        # protoc writes `import store_pb2`, which only works with this folder on
        # sys.path; the stubs live in a package, so import the sibling relatively.
        text = re.sub(
            rf"^import {stem}_pb2 as ", f"from . import {stem}_pb2 as ", grpc_file.read_text(),
            flags=re.MULTILINE,
        )
        grpc_file.write_text(text)
        written += [out_dir / f"{stem}_pb2.py", out_dir / f"{stem}_pb2.pyi", grpc_file]
    return written


if __name__ == "__main__":
    for path in generate():
        print(path, file=sys.stderr)
