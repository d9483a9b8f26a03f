"""M concurrent gRPC clients against the real gateway for a bounded time: no errors, every
block read back bit-exact, latency percentiles measured (attached to the test report)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest

from kvstore.api.server import ServerOptions
from kvstore.chaos.grpc_load import GrpcLoadConfig, run_grpc_load
from kvstore.errors import InvalidArgument
from kvstore.runtime.service import RunningService, embedded_service

TOKEN = "load-token-0123456789"


@pytest.fixture(scope="module")
def running(ray_cluster, tmp_path_factory) -> Iterator[RunningService]:  # type: ignore[no-untyped-def]
    with embedded_service(
        tmp_path_factory.mktemp("load-data"),
        cluster=ray_cluster,
        deployment="load",
        fsync="never",
        run_gc=False,
        options=ServerOptions(token=TOKEN, worker_threads=16, max_in_flight=256),
    ) as service:
        yield service


def test_concurrent_clients_see_no_errors_and_exact_bytes(
    running: RunningService, record_property: Callable[[str, object], None]
) -> None:
    config = GrpcLoadConfig(
        clients=8, seconds=6.0, token=TOKEN, block_bytes=running.tier.block_bytes
    )
    report = run_grpc_load(running.address, config, seed=1)
    summary = report.as_dict()
    for name in ("requests", "qps", "p50_ms", "p99_ms"):
        record_property(name, summary[name])
    record_property("per_rpc", summary["per_rpc"])
    assert report.error_count == 0, (report.errors, report.error_messages)
    assert report.wrong_bytes == 0
    assert report.block_misses == 0  # every block a client wrote, it reads back
    assert report.requests >= 8 * 10  # every client got real work done
    assert set(summary["per_rpc"]) >= {"GetBlocks", "PutBlocks", "QueryHit", "GetSWAState"}
    p99 = report.percentile_ms(99)
    assert math.isfinite(p99) and 0 < report.percentile_ms(50) <= p99
    # Bounded: no request waited anywhere near the client timeout.
    assert p99 < config.timeout_s * 1e3 / 3


def test_load_is_sent_to_loopback_only() -> None:
    with pytest.raises(InvalidArgument, match="address"):
        run_grpc_load("10.1.2.3:50051", GrpcLoadConfig(clients=1, seconds=1.0))
