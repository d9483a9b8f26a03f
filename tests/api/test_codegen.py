"""The committed generated gRPC code must equal a fresh generation from the proto, byte for byte."""

from __future__ import annotations

from pathlib import Path

from kvstore.api import codegen


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    written = codegen.generate(tmp_path)
    assert [path.name for path in written] == list(codegen.GENERATED)
    for path in written:
        committed = codegen.COMMITTED_DIR / path.name
        assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale: run codegen"


def test_stale_code_is_detected(tmp_path: Path) -> None:
    # The comparison must be able to fail: an edited proto generates different bytes.
    proto = tmp_path / "proto" / codegen.PROTO_FILE
    proto.parent.mkdir(parents=True)
    text = (codegen.PROTO_ROOT / codegen.PROTO_FILE).read_text()
    proto.write_text(
        text.replace("message GetStatsRequest {}", "message GetStatsRequest { int64 x = 1; }")
    )
    written = codegen.generate(tmp_path / "out", proto_root=tmp_path / "proto")
    pb2 = next(path for path in written if path.name == "kvstore_pb2.py")
    assert pb2.read_bytes() != (codegen.COMMITTED_DIR / "kvstore_pb2.py").read_bytes()


def test_generated_modules_import_under_kvstore_root() -> None:
    from kvstore.api.v1 import kvstore_pb2, kvstore_pb2_grpc

    assert kvstore_pb2.DESCRIPTOR.package == "kvstore.v1"
    assert hasattr(kvstore_pb2_grpc, "KVStoreServicer")
    assert set(kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].methods_by_name) == {
        "QueryHit",
        "PutBlocks",
        "GetBlocks",
        "PutSWAState",
        "GetSWAState",
        "ReleaseLease",
        "GetStats",
    }
