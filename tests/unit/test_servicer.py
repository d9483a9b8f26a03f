"""The gRPC servicer without Ray: a real ``grpc.aio`` server on port 0 in front of (1) a scripted
tier that records what it was asked and raises on demand — every RPC, every status code — and
(2) the real facade with every part in this process (``tier_parts``)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import pytest
from tier_parts import GEOMETRY, InProcessTier

import kvstore.api.servicer as servicer_module
from kvstore.api.client import KVStoreClient
from kvstore.api.gateway import Gateway
from kvstore.api.server import ServerOptions
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.api.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import InvalidArgument, LeaseError, Overloaded, StoreError
from kvstore.hitplan import plan_hit
from kvstore.keys import BlockKey, block_keys, key_words, words_to_keys
from kvstore.tenants import namespaced
from kvstore.tier.counters import HitCounters
from kvstore.tier.records import (
    BlockRead,
    HitAnswer,
    HitRequest,
    LeaseTag,
    PutAnswer,
    StateRead,
    Stats,
)

FINGERPRINT = GEOMETRY.fingerprint()
STATE = GEOMETRY.state_size_to_disk
TOKEN = "unit-token-0123456789"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


@dataclass
class ScriptedTier:
    """A ``Tier`` that answers from a script: ``raises[method]`` is raised by that method,
    ``block`` (when set) holds every call until it is set."""

    model_fingerprint: bytes = FINGERPRINT
    state_size: int = STATE
    block_bytes: int = 10
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    raises: dict[str, BaseException] = field(default_factory=dict)
    gate: threading.Event | None = None

    def _enter(self, method: str, **args: Any) -> None:
        self.calls.append((method, args))
        if self.gate is not None:
            self.gate.wait(30)
        if method in self.raises:
            raise self.raises[method]

    #: The tier's one lease table, as far as a script needs it: lease id → holder.
    held: dict[str, LeaseTag] = field(default_factory=dict)
    hit_counters: HitCounters = field(default_factory=HitCounters)

    def lease_tag(self, lease_id: str) -> LeaseTag | None:
        return self.held.get(lease_id)

    def open_leases(self, tenant: str) -> int:
        return sum(tag.tenant == tenant for tag in self.held.values())

    def query_hit(self, request: HitRequest) -> HitAnswer:
        args = dict(request.__dict__)
        self._enter("query_hit", **args)
        if request.take_lease:
            self.held["lease-1"] = request.holder
        keys = key_words(args["block_keys"])
        plan = plan_hit(args["prompt_len"], [True] * len(keys), None, mode=args["mode"])
        hit = plan.hit_tokens // 128
        return HitAnswer(plan, "m1", "replay", 0.25, 0.125, "lease-1", keys[:hit])

    def release_lease(self, lease_id: str) -> bool:
        self._enter("release_lease", lease_id=lease_id)
        return lease_id == "lease-1"

    def get_blocks(
        self, keys: Sequence[bytes], lease_id: str | None = None, *, keep_lease: bool = False
    ) -> list[BlockRead]:
        self._enter("get_blocks", keys=list(keys), lease_id=lease_id)
        return [
            BlockRead(BlockKey(key), b"payload-%d" % i, degraded=i == 1)
            if i < 2
            else BlockRead(BlockKey(key), None, miss_reason="evicted")
            for i, key in enumerate(keys)
        ]

    def get_swa_state(
        self, key: bytes, position: int, *, state_bytes: int | None = None
    ) -> StateRead:
        self._enter("get_swa_state", key=key, position=position)
        if position == 128:
            return StateRead(b"s" * STATE, owner="m2")
        return StateRead(None, miss_reason="not_in_directory_or_owner_lost")

    def put_blocks(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[bytes],
        traffic_class: str = "",
    ) -> PutAnswer:
        self._enter("put_blocks", keys=list(keys), payloads=list(payloads), cls=traffic_class)
        return PutAnswer(
            stored=len(keys) - 3, existing=1, busy_keys=(keys[-2],), failed_keys=(keys[-1],)
        )

    def put_swa_state(
        self,
        key: bytes,
        position: int,
        state: bytes,
        machine: str | None = None,
        *,
        state_bytes: int | None = None,
        owner: str = "",
    ) -> str:
        self._enter("put_swa_state", key=key, position=position, machine=machine)
        return machine or "m0"

    #: IP address → machine (``machine_at``): none known unless a test says so.
    addresses: dict[str, str] = field(default_factory=dict)

    def machine_at(self, address: str) -> str | None:
        return self.addresses.get(address)

    def stats(self) -> Stats:
        self._enter("stats")
        return Stats(
            classes={"agent": {"lookups": 3, "hit_blocks": 5, "miss_reasons": {"evicted": 2}}},
            block_bytes_stored=1000,
            storage_nodes=12,
            live_storage_nodes=11,
            extra={"model_fingerprint": FINGERPRINT.hex()},
        )


@pytest.fixture()
def scripted() -> Iterator[tuple[ScriptedTier, pb_grpc.KVStoreStub, Gateway]]:
    tier = ScriptedTier()
    gateway = Gateway(tier, ServerOptions(token=TOKEN, max_in_flight=4, worker_threads=4))  # type: ignore[arg-type]
    try:
        with grpc.insecure_channel(gateway.address) as channel:
            yield tier, pb_grpc.KVStoreStub(channel), gateway
    finally:
        gateway.stop()


def stored(gateway: Gateway, keys: Sequence[bytes]) -> list[bytes]:
    """The keys as the tier sees them: in the (only) tenant's namespace."""
    salt = gateway.tenants.default().salt
    return [bytes(k) for k in words_to_keys(namespaced(salt, key_words(list(keys))))]


def code_of(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code()


def keys_of(n: int) -> list[bytes]:
    return [bytes([i]) * 32 for i in range(n)]


# --- every RPC, translated both ways ---------------------------------------------------------


def test_query_hit_takes_each_key_form_and_answers_in_it(scripted) -> None:  # type: ignore[no-untyped-def]
    tier, stub, gateway = scripted
    tokens = np.arange(5 * 128 + 140, dtype=np.uint32)
    expected = block_keys(FINGERPRINT, tokens)
    reply = stub.QueryHit(
        pb.QueryHitRequest(
            token_ids=tokens.tolist(),
            mode=pb.HIT_MODE_BOUNDED_REPLAY,
            traffic_class="agent",
            take_lease=True,
        ),
        metadata=AUTH,
    )
    method, args = tier.calls[-1]
    assert method == "query_hit" and args["prompt_len"] == tokens.size
    assert args["mode"] == "bounded-replay" and args["traffic_class"] == "agent"
    assert args["take_lease"] is True
    # Hashed by the server, then namespaced: the tier never sees the keys a client computes.
    assert key_words(args["block_keys"]).tobytes() == b"".join(stored(gateway, expected))
    assert reply.plan.hit_tokens == 640 and reply.plan.swa_owner == "m1"
    assert reply.advice == pb.ADVICE_REPLAY and reply.lease_id == "lease-1"
    assert (reply.fetch_seconds, reply.replay_seconds) == (0.25, 0.125)
    assert list(reply.hit_block_keys) == expected[:5] and not reply.hit_block_keys_packed
    assert reply.plan.store_at == 768 and reply.plan.replay_start == 512

    keys = keys_of(6)
    packed = stub.QueryHit(
        pb.QueryHitRequest(block_keys_packed=b"".join(keys), prompt_len=6 * 128 + 140),
        metadata=AUTH,
    )
    one_by_one = stub.QueryHit(
        pb.QueryHitRequest(block_keys=keys, prompt_len=6 * 128 + 140), metadata=AUTH
    )
    assert tier.calls[-1][1]["mode"] == "standard" and tier.calls[-1][1]["traffic_class"] == ""
    assert packed.plan == one_by_one.plan
    assert packed.hit_block_keys_packed == b"".join(keys[:5]) and not packed.hit_block_keys
    assert list(one_by_one.hit_block_keys) == keys[:5]


def test_put_blocks_streams_and_answers_every_outcome(scripted) -> None:  # type: ignore[no-untyped-def]
    tier, stub, gateway = scripted
    keys = keys_of(6)
    messages = [
        pb.PutBlocksRequest(
            blocks=[pb.Block(key=k, payload=b"x" * 10) for k in keys[:4]], traffic_class="chatbot"
        ),
        pb.PutBlocksRequest(blocks=[pb.Block(key=k, payload=b"y" * 10) for k in keys[4:]]),
    ]
    reply = stub.PutBlocks(iter(messages), metadata=AUTH)
    method, args = tier.calls[-1]
    assert args["keys"] == stored(gateway, keys)
    assert method == "put_blocks" and args["cls"] == "chatbot"
    assert args["payloads"] == [b"x" * 10] * 4 + [b"y" * 10] * 2
    assert (reply.committed, reply.existing) == (4, 1)
    assert list(reply.busy_keys) == [keys[4]] and list(reply.failed_keys) == [keys[5]]
    with KVStoreClient(_address(scripted), token=TOKEN) as client:
        answer = client.put_blocks(keys, [b"z" * 10] * 6)
    assert (answer.stored, answer.existing, answer.committed) == (3, 1, 4)
    assert answer.busy_keys == (keys[4],) and answer.failed_keys == (keys[5],)


def test_get_blocks_streams_reads_in_order(scripted) -> None:  # type: ignore[no-untyped-def]
    tier, stub, gateway = scripted
    keys = keys_of(3)
    taken = stub.QueryHit(pb.QueryHitRequest(token_ids=[1], take_lease=True), metadata=AUTH)
    assert taken.lease_id == "lease-1"
    replies = list(
        stub.GetBlocks(pb.GetBlocksRequest(keys=keys, lease_id="lease-1"), metadata=AUTH)
    )
    assert tier.calls[-2] == ("get_blocks", {"keys": stored(gateway, keys), "lease_id": "lease-1"})
    assert tier.calls[-1] == ("release_lease", {"lease_id": "lease-1"})  # once the stream ended
    assert [r.key for r in replies] == keys
    assert [r.found for r in replies] == [True, True, False]
    assert [r.degraded for r in replies] == [False, True, False]
    assert replies[0].payload == b"payload-0" and replies[2].miss_reason == "evicted"
    list(stub.GetBlocks(pb.GetBlocksRequest(keys=keys[:1]), metadata=AUTH))
    assert tier.calls[-1][1]["lease_id"] is None  # "" on the wire: no lease


def test_swa_states_lease_release_and_stats(scripted) -> None:  # type: ignore[no-untyped-def]
    tier, stub, _ = scripted
    key = bytes(32)
    put = stub.PutSWAState(
        pb.PutSWAStateRequest(key=key, position=256, state=b"s" * STATE, machine="m2"),
        metadata=AUTH,
    )
    assert put.owner == "m2" and tier.calls[-1][1]["machine"] == "m2"
    stub.PutSWAState(
        pb.PutSWAStateRequest(key=key, position=256, state=b"s" * STATE), metadata=AUTH
    )
    assert tier.calls[-1][1]["machine"] is None
    # A put that names no machine, from one of the tier's machines: kept on that machine.
    tier.addresses = {"127.0.0.1": "m7"}
    stub.PutSWAState(
        pb.PutSWAStateRequest(key=key, position=256, state=b"s" * STATE), metadata=AUTH
    )
    assert tier.calls[-1][1]["machine"] == "m7"
    found = stub.GetSWAState(pb.GetSWAStateRequest(key=key, position=128), metadata=AUTH)
    assert found.found and found.owner == "m2" and len(found.state) == STATE
    missing = stub.GetSWAState(pb.GetSWAStateRequest(key=key, position=256), metadata=AUTH)
    assert not missing.found and missing.miss_reason == "not_in_directory_or_owner_lost"
    # Only a lease this tenant took is released.
    assert not stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id="lease-1"), metadata=AUTH).released
    stub.QueryHit(pb.QueryHitRequest(token_ids=[1], take_lease=True), metadata=AUTH)
    assert stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id="lease-1"), metadata=AUTH).released
    assert not stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id="x"), metadata=AUTH).released
    stats = stub.GetStats(pb.GetStatsRequest(), metadata=AUTH)
    assert (stats.block_bytes_stored, stats.storage_nodes, stats.live_storage_nodes) == (
        1000,
        12,
        11,
    )
    (agent,) = stats.classes
    assert (agent.traffic_class, agent.lookups, agent.hit_blocks) == ("agent", 3, 5)
    assert dict(agent.miss_reasons) == {"evicted": 2}
    assert json.loads(stats.json)["model_fingerprint"] == FINGERPRINT.hex()


# --- every status code ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_, field",
    [
        (pb.QueryHitRequest(token_ids=[1], block_keys=[bytes(32)]), "token_ids"),
        (pb.QueryHitRequest(block_keys=[bytes(31)], prompt_len=500), r"block_keys\[0\]"),
        (pb.QueryHitRequest(block_keys_packed=bytes(33), prompt_len=500), "block_keys_packed"),
        (pb.QueryHitRequest(block_keys=[bytes(32)] * 2, prompt_len=200), "prompt_len"),
        (pb.QueryHitRequest(token_ids=[1, 2], prompt_len=3), "prompt_len"),
        (pb.QueryHitRequest(token_ids=[1], prompt_len=-1), "prompt_len"),
        (pb.QueryHitRequest(token_ids=[1], mode=7), "mode"),
        (pb.QueryHitRequest(token_ids=[1], traffic_class="x" * 65), "traffic_class"),
        (pb.QueryHitRequest(token_ids=[1], traffic_class="a\nb"), "traffic_class"),
    ],
)
def test_malformed_query_hits_are_invalid_argument_naming_the_field(
    scripted, request_: Any, field: str
) -> None:  # type: ignore[no-untyped-def]
    tier, stub, _ = scripted
    with pytest.raises(grpc.RpcError) as error:
        stub.QueryHit(request_, metadata=AUTH)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    import re

    assert re.search(field, error.value.details() or "")
    assert not tier.calls  # refused before the tier was asked anything


def test_malformed_writes_are_invalid_argument(scripted) -> None:  # type: ignore[no-untyped-def]
    tier, stub, _ = scripted
    cases = [
        lambda: stub.PutBlocks(iter([]), metadata=AUTH),
        lambda: stub.PutBlocks(
            iter([pb.PutBlocksRequest(blocks=[pb.Block(key=bytes(3), payload=b"x")])]),
            metadata=AUTH,
        ),
        lambda: stub.PutBlocks(
            iter([pb.PutBlocksRequest(blocks=[pb.Block(key=bytes(32), payload=b"")])]),
            metadata=AUTH,
        ),
        lambda: stub.PutSWAState(
            pb.PutSWAStateRequest(key=bytes(32), position=128, state=b"s"), metadata=AUTH
        ),
        lambda: stub.PutSWAState(
            pb.PutSWAStateRequest(key=bytes(5), position=128, state=b"s" * STATE), metadata=AUTH
        ),
        lambda: stub.GetSWAState(pb.GetSWAStateRequest(key=bytes(5)), metadata=AUTH),
        lambda: list(stub.GetBlocks(pb.GetBlocksRequest(keys=[bytes(7)]), metadata=AUTH)),
        lambda: stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=""), metadata=AUTH),
        lambda: stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id="l" * 129), metadata=AUTH),
    ]
    for case in cases:
        assert code_of(case) == grpc.StatusCode.INVALID_ARGUMENT
    assert not tier.calls


@pytest.mark.parametrize(
    "error, status",
    [
        (InvalidArgument("traffic_class", "unknown class 'x'"), grpc.StatusCode.INVALID_ARGUMENT),
        (LeaseError("lease 'l' is unknown"), grpc.StatusCode.NOT_FOUND),
        (Overloaded("too many"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (StoreError("meta shards unreachable"), grpc.StatusCode.UNAVAILABLE),
        (RuntimeError("a bug"), grpc.StatusCode.INTERNAL),
    ],
)
def test_tier_errors_map_to_status_codes_and_the_server_keeps_serving(
    scripted, error: BaseException, status: grpc.StatusCode
) -> None:  # type: ignore[no-untyped-def]
    tier, stub, _ = scripted
    for method in (
        "query_hit",
        "get_blocks",
        "put_blocks",
        "put_swa_state",
        "get_swa_state",
        "release_lease",
        "stats",
    ):
        tier.raises[method] = error
    calls = [
        lambda: stub.QueryHit(pb.QueryHitRequest(token_ids=[1, 2]), metadata=AUTH),
        lambda: list(stub.GetBlocks(pb.GetBlocksRequest(keys=[bytes(32)]), metadata=AUTH)),
        lambda: stub.PutBlocks(
            iter(
                [
                    pb.PutBlocksRequest(
                        blocks=[pb.Block(key=k, payload=b"p" * 10) for k in keys_of(3)]
                    )
                ]
            ),
            metadata=AUTH,
        ),
        lambda: stub.PutSWAState(
            pb.PutSWAStateRequest(key=bytes(32), position=128, state=b"s" * STATE), metadata=AUTH
        ),
        lambda: stub.GetSWAState(pb.GetSWAStateRequest(key=bytes(32), position=128), metadata=AUTH),
        lambda: stub.GetStats(pb.GetStatsRequest(), metadata=AUTH),
    ]
    # (ReleaseLease reaches the tier only for a lease this tenant holds: none here.)
    for call in calls:
        assert code_of(call) == status
    tier.raises.clear()
    assert stub.GetStats(pb.GetStatsRequest(), metadata=AUTH).storage_nodes == 12


def test_a_full_gateway_refuses_with_resource_exhausted(scripted) -> None:  # type: ignore[no-untyped-def]
    tier, stub, _ = scripted
    tier.gate = threading.Event()  # every tier call now waits
    asked = pb.QueryHitRequest(token_ids=list(range(300)), take_lease=False)
    futures = [stub.QueryHit.future(asked, metadata=AUTH, timeout=30) for _ in range(4)]
    while len(tier.calls) < 4:  # the 4 admitted calls are in the tier
        threading.Event().wait(0.01)
    assert code_of(lambda: stub.GetStats(pb.GetStatsRequest(), metadata=AUTH, timeout=30)) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    tier.gate.set()
    assert all(future.result().plan.prompt_len == 300 for future in futures)


def test_missing_token_and_undecodable_bytes(scripted) -> None:  # type: ignore[no-untyped-def]
    tier, stub, gateway = scripted
    assert code_of(lambda: stub.GetStats(pb.GetStatsRequest())) == grpc.StatusCode.UNAUTHENTICATED
    wrong = (("authorization", "Bearer nope"),)
    assert code_of(lambda: stub.GetStats(pb.GetStatsRequest(), metadata=wrong)) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    with grpc.insecure_channel(gateway.address) as channel:
        raw = channel.unary_unary("/kvstore.v1.KVStore/QueryHit")
        with pytest.raises(grpc.RpcError) as error:
            raw(b"\xff\xff\xff", metadata=AUTH, timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "QueryHitRequest" in (error.value.details() or "")
    assert not tier.calls


def _address(scripted: tuple[ScriptedTier, pb_grpc.KVStoreStub, Gateway]) -> str:
    return scripted[2].address


# --- the real facade behind the servicer, still without Ray -----------------------------------


def test_the_servicer_in_front_of_the_in_process_cluster(tmp_path) -> None:  # type: ignore[no-untyped-def]
    parts = InProcessTier(tmp_path, release_batch_s=0)
    gateway = Gateway(parts.tier, ServerOptions())
    try:
        with KVStoreClient(gateway.address) as client:
            tokens = np.random.default_rng(4).integers(0, 100_000, 6 * 128 + 150)
            keys = block_keys(FINGERPRINT, tokens)[:6]  # 7 full blocks; 6 inside the cap
            payloads = [bytes([i]) * GEOMETRY.block_bytes for i in range(6)]
            assert client.put_blocks(keys, payloads, "agent").stored == 6
            answer = client.query_hit(HitRequest(token_ids=tokens, traffic_class="agent"))
            # L = 918: cap 784 → L1 = 768; no state at L1 → hit 640, five blocks to load.
            assert (answer.plan.block_hit_tokens, answer.plan.hit_tokens) == (768, 640)
            assert list(answer.hit_block_keys) == keys[:5] and answer.lease_id
            reads = client.get_blocks(list(answer.hit_block_keys), answer.lease_id)
            assert [r.payload for r in reads] == payloads[:5]
            owner = client.put_swa_state(keys[5], 768, b"\x07" * STATE)
            assert owner == "m0"  # the facade's local machine
            again = client.query_hit(
                HitRequest(token_ids=tokens, traffic_class="agent", take_lease=False)
            )
            assert again.plan.hit_tokens == 768 and again.swa_owner == "m0"
            assert client.get_swa_state(keys[5], 768).state == b"\x07" * STATE
            stats = client.stats()
            assert stats.classes["agent"]["lookups"] == 2 and stats.extra["open_leases"] == 0
    finally:
        gateway.stop()


@pytest.mark.parametrize(
    ("peer", "host"),
    [("ipv4:198.19.128.5:40211", "198.19.128.5"), ("ipv6:[::1]:5000", "::1"), ("unix:/x", "")],
)
def test_the_peers_host_is_read_from_grpcs_peer_string(peer: str, host: str) -> None:
    assert servicer_module._peer_host(peer) == host


def test_get_stats_asks_the_tier_once_a_second_however_often_a_tenant_polls(scripted) -> None:  # type: ignore[no-untyped-def]
    tier, stub, _ = scripted
    started = time.monotonic()
    for _ in range(20):
        assert stub.GetStats(pb.GetStatsRequest(), metadata=AUTH, timeout=30).storage_nodes == 12
    asked = sum(method == "stats" for method, _ in tier.calls)
    assert asked <= 1 + int(time.monotonic() - started), asked  # not one fan-out per call
