"""Security review of ``kvstore up`` (issue 15), finding 5: the gateway's memory and its event
loop, bounded against one client.

Reproduced: 100 GetBlocks streams left unread took the gateway from 395 to 1,391 MiB (each read
every key before its first reply, duplicates included: one key × 2,000 = 228 MB from a 66 KB
request); a PutBlocks stream was capped in blocks, not bytes; 8M-token QueryHits were hashed on
the event loop and stalled everyone's calls for 2.5 s; a stream stopped counting against
``max_in_flight`` once it yielded.
"""

from __future__ import annotations

import resource
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import BLOCK, Tenants
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_tenants import payloads, prompt

from kvstore.api.gateway import Gateway
from kvstore.api.server import SERVICE_NAME, ServerOptions
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.api.v1 import kvstore_pb2_grpc as pb_grpc

MIB = 1 << 20


@contextmanager
def small_gateway(tenants: Tenants, max_in_flight: int = 256, **limits: Any) -> Iterator[str]:
    """A second gateway over the same tier and tenants, with tight limits (``limits``: fields
    of ``GatewayLimits``; ``budget_*``: of its ``BudgetLimits``)."""
    tier = tenants.running.tier
    try:
        from kvstore.api.budget import BudgetLimits
        from kvstore.api.servicer import GatewayLimits

        budget = {k[len("budget_") :]: v for k, v in limits.items() if k.startswith("budget_")}
        # (A limit the code under test does not have yet is left out, so that a finding can
        # be reproduced on the code before its fix.)
        known = GatewayLimits.__dataclass_fields__
        rest = {k: v for k, v in limits.items() if not k.startswith("budget_") and k in known}
        assert tenants.tokens_file is not None
        options = ServerOptions(
            tokens_file=tenants.tokens_file,
            tenant_secret_file=tenants.tokens_file.parent / "tenant.secret",
            max_in_flight=max_in_flight,
            limits=GatewayLimits(budget=BudgetLimits(**budget), **rest),
        )
    except (ImportError, AssertionError):  # the code before issue 15: none of these limits
        options = ServerOptions(token=tenants.tokens["bob"], max_in_flight=max_in_flight)
    gateway = Gateway(tier, options)
    try:
        yield gateway.address
    finally:
        gateway.stop(grace_s=0.5)


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / MIB


def test_a_key_asked_many_times_is_read_and_sent_once(
    stub: pb_grpc.KVStoreStub, tenants: Tenants
) -> None:
    _, keys = prompt(tenants, 301, 1)
    with tenants.client("bob") as bob:
        bob.put_blocks(keys, payloads(keys), "chatbot")
    request = pb.GetBlocksRequest(keys=keys * 2000)  # 64 KB asking for 228 MB
    replies = list(stub.GetBlocks(request, metadata=tenants.auth("bob"), timeout=60))
    assert len(replies) == 1 and replies[0].found and len(replies[0].payload) == BLOCK


def test_unread_streams_hold_no_more_than_the_tenants_budget_and_others_still_read(
    tenants: Tenants,
) -> None:
    _, keys = prompt(tenants, 302, 300)
    _, hers = prompt(tenants, 305, 4)
    with tenants.client("bob") as bob, tenants.client("alice") as alice:
        bob.put_blocks(keys, payloads(keys), "chatbot")
        alice.put_blocks(hers, payloads(hers, 1), "chatbot")
    with (
        small_gateway(tenants, budget_tenant_bytes=96 * MIB, budget_wait_s=30.0) as address,
        grpc.insecure_channel(address) as channel,
    ):
        stub = pb_grpc.KVStoreStub(channel)
        before = _rss_mib()
        # 20 streams of 300 blocks (34 MB each, 680 MB in all) that bob never reads.
        streams = [
            stub.GetBlocks(pb.GetBlocksRequest(keys=keys), metadata=tenants.auth("bob"), timeout=60)
            for _ in range(20)
        ]
        time.sleep(3)
        grown = _rss_mib() - before
        started = time.perf_counter()
        replies = list(
            stub.GetBlocks(
                pb.GetBlocksRequest(keys=hers), metadata=tenants.auth("alice"), timeout=30
            )
        )
        waited = time.perf_counter() - started
        for stream in streams:
            stream.cancel()
    assert [r.payload for r in replies] == payloads(hers, 1)
    assert waited < 5.0, f"alice waited {waited:.1f} s behind bob's streams"
    # Bob's 96 MiB budget plus what the transport buffers: far below the 680 MB he asked for.
    assert grown < 200, f"the gateway grew {grown:.0f} MiB for 20 unread streams"


def test_a_reader_that_stops_taking_blocks_is_ended(tenants: Tenants) -> None:
    _, keys = prompt(tenants, 303, 120)
    with tenants.client("bob") as bob:
        bob.put_blocks(keys, payloads(keys), "chatbot")
    with (
        small_gateway(tenants, stall_s=2.0) as address,
        grpc.insecure_channel(address) as channel,
    ):
        stream = pb_grpc.KVStoreStub(channel).GetBlocks(
            pb.GetBlocksRequest(keys=keys), metadata=tenants.auth("bob"), timeout=60
        )
        time.sleep(4)  # take nothing
        with pytest.raises(grpc.RpcError) as error:
            for _ in stream:
                pass
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "took no block" in (error.value.details() or "")


def test_a_stream_counts_against_admission_until_it_finishes(tenants: Tenants) -> None:
    _, keys = prompt(tenants, 304, 120)
    with tenants.client("bob") as bob:
        bob.put_blocks(keys, payloads(keys), "chatbot")
    with (
        small_gateway(tenants, max_in_flight=4) as address,
        grpc.insecure_channel(address) as channel,
    ):
        stub = pb_grpc.KVStoreStub(channel)
        streams = [
            stub.GetBlocks(pb.GetBlocksRequest(keys=keys), metadata=tenants.auth("bob"), timeout=60)
            for _ in range(4)
        ]
        for stream in streams:
            next(stream)  # each has started yielding, and is stalled on its reader
        with pytest.raises(grpc.RpcError) as error:
            stub.GetStats(pb.GetStatsRequest(), metadata=tenants.auth("alice"), timeout=30)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for stream in streams:
            stream.cancel()
        deadline = time.monotonic() + 10
        while True:  # the cancelled streams leave admission as they end
            try:
                stub.GetStats(pb.GetStatsRequest(), metadata=tenants.auth("alice"), timeout=30)
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "admission never recovered"
                time.sleep(0.1)


def test_a_put_stream_is_capped_in_bytes(stub: pb_grpc.KVStoreStub, tenants: Tenants) -> None:
    payload = bytes(BLOCK)
    per_message = (4 * MIB) // BLOCK
    messages = (
        pb.PutBlocksRequest(
            blocks=[
                pb.Block(key=(0x5EC0000 + m * per_message + i).to_bytes(32, "big"), payload=payload)
                for i in range(per_message)
            ],
            traffic_class="chatbot" if m == 0 else "",
        )
        for m in range((70 * MIB) // (per_message * BLOCK) + 1)  # 70 MiB in one stream
    )
    with pytest.raises(grpc.RpcError) as error:
        stub.PutBlocks(messages, metadata=tenants.auth("bob"), timeout=120)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "payload bytes" in (error.value.details() or "")


def test_long_prompts_are_capped_and_hashed_off_the_event_loop(
    stub: pb_grpc.KVStoreStub, tenants: Tenants, monkeypatch: pytest.MonkeyPatch
) -> None:
    too_long = pb.QueryHitRequest(token_ids=[1] * ((1 << 20) + 1))
    with pytest.raises(grpc.RpcError) as error:
        stub.QueryHit(too_long, metadata=tenants.auth("bob"), timeout=60)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids" in (error.value.details() or "")

    # Where a 1M-token prompt is hashed: never on the gateway's event loop, which every other
    # call waits on (it held the loop ~110 ms per 1M tokens, 2.5 s for four 8M-token prompts).
    # (A request's token ids are hashed by ``HitRequest.words``, here in the servicer.)
    from kvstore.tier import records

    hashed_on: list[str] = []
    real = getattr(records, "block_key_words", None)

    def recording(*args: Any, **kwargs: Any) -> Any:
        hashed_on.append(threading.current_thread().name)
        assert real is not None
        return real(*args, **kwargs)

    monkeypatch.setattr(records, "block_key_words", recording, raising=False)
    tokens = np.random.default_rng(5).integers(0, 128_000, 1 << 20).tolist()
    request = pb.QueryHitRequest(token_ids=tokens, take_lease=False)
    futures = [
        stub.QueryHit.future(request, metadata=tenants.auth("bob"), timeout=120) for _ in range(4)
    ]
    assert all(f.result().plan.prompt_len == 1 << 20 for f in futures)
    assert len(hashed_on) == 4, "the prompts were not hashed once each, by the request"
    assert not any(name == "kvstore-gateway" for name in hashed_on), hashed_on  # the loop's
    # And the health check answers meanwhile (bounded loosely: two shared cores).
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(tenants.address))
    started = time.perf_counter()
    futures = [
        stub.QueryHit.future(request, metadata=tenants.auth("bob"), timeout=120) for _ in range(4)
    ]
    health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=30)
    waited = time.perf_counter() - started
    assert all(f.result().plan.prompt_len == 1 << 20 for f in futures)
    assert waited < 5.0
