"""Hypothesis fuzz of every RPC of the real gateway, in front of a real deployment.

Random and boundary values, wrong sizes, invalid keys, negative lengths, unknown enum values,
unprintable strings, wrong tokens, undecodable bytes and oversized repeated fields: each request
must be answered with a proper status code (never INTERNAL, UNKNOWN, UNAVAILABLE, a timeout or a
dropped connection), answers that are OK must be right (a block read back is the block written,
a key never written is not found), and after some 2,000+ requests the server is alive and
serves correctly."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.api.client import KVStoreClient
from kvstore.api.server import SERVICE_NAME, ServerOptions
from kvstore.api.servicer import MAX_KEYS_PER_REQUEST
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.api.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.runtime.service import RunningService, embedded_service
from kvstore.tier.records import HitRequest

TOKEN = "fuzz-token-0123456789"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
MAX_MESSAGE = 4 * 1024 * 1024
#: Answers a malformed request may get. Anything else is a server bug or a server gone.
PROPER = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
}
EXAMPLES = 300  # per campaign: 7 campaigns + the boundary cases -> 2,100+ requests

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)


class Tally:
    """What the fuzz sent and what it learned (blocks and states that really got stored)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.codes: dict[str, int] = {}
        self.blocks: dict[bytes, bytes] = {}
        self.states: dict[tuple[bytes, int], bytes] = {}  # (key, position) -> state

    def count(self, rpc: str, code: grpc.StatusCode) -> None:
        with self.lock:
            self.requests[rpc] = self.requests.get(rpc, 0) + 1
            self.codes[code.name] = self.codes.get(code.name, 0) + 1


@pytest.fixture(scope="module")
def running(ray_cluster, tmp_path_factory) -> Iterator[RunningService]:  # type: ignore[no-untyped-def]
    with embedded_service(
        tmp_path_factory.mktemp("fuzz-data"),
        cluster=ray_cluster,
        deployment="fuzz",
        fsync="never",
        run_gc=False,
        options=ServerOptions(token=TOKEN, max_message_bytes=MAX_MESSAGE),
    ) as service:
        yield service


@pytest.fixture(scope="module")
def channel(running: RunningService) -> Iterator[grpc.Channel]:
    options = [
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ]
    with grpc.insecure_channel(running.address, options=options) as value:
        yield value


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.KVStoreStub:
    return pb_grpc.KVStoreStub(channel)


@pytest.fixture(scope="module")
def tally() -> Tally:
    return Tally()


def call(tally: Tally, rpc: str, send: Callable[[], Any]) -> tuple[grpc.StatusCode, Any, str]:
    """Send one request; returns (code, reply or None, details). Asserts the code is proper."""
    try:
        reply = send()
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as error:
        reply, code, details = None, error.code(), error.details() or ""
    tally.count(rpc, code)
    assert code in PROPER, f"{rpc} answered {code.name}: {details}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert details and ":" in details, f"{rpc}: INVALID_ARGUMENT must name the field: {details}"
    return code, reply, details


# --- strategies ----------------------------------------------------------------------------

INT64 = st.one_of(
    st.sampled_from(
        [0, -1, 1, 127, 128, 129, 255, 256, 1024, 2**31 - 1, 2**31, 2**63 - 1, -(2**63)]
    ),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
)
KEYS = st.one_of(
    st.binary(min_size=32, max_size=32),
    st.binary(max_size=64),
)
TEXT = st.one_of(
    st.sampled_from(["", "default", "agent", "chatbot", "Agent", " ", "x" * 65, "\x00", "é"]),
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=80),
)
METADATA = st.sampled_from([AUTH] * 9 + [(), (("authorization", "Bearer wrong"),)])


def authorized(metadata: Any) -> bool:
    return metadata == AUTH


def expect_unauthenticated(metadata: Any, code: grpc.StatusCode) -> None:
    if not authorized(metadata):
        assert code == grpc.StatusCode.UNAUTHENTICATED
    else:
        assert code != grpc.StatusCode.UNAUTHENTICATED


# --- one campaign per RPC ------------------------------------------------------------------


def test_fuzz_query_hit(stub: pb_grpc.KVStoreStub, tally: Tally) -> None:
    @FUZZ
    @given(
        tokens=st.one_of(st.just([]), st.lists(st.integers(0, 2**32 - 1), max_size=3000)),
        keys=st.lists(KEYS, max_size=40),
        prompt_len=INT64,
        mode=st.one_of(st.sampled_from([0, 1, 2, 3, -1]), st.integers(-(2**31), 2**31 - 1)),
        traffic_class=TEXT,
        take_lease=st.booleans(),
        metadata=METADATA,
    )
    def campaign(tokens, keys, prompt_len, mode, traffic_class, take_lease, metadata) -> None:  # type: ignore[no-untyped-def]
        request = pb.QueryHitRequest(
            token_ids=tokens,
            block_keys=keys,
            prompt_len=prompt_len,
            mode=mode,
            traffic_class=traffic_class,
            take_lease=take_lease,
        )
        code, reply, _ = call(
            tally, "QueryHit", lambda: stub.QueryHit(request, metadata=metadata, timeout=60)
        )
        expect_unauthenticated(metadata, code)
        if reply is not None:
            plan = reply.plan
            assert 0 <= plan.hit_tokens <= plan.prompt_len
            assert plan.block_hit_tokens <= plan.cap <= plan.prompt_len
            assert len(reply.hit_block_keys) * 128 == plan.block_hit_tokens
            if keys:
                assert list(reply.hit_block_keys) == list(keys[: len(reply.hit_block_keys)])
            if reply.lease_id:
                call(
                    tally,
                    "ReleaseLease",
                    lambda: stub.ReleaseLease(
                        pb.ReleaseLeaseRequest(lease_id=reply.lease_id), metadata=AUTH, timeout=60
                    ),
                )

    campaign()
    assert tally.requests["QueryHit"] >= EXAMPLES


def test_fuzz_put_blocks(stub: pb_grpc.KVStoreStub, running: RunningService, tally: Tally) -> None:
    # A payload is exactly one block or refused: mostly whole blocks (each a different one),
    # sometimes a wrong size.
    size = running.tier.block_bytes
    whole = [np.random.default_rng(i).bytes(size) for i in range(8)]
    block = st.builds(
        lambda key, payload: pb.Block(key=key, payload=payload),
        KEYS,
        st.one_of(
            st.sampled_from(whole),
            st.binary(max_size=300),
            st.sampled_from([size - 1, size + 1]).map(bytes),
        ),
    )
    message = st.builds(
        lambda blocks, cls: pb.PutBlocksRequest(blocks=blocks, traffic_class=cls),
        st.lists(block, max_size=4),
        TEXT,
    )

    @FUZZ
    @given(messages=st.lists(message, max_size=3), metadata=METADATA)
    def campaign(messages, metadata) -> None:  # type: ignore[no-untyped-def]
        code, reply, _ = call(
            tally,
            "PutBlocks",
            lambda: stub.PutBlocks(iter(messages), metadata=metadata, timeout=60),
        )
        expect_unauthenticated(metadata, code)
        if reply is None:
            return
        sent = [b for m in messages for b in m.blocks]
        assert sent, "an empty put must be refused"
        assert all(len(b.key) == 32 and len(b.payload) == size for b in sent)
        assert len({b.key for b in sent}) == len(sent), "a put repeating a key must be refused"
        failed = set(reply.failed_keys)
        assert reply.committed + len(failed) == len(sent)
        with tally.lock:
            for b in sent:
                if b.key not in failed:
                    tally.blocks.setdefault(b.key, b.payload)  # a re-put never rewrites

    campaign()
    assert tally.requests["PutBlocks"] >= EXAMPLES


def test_fuzz_get_blocks(stub: pb_grpc.KVStoreStub, tally: Tally) -> None:
    @FUZZ
    @given(
        keys=st.lists(KEYS, max_size=30),
        known=st.integers(0, 5),
        lease_id=TEXT,
        metadata=METADATA,
    )
    def campaign(keys, known, lease_id, metadata) -> None:  # type: ignore[no-untyped-def]
        with tally.lock:
            stored = list(tally.blocks)[:known]
        keys = stored + keys
        request = pb.GetBlocksRequest(keys=keys, lease_id=lease_id)
        code, replies, _ = call(
            tally,
            "GetBlocks",
            lambda: list(stub.GetBlocks(request, metadata=metadata, timeout=60)),
        )
        expect_unauthenticated(metadata, code)
        if replies is None:
            return
        # One answer per distinct key, in the order the keys are first given.
        assert [r.key for r in replies] == list(dict.fromkeys(keys))
        for reply in replies:
            expected = tally.blocks.get(reply.key)
            if expected is None:
                assert not reply.found, "a key nobody wrote was found"
            else:
                assert reply.found and reply.payload == expected, "a stored block read wrong"

    campaign()
    assert tally.requests["GetBlocks"] >= EXAMPLES


def test_fuzz_put_swa_state(
    stub: pb_grpc.KVStoreStub, running: RunningService, tally: Tally
) -> None:
    size = running.tier.state_size
    machines = sorted(running.service.swa.stores)
    state = st.one_of(
        st.binary(max_size=256),
        st.sampled_from([size - 1, size + 1, 1, 0]).map(bytes),
        # The exact size, rarely (each one really takes 1.4 MB of a store).
        st.integers(0, 2**32)
        .filter(lambda seed: seed % 25 == 0)
        .map(lambda seed: np.random.default_rng(seed).bytes(size)),
    )

    @FUZZ
    @given(
        key=KEYS,
        position=st.one_of(INT64, st.integers(1, 64).map(lambda n: 128 * n)),
        state=state,
        machine=st.one_of(TEXT, st.sampled_from(machines)),
        metadata=METADATA,
    )
    def campaign(key, position, state, machine, metadata) -> None:  # type: ignore[no-untyped-def]
        request = pb.PutSWAStateRequest(key=key, position=position, state=state, machine=machine)
        code, reply, _ = call(
            tally,
            "PutSWAState",
            lambda: stub.PutSWAState(request, metadata=metadata, timeout=60),
        )
        expect_unauthenticated(metadata, code)
        if reply is not None:
            assert len(state) == size and len(key) == 32 and position > 0 and position % 128 == 0
            assert reply.owner in machines
            with tally.lock:
                tally.states[(key, position)] = state

    campaign()
    assert tally.requests["PutSWAState"] >= EXAMPLES


def test_fuzz_get_swa_state(stub: pb_grpc.KVStoreStub, tally: Tally) -> None:
    @FUZZ
    @given(key=KEYS, position=INT64, use_known=st.booleans(), metadata=METADATA)
    def campaign(key, position, use_known, metadata) -> None:  # type: ignore[no-untyped-def]
        with tally.lock:
            if use_known and tally.states:
                key, position = next(iter(tally.states))
        request = pb.GetSWAStateRequest(key=key, position=position)
        code, reply, _ = call(
            tally,
            "GetSWAState",
            lambda: stub.GetSWAState(request, metadata=metadata, timeout=60),
        )
        expect_unauthenticated(metadata, code)
        if reply is not None:
            # A state is found only at the position it was stored at.
            expected = tally.states.get((key, position))
            assert reply.found == (expected is not None), "a stored state missed, or a ghost"
            if expected is not None:
                assert reply.state == expected, "an SWA state read wrong"

    campaign()
    assert tally.requests["GetSWAState"] >= EXAMPLES


def test_fuzz_release_lease_and_stats(stub: pb_grpc.KVStoreStub, tally: Tally) -> None:
    @FUZZ
    @given(lease_id=TEXT, stats=st.booleans(), metadata=METADATA)
    def campaign(lease_id, stats, metadata) -> None:  # type: ignore[no-untyped-def]
        if stats:
            code, reply, _ = call(
                tally,
                "GetStats",
                lambda: stub.GetStats(pb.GetStatsRequest(), metadata=metadata, timeout=60),
            )
            if reply is not None:
                assert reply.storage_nodes >= 12
        else:
            code, reply, _ = call(
                tally,
                "ReleaseLease",
                lambda: stub.ReleaseLease(
                    pb.ReleaseLeaseRequest(lease_id=lease_id), metadata=metadata, timeout=60
                ),
            )
            if reply is not None:
                assert reply.released is False  # nobody holds a lease of that name
        expect_unauthenticated(metadata, code)

    campaign()
    assert tally.requests.get("GetStats", 0) + tally.requests.get("ReleaseLease", 0) >= EXAMPLES


_METHODS = ["QueryHit", "PutBlocks", "GetBlocks", "PutSWAState", "GetSWAState", "ReleaseLease"]


def test_fuzz_raw_bytes_on_the_wire(channel: grpc.Channel, tally: Tally) -> None:
    """Bytes that may not even be a protobuf message: the server answers and stays up. Bytes
    that do not decode are INVALID_ARGUMENT naming the message type (the gateway parses requests
    itself for that; plain grpc.aio would answer UNKNOWN); bytes that decode are held to the
    same codes as every request."""
    requests = {
        "QueryHit": pb.QueryHitRequest,
        "PutBlocks": pb.PutBlocksRequest,
        "GetBlocks": pb.GetBlocksRequest,
        "PutSWAState": pb.PutSWAStateRequest,
        "GetSWAState": pb.GetSWAStateRequest,
        "ReleaseLease": pb.ReleaseLeaseRequest,
    }

    @FUZZ
    @given(method=st.sampled_from(_METHODS), raw=st.binary(max_size=300))
    def campaign(method, raw) -> None:  # type: ignore[no-untyped-def]
        path = f"/{SERVICE_NAME}/{method}"
        try:
            requests[method].FromString(raw)
            decodes = True
        except Exception:  # noqa: BLE001  (DecodeError and friends)
            decodes = False
        try:
            if method == "PutBlocks":
                send = channel.stream_unary(path)
                send(iter([raw]), metadata=AUTH, timeout=60)
            elif method == "GetBlocks":
                list(channel.unary_stream(path)(raw, metadata=AUTH, timeout=60))
            else:
                channel.unary_unary(path)(raw, metadata=AUTH, timeout=60)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as error:
            code, details = error.code(), error.details() or ""
        tally.count("raw:" + method, code)
        allowed = PROPER if decodes else {grpc.StatusCode.INVALID_ARGUMENT}
        assert code in allowed, f"{method} answered {code.name} to {raw!r}: {details}"
        if not decodes:
            assert "not a valid kvstore.v1." in details

    campaign()
    assert sum(v for k, v in tally.requests.items() if k.startswith("raw:")) >= EXAMPLES


def test_huge_repeated_fields_and_oversized_messages(
    stub: pb_grpc.KVStoreStub, running: RunningService, tally: Tally
) -> None:
    too_many = [bytes(32)] * (MAX_KEYS_PER_REQUEST + 1)
    code, _, details = call(
        tally,
        "GetBlocks",
        lambda: list(stub.GetBlocks(pb.GetBlocksRequest(keys=too_many), metadata=AUTH)),
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "keys" in details
    code, _, details = call(
        tally,
        "QueryHit",
        lambda: stub.QueryHit(
            pb.QueryHitRequest(block_keys=too_many, prompt_len=2**40), metadata=AUTH
        ),
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "block_keys" in details
    # Bigger than the server's message limit: refused before any kvstore code runs.
    code, _, _ = call(
        tally,
        "QueryHit",
        lambda: stub.QueryHit(
            pb.QueryHitRequest(token_ids=[2**32 - 1] * (MAX_MESSAGE // 4)), metadata=AUTH
        ),
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    code, _, _ = call(
        tally,
        "PutSWAState",
        lambda: stub.PutSWAState(
            pb.PutSWAStateRequest(key=bytes(32), position=128, state=bytes(MAX_MESSAGE + 1)),
            metadata=AUTH,
        ),
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # A stream of messages adding up past the per-stream byte limit (64 MiB).
    size = running.tier.block_bytes
    payload = bytes(size)
    per_message = (2 << 20) // size  # well inside this server's 4 MiB message limit
    messages = (
        pb.PutBlocksRequest(
            blocks=[
                pb.Block(key=(m * per_message + i).to_bytes(32, "big"), payload=payload)
                for i in range(per_message)
            ]
        )
        for m in range((64 << 20) // (per_message * size) + 2)
    )
    code, _, details = call(
        tally, "PutBlocks", lambda: stub.PutBlocks(messages, metadata=AUTH, timeout=120)
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "payload bytes" in details


def test_the_server_is_alive_and_correct_after_the_fuzz(
    running: RunningService, tally: Tally, record_property: Callable[[str, object], None]
) -> None:
    sent = sum(tally.requests.values())
    record_property("fuzz_requests", sent)
    record_property("fuzz_status_codes", dict(tally.codes))
    assert sent >= 2_000, f"only {sent} fuzz requests were sent"
    assert set(tally.codes) <= {code.name for code in PROPER}
    with KVStoreClient(running.address, token=TOKEN) as client:
        assert client.serving()
        rng = np.random.default_rng(7)
        keys = [rng.bytes(32) for _ in range(6)]
        payloads = [rng.bytes(running.tier.block_bytes) for _ in keys]
        put = client.put_blocks(keys, payloads, "agent")
        assert put.committed == 6 and not put.failed_keys
        reads = client.get_blocks(keys)
        assert [r.payload for r in reads] == payloads
        answer = client.query_hit(
            HitRequest(block_keys=keys, prompt_len=6 * 128 + 300, take_lease=True)
        )
        assert answer.plan.block_hit_tokens == 6 * 128
        assert client.release_lease(answer.lease_id or "") is True
        # Everything the fuzz stored is still exactly there.
        fuzz_keys = list(tally.blocks)[:200]
        if fuzz_keys:
            reads = client.get_blocks(fuzz_keys)
            assert [r.payload for r in reads] == [tally.blocks[k] for k in fuzz_keys]
        assert client.stats().storage_nodes >= 12
