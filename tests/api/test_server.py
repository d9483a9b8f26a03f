"""The real gRPC gateway on port 0, in front of a real deployment on the session Ray cluster."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from certs import self_signed
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from kvstore.api.client import KVStoreClient
from kvstore.api.server import SERVICE_NAME, ServerOptions
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.api.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import InvalidArgument
from kvstore.keys import block_keys
from kvstore.runtime.service import RunningService, embedded_service
from kvstore.tier.records import HitRequest, Layout

TOKEN = "test-token-0123456789"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture(scope="module")
def running(ray_cluster, tmp_path_factory) -> Iterator[RunningService]:  # type: ignore[no-untyped-def]
    data = tmp_path_factory.mktemp("api-data")
    with embedded_service(
        data,
        cluster=ray_cluster,
        deployment="api-test",
        fsync="never",
        run_gc=False,
        options=ServerOptions(token=TOKEN, max_message_bytes=8 * 1024 * 1024),
        metrics_port=0,
    ) as service:
        yield service


@pytest.fixture()
def client(running: RunningService) -> Iterator[KVStoreClient]:
    with KVStoreClient(running.address, token=TOKEN) as value:
        yield value


@pytest.fixture()
def stub(running: RunningService) -> Iterator[pb_grpc.KVStoreStub]:
    with grpc.insecure_channel(running.address) as channel:
        yield pb_grpc.KVStoreStub(channel)


def _payloads(keys: list[bytes], size: int) -> list[bytes]:
    return [np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(size) for key in keys]


def test_every_rpc_round_trips(running: RunningService, client: KVStoreClient) -> None:
    fingerprint = running.tier.model_fingerprint
    tokens = np.random.default_rng(11).integers(0, 128_000, 128 * 12 + 150, dtype=np.uint32)
    keys = block_keys(fingerprint, tokens)
    payloads = _payloads(keys[:8], running.tier.block_bytes)

    put = client.put_blocks(keys[:8], payloads, "agent")
    assert put.committed == 8 and not put.failed_keys

    # Block hit 8 blocks = 1024 tokens; no SWA state yet → back off one block (docs/rules.md §5).
    answer = client.query_hit(HitRequest(token_ids=tokens.tolist(), traffic_class="agent"))
    assert answer.plan.block_hit_tokens == 1024
    assert answer.plan.hit_tokens == 896 and not answer.plan.swa_hit
    assert answer.lease_id
    # The keys of the blocks the engine loads: the 8th is recomputed to rebuild the window.
    assert list(answer.hit_block_keys) == keys[:7]
    reads = client.get_blocks(list(answer.hit_block_keys), lease_id=answer.lease_id)
    assert [read.payload for read in reads] == payloads[:7]
    # Past the cap: the 8th block never hits a prompt of 8 blocks + 50 tokens (134 are always
    # computed), and the answer says the tier holds it (the engine does not save it again).
    capped = client.query_hit(
        HitRequest(
            block_keys=keys[:8], prompt_len=8 * 128 + 50, traffic_class="agent", take_lease=False
        )
    )
    assert capped.plan.block_hit_tokens == 7 * 128 and capped.stored_blocks == 8

    state = np.random.default_rng(5).bytes(running.tier.state_size)
    owner = client.put_swa_state(keys[7], 1024, state)
    assert owner
    fetched = client.get_swa_state(keys[7], 1024)
    assert fetched.state == state and fetched.owner == owner

    # Now the state at L1 exists: hit = L1, with the owner and fetch-or-replay advice.
    answer = client.query_hit(
        HitRequest(block_keys=keys, prompt_len=int(tokens.size), traffic_class="agent")
    )
    assert answer.plan.hit_tokens == 1024 and answer.plan.swa_hit
    assert answer.swa_owner == owner
    assert answer.advice in ("fetch", "replay")
    assert answer.fetch_seconds > 0 and answer.replay_seconds > 0
    assert client.release_lease(answer.lease_id or "")
    assert not client.release_lease(answer.lease_id or "")  # released once only

    bounded = client.query_hit(
        HitRequest(
            block_keys=keys, prompt_len=int(tokens.size), mode="bounded-replay", take_lease=False
        )
    )
    assert bounded.lease_id is None and bounded.plan.hit_tokens == 1024

    stats = client.stats()
    assert stats.storage_nodes == 12 and stats.live_storage_nodes == 12
    assert stats.classes["agent"]["lookups"] >= 2
    assert stats.block_bytes_stored >= 8 * 20_000


def test_get_blocks_streams_misses_as_misses(client: KVStoreClient) -> None:
    reads = client.get_blocks([bytes(32), b"\x01" * 32])
    assert [read.payload for read in reads] == [None, None]
    assert all(read.miss_reason for read in reads)


def test_health_and_reflection_answer(running: RunningService) -> None:
    with grpc.insecure_channel(running.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        database = ProtoReflectionDescriptorDatabase(channel)
        # Reflection needs the token too (only health is open).
        with pytest.raises(grpc.RpcError) as denied:
            database.get_services()
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_reflection_lists_and_describes_the_service(running: RunningService) -> None:
    def add_token(context, callback):  # type: ignore[no-untyped-def]
        callback(AUTH, None)

    credentials = grpc.composite_channel_credentials(
        grpc.local_channel_credentials(), grpc.metadata_call_credentials(add_token)
    )
    with grpc.secure_channel(running.address, credentials) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= services
        described = database.FindFileContainingSymbol(SERVICE_NAME)
        assert described.package == "kvstore.v1"


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (pb.QueryHitRequest(prompt_len=-5, traffic_class="agent"), "prompt_len"),
        (pb.QueryHitRequest(block_keys=[b"short"], prompt_len=1000), "block_keys[0]"),
        (pb.QueryHitRequest(token_ids=[1, 2], block_keys=[bytes(32)], prompt_len=2), "token_ids"),
        (pb.QueryHitRequest(block_keys=[bytes(32)] * 3, prompt_len=300), "prompt_len"),
        (pb.QueryHitRequest(prompt_len=10, mode=7), "mode"),
        (pb.QueryHitRequest(prompt_len=10, traffic_class="nope"), "traffic_class"),
        (pb.QueryHitRequest(token_ids=[1, 2, 3], prompt_len=5), "prompt_len"),
    ],
)
def test_bad_query_fields_are_invalid_argument(
    stub: pb_grpc.KVStoreStub, request_: pb.QueryHitRequest, field: str, client: KVStoreClient
) -> None:
    with pytest.raises(grpc.RpcError) as error:
        stub.QueryHit(request_, metadata=AUTH, timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (error.value.details() or "")
    assert client.serving()  # still serving


def test_bad_swa_and_block_fields(stub: pb_grpc.KVStoreStub, running: RunningService) -> None:
    cases = [
        (
            lambda: stub.PutSWAState(
                pb.PutSWAStateRequest(key=bytes(32), position=128, state=b"x"), metadata=AUTH
            ),
            "state",
        ),
        (
            lambda: stub.PutSWAState(
                pb.PutSWAStateRequest(
                    key=bytes(32), position=100, state=bytes(running.tier.state_size)
                ),
                metadata=AUTH,
            ),
            "position",
        ),
        (
            lambda: stub.GetSWAState(pb.GetSWAStateRequest(key=b"k", position=128), metadata=AUTH),
            "key",
        ),
        (
            lambda: stub.GetSWAState(
                pb.GetSWAStateRequest(key=bytes(32), position=-128), metadata=AUTH
            ),
            "position",
        ),
        (
            lambda: stub.PutBlocks(
                iter([pb.PutBlocksRequest(blocks=[pb.Block(key=b"k", payload=b"p")])]),
                metadata=AUTH,
            ),
            "blocks[0].key",
        ),
        (
            lambda: stub.PutBlocks(
                iter([pb.PutBlocksRequest(blocks=[pb.Block(key=bytes(32), payload=b"")])]),
                metadata=AUTH,
            ),
            "blocks[0].payload",
        ),
        (lambda: stub.PutBlocks(iter([]), metadata=AUTH), "blocks"),
        (
            lambda: list(stub.GetBlocks(pb.GetBlocksRequest(keys=[b"abc"]), metadata=AUTH)),
            "keys[0]",
        ),
        (lambda: stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=""), metadata=AUTH), "lease_id"),
        (
            lambda: stub.QueryHit(
                pb.QueryHitRequest(block_keys_packed=bytes(32 * 3 + 5), prompt_len=1000),
                metadata=AUTH,
            ),
            "block_keys_packed",
        ),
        (
            lambda: stub.QueryHit(
                pb.QueryHitRequest(
                    block_keys=[bytes(32)], block_keys_packed=bytes(32), prompt_len=1000
                ),
                metadata=AUTH,
            ),
            "block_keys_packed",
        ),
    ]
    for call, field in cases:
        with pytest.raises(grpc.RpcError) as error:
            call()
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert field in (error.value.details() or ""), (field, error.value.details())


def test_keys_sent_packed_or_one_by_one_get_the_same_plan_in_the_same_form(
    running: RunningService, client: KVStoreClient, stub: pb_grpc.KVStoreStub
) -> None:
    fingerprint = running.tier.model_fingerprint
    tokens = np.random.default_rng(23).integers(0, 128_000, 128 * 6 + 140, dtype=np.uint32)
    keys = block_keys(fingerprint, tokens)
    client.put_blocks(keys[:4], _payloads(keys[:4], running.tier.block_bytes), "chatbot")
    common = {"prompt_len": int(tokens.size), "traffic_class": "chatbot"}
    packed = stub.QueryHit(
        pb.QueryHitRequest(block_keys_packed=b"".join(keys), **common), metadata=AUTH
    )
    one_by_one = stub.QueryHit(pb.QueryHitRequest(block_keys=keys, **common), metadata=AUTH)
    assert packed.plan == one_by_one.plan and packed.plan.block_hit_tokens == 4 * 128
    # No state at L1: the hit backs off one block, and the keys are those of the 3 it loads.
    assert packed.plan.hit_tokens == 3 * 128
    assert packed.hit_block_keys_packed == b"".join(keys[:3]) and not packed.hit_block_keys
    assert list(one_by_one.hit_block_keys) == keys[:3] and not one_by_one.hit_block_keys_packed
    answer = client.query_hit(HitRequest(block_keys=keys, **common))  # the Python client packs
    assert list(answer.hit_block_keys) == keys[:3]
    with pytest.raises(InvalidArgument, match=r"block_keys\[2\]"):
        client.query_hit(HitRequest(block_keys=[keys[0], keys[1], keys[2][:31]], **common))


def test_unknown_lease_is_not_found(stub: pb_grpc.KVStoreStub) -> None:
    with pytest.raises(grpc.RpcError) as error:
        list(stub.GetBlocks(pb.GetBlocksRequest(keys=[bytes(32)], lease_id="nope"), metadata=AUTH))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_missing_or_wrong_token_is_unauthenticated(running: RunningService) -> None:
    for token in (None, "wrong"):
        with KVStoreClient(running.address, token=token) as client:
            for call in (client.stats, lambda c=client: c.get_blocks([bytes(32)])):
                with pytest.raises(grpc.RpcError) as error:
                    call()
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_oversize_message_is_resource_exhausted(
    running: RunningService, client: KVStoreClient
) -> None:
    with KVStoreClient(running.address, token=TOKEN, max_message_bytes=64 * 1024 * 1024) as big:
        with pytest.raises(grpc.RpcError) as error:
            big.put_swa_state(bytes(32), 128, bytes(9 * 1024 * 1024))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.serving()


def test_metrics_endpoint_exports_figures(running: RunningService, client: KVStoreClient) -> None:
    client.stats()
    port = running.gateway.metrics_port
    assert port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    for name in (
        "kvstore_rpc_seconds_bucket",
        "kvstore_block_hit_rate",
        "kvstore_block_misses",
        "kvstore_stored_bytes",
        "kvstore_degraded_reads",
        "kvstore_repair_stripes",
    ):
        assert name in text, name


def test_tls_server_round_trips(ray_cluster, tmp_path: Path, running: RunningService) -> None:  # type: ignore[no-untyped-def]
    from kvstore.api.gateway import Gateway

    cert, key = self_signed(tmp_path)
    gateway = Gateway(running.tier, ServerOptions(tls_cert=cert, tls_key=key))
    try:
        with KVStoreClient(gateway.address, tls_root_cert=cert) as secure:
            assert secure.serving()
            assert secure.stats().storage_nodes == 12
        with KVStoreClient(gateway.address, timeout_s=5) as plaintext:
            with pytest.raises(grpc.RpcError):
                plaintext.stats()
    finally:
        gateway.stop()


def test_a_model_layout_of_its_own_round_trips_and_its_sizes_are_enforced(
    running: RunningService,
) -> None:
    """Block sizes belong to a model layout (the ``Layout`` message), not to the tier: a client
    made with a layout puts, finds and reads its blocks and states; its keys are not the tier's
    own; a payload or state of another size, or a malformed layout, is INVALID_ARGUMENT."""
    layout = Layout(b"another-model".ljust(32, b"."), block_bytes=3000, state_bytes=500)
    tokens = np.random.default_rng(11).integers(0, 10_000, 3 * 128 + 1)
    keys = [bytes(k) for k in block_keys(layout.fingerprint, tokens)]
    with KVStoreClient(running.address, token=TOKEN, layout=layout) as mine:
        assert mine.put_blocks(keys, [bytes([7]) * 3000] * 3).committed == 3
        mine.put_swa_state(keys[2], 384, bytes([9]) * 500)
        answer = mine.query_hit(HitRequest(token_ids=tokens, mode="exact-window", take_lease=True))
        assert answer.plan.hit_tokens == 384 and answer.swa_owner is not None
        reads = mine.get_blocks(list(answer.hit_block_keys), lease_id=answer.lease_id)
        assert [r.payload for r in reads] == [bytes([7]) * 3000] * 3
        assert mine.get_swa_state(keys[2], 384).state == bytes([9]) * 500
        for call in (
            lambda: mine.put_blocks(keys[:1], [bytes(2999)]),
            lambda: mine.put_swa_state(keys[1], 256, bytes(501)),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with KVStoreClient(running.address, token=TOKEN) as own:  # the tier's own layout
        assert [r.payload for r in own.get_blocks(keys)] == [None] * 3
    with grpc.insecure_channel(running.address) as channel:
        bad = pb.GetBlocksRequest(keys=keys[:1], layout=pb.Layout(fingerprint=b"x", block_bytes=0))
        with pytest.raises(grpc.RpcError) as caught:
            list(pb_grpc.KVStoreStub(channel).GetBlocks(bad, metadata=AUTH))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "layout.block_bytes" in (caught.value.details() or "")
