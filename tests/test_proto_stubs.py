"""The committed stubs are what `python -m elasticrun.proto.generate` makes today."""

from __future__ import annotations

from pathlib import Path

from elasticrun.proto.generate import PROTO_DIR, generate


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    assert fresh, "no .proto files found"
    stale = [
        path.name for path in fresh if (PROTO_DIR / path.name).read_text() != path.read_text()
    ]
    assert not stale, (
        f"stale generated stubs {stale}: run `python -m elasticrun.proto.generate` and commit"
    )


def test_grpc_stubs_import_their_messages_relatively() -> None:
    from elasticrun.proto import store_pb2, store_pb2_grpc

    assert store_pb2_grpc.store__pb2 is store_pb2
