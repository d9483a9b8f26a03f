"""Python gRPC client of kvstore: the tier seam (``kvstore.tier.protocols.Tier``) over gRPC.

    with KVStoreClient("127.0.0.1:50051") as client:
        answer = client.query_hit(token_ids=prompt, traffic_class="chatbot")
        reads = client.get_blocks(list(answer.hit_block_keys), lease_id=answer.lease_id)

Answers are the seam's records (``kvstore.tier.records``), the same an in-cluster caller of
``ClusterTier`` gets. A gRPC error is raised as ``grpc.RpcError`` with the server's status code
and message (which names the field).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import numpy as np

from kvstore.api.server import DEFAULT_MAX_MESSAGE_BYTES
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.api.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import InvalidArgument
from kvstore.hitplan import HitPlan
from kvstore.keys import KEY_BYTES, BlockKey, key_words
from kvstore.tier.records import (
    BlockRead,
    DirectGrant,
    HitAnswer,
    HitRequest,
    Layout,
    PutAnswer,
    StateRead,
    Stats,
)

log = logging.getLogger(__name__)

_MODES = {
    "standard": pb.HIT_MODE_STANDARD,
    "bounded-replay": pb.HIT_MODE_BOUNDED_REPLAY,
    "full-attention": pb.HIT_MODE_FULL_ATTENTION,
    "exact-window": pb.HIT_MODE_EXACT_WINDOW,
}
_ADVICE = {pb.ADVICE_FETCH: "fetch", pb.ADVICE_REPLAY: "replay"}
#: Blocks per PutBlocks stream message: keeps each message far below the size limit.
_PUT_CHUNK_BYTES = 2 * 1024 * 1024
#: Payload bytes per PutBlocks stream (the gateway refuses a stream past 64 MiB): a larger put
#: is several streams, one after the other.
_PUT_STREAM_BYTES = 32 * 1024 * 1024


def _optional(value: int) -> int | None:
    return None if value < 0 else value


def _layout_message(layout: Layout | None) -> Any:
    if layout is None:
        return None
    return pb.Layout(
        fingerprint=layout.fingerprint,
        block_bytes=layout.block_bytes,
        state_bytes=layout.state_bytes,
    )


@dataclass(frozen=True)
class ClientFactory:
    """Builds a ``KVStoreClient`` in another process (an engine's fetcher): picklable, and
    importing it costs only this module."""

    address: str
    token: str | None = None
    tls_root_cert: str | None = None
    tls_client_cert: str | None = None
    tls_client_key: str | None = None
    timeout_s: float = 30.0
    layout: Layout | None = None

    def __call__(self) -> KVStoreClient:
        return KVStoreClient(
            self.address,
            token=self.token,
            tls_root_cert=self.tls_root_cert,
            tls_client_cert=self.tls_client_cert,
            tls_client_key=self.tls_client_key,
            timeout_s=self.timeout_s,
            layout=self.layout,
        )


class KVStoreClient:
    def __init__(
        self,
        address: str,
        token: str | None = None,
        tls_root_cert: Path | str | None = None,
        timeout_s: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        tls_client_cert: Path | str | None = None,
        tls_client_key: Path | str | None = None,
        layout: Layout | None = None,
    ) -> None:
        """``token``: the tenant's bearer token; or, with mutual TLS, ``tls_client_cert`` and
        ``tls_client_key`` (its certificate's common name names the tenant). ``layout``: the
        model layout every request of this client is made under (None: the tier's own)."""
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        if (tls_client_cert is None) != (tls_client_key is None):
            raise InvalidArgument("tls_client_cert", "give the client certificate and key together")
        if tls_client_cert is not None and tls_root_cert is None:
            raise InvalidArgument("tls_client_cert", "a client certificate needs tls_root_cert")
        if tls_root_cert is not None:
            credentials = grpc.ssl_channel_credentials(
                Path(tls_root_cert).read_bytes(),
                private_key=None if tls_client_key is None else Path(tls_client_key).read_bytes(),
                certificate_chain=(
                    None if tls_client_cert is None else Path(tls_client_cert).read_bytes()
                ),
            )
            self._channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = timeout_s
        self.address = address
        self.layout = layout
        self._layout = _layout_message(layout)

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _kw(self) -> dict[str, Any]:
        return {"timeout": self._timeout, "metadata": self._metadata}

    def query_hit(self, hit: HitRequest) -> HitAnswer:
        # Keys go packed (one bytes field): a repeated field of 1,000 keys costs both ends more
        # than the rest of the request.
        request = pb.QueryHitRequest(
            token_ids=[] if hit.token_ids is None else np.asarray(hit.token_ids).tolist(),
            block_keys_packed=b"" if hit.block_keys is None else _packed(hit.block_keys),
            prompt_len=hit.prompt_len,
            mode=_MODES[hit.mode],
            traffic_class=hit.traffic_class,
            take_lease=hit.take_lease,
            layout=self._layout if hit.layout is None else _layout_message(hit.layout),
            direct=hit.direct,
            prefill_tokens_per_s=hit.prefill_tokens_per_s,
        )
        reply = self._stub.QueryHit(request, **self._kw())
        plan = reply.plan
        return HitAnswer(
            plan=HitPlan(
                prompt_len=plan.prompt_len,
                mode=hit.mode,
                cap=plan.cap,
                block_hit_tokens=plan.block_hit_tokens,
                hit_tokens=plan.hit_tokens,
                swa_hit=plan.swa_hit,
                swa_position=_optional(plan.swa_position),
                replay_start=_optional(plan.replay_start),
                replay_tokens=plan.replay_tokens,
                compute_from=plan.compute_from,
                store_at=_optional(plan.store_at),
            ),
            swa_owner=plan.swa_owner or None,
            advice=_ADVICE.get(reply.advice),
            fetch_seconds=reply.fetch_seconds,
            replay_seconds=reply.replay_seconds,
            lease_id=reply.lease_id or None,
            hit_keys=_unpacked(reply.hit_block_keys_packed)
            if reply.hit_block_keys_packed
            else tuple(BlockKey(key) for key in reply.hit_block_keys),
            direct=_direct_grant(reply.direct) if reply.HasField("direct") else None,
            prefill_tokens_per_s=reply.prefill_tokens_per_s,
            stored_blocks=reply.stored_blocks,
        )

    def put_blocks(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[bytes],
        traffic_class: str = "",
        *,
        shared: bool = False,
    ) -> PutAnswer:
        """Store blocks in the caller's namespace (``shared``: the shared one, for a tenant with
        the trusted writer role)."""
        if len(keys) != len(payloads):
            raise InvalidArgument(
                "payloads", f"{len(payloads)} payloads for {len(keys)} keys (one each)"
            )
        answers = [
            self._put_stream(keys[start:end], payloads[start:end], traffic_class, shared)
            for start, end in _streams(payloads)
        ]
        return PutAnswer(
            stored=sum(a.stored for a in answers),
            existing=sum(a.existing for a in answers),
            busy_keys=tuple(k for a in answers for k in a.busy_keys),
            failed_keys=tuple(k for a in answers for k in a.failed_keys),
        )

    def _put_stream(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[bytes],
        traffic_class: str,
        shared: bool,
    ) -> PutAnswer:
        def messages() -> Iterator[Any]:
            chunk: list[Any] = []
            size = 0
            first = True
            for key, payload in zip(keys, payloads, strict=True):
                chunk.append(pb.Block(key=bytes(key), payload=bytes(payload)))
                size += len(payload)
                if size >= _PUT_CHUNK_BYTES:
                    yield self._put_message(chunk, traffic_class, shared, first)
                    chunk, size, first = [], 0, False
            if chunk or first:
                yield self._put_message(chunk, traffic_class, shared, first)

        reply = self._stub.PutBlocks(messages(), **self._kw())
        return PutAnswer(
            stored=reply.committed - reply.existing,
            existing=reply.existing,
            busy_keys=tuple(BlockKey(key) for key in reply.busy_keys),
            failed_keys=tuple(BlockKey(key) for key in reply.failed_keys),
        )

    def _put_message(self, chunk: list[Any], traffic_class: str, shared: bool, first: bool) -> Any:
        # The stream's class and layout ride on its first message only.
        return pb.PutBlocksRequest(
            blocks=chunk,
            traffic_class=traffic_class if first else "",
            shared=shared,
            layout=self._layout if first else None,
        )

    def get_blocks(
        self, keys: Sequence[bytes], lease_id: str | None = None, *, keep_lease: bool = False
    ) -> list[BlockRead]:
        """One read per key, in order (the server answers a key given twice once)."""
        if keep_lease:
            raise InvalidArgument(
                "keep_lease", "not over gRPC: a GetBlocks ends its lease; ask every key in one"
            )
        request = pb.GetBlocksRequest(
            keys=[bytes(key) for key in keys], lease_id=lease_id or "", layout=self._layout
        )
        answered = {
            reply.key: BlockRead(
                key=BlockKey(reply.key),
                payload=reply.payload if reply.found else None,
                miss_reason=reply.miss_reason or None,
                degraded=reply.degraded,
            )
            for reply in self._stub.GetBlocks(request, **self._kw())
        }
        unanswered = BlockRead(key=BlockKey(b""), payload=None, miss_reason="not_answered")
        return [
            answered.get(bytes(key)) or dataclasses.replace(unanswered, key=BlockKey(bytes(key)))
            for key in keys
        ]

    def put_swa_state(
        self,
        key: bytes,
        position: int,
        state: bytes,
        machine: str | None = None,
        *,
        shared: bool = False,
        state_bytes: int | None = None,
        owner: str = "",
    ) -> str:
        del owner  # the gateway owns the state by this client's token, never by its word
        self._check_state_bytes(state_bytes)
        request = pb.PutSWAStateRequest(
            key=bytes(key),
            position=position,
            state=bytes(state),
            machine=machine or "",
            shared=shared,
            layout=self._layout,
        )
        return str(self._stub.PutSWAState(request, **self._kw()).owner)

    def get_swa_state(
        self, key: bytes, position: int, *, state_bytes: int | None = None
    ) -> StateRead:
        self._check_state_bytes(state_bytes)
        reply = self._stub.GetSWAState(
            pb.GetSWAStateRequest(key=bytes(key), position=position, layout=self._layout),
            **self._kw(),
        )
        return StateRead(
            state=reply.state if reply.found else None,
            owner=reply.owner or None,
            miss_reason=reply.miss_reason or None,
        )

    def _check_state_bytes(self, state_bytes: int | None) -> None:
        """Over gRPC a state's size is the client's layout's (the tier's own without one): a
        caller may only restate it."""
        if (
            state_bytes is not None
            and self.layout is not None
            and (state_bytes != self.layout.state_bytes)
        ):
            raise InvalidArgument(
                "state_bytes", "a client's states have its layout's size; make the client with it"
            )

    def release_lease(self, lease_id: str) -> bool:
        reply = self._stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease_id), **self._kw())
        return bool(reply.released)

    def serving(self) -> bool:
        """The standard ``grpc.health.v1`` check of the KVStore service."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from kvstore.api.server import SERVICE_NAME

        reply = health_pb2_grpc.HealthStub(self._channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=self._timeout
        )
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def stats(self) -> Stats:
        reply = self._stub.GetStats(pb.GetStatsRequest(), **self._kw())
        figures = json.loads(reply.json) if reply.json else {}
        known = {
            "classes",
            "block_bytes_stored",
            "swa_bytes_stored",
            "degraded_reads",
            "repairs_done",
            "repairs_pending",
            "live_storage_nodes",
            "storage_nodes",
        }
        return Stats(
            classes=figures.get("classes", {}),
            block_bytes_stored=reply.block_bytes_stored,
            swa_bytes_stored=reply.swa_bytes_stored,
            degraded_reads=reply.degraded_reads,
            repairs_done=reply.repairs_done,
            repairs_pending=reply.repairs_pending,
            live_storage_nodes=reply.live_storage_nodes,
            storage_nodes=reply.storage_nodes,
            extra={k: v for k, v in figures.items() if k not in known},
        )


def _streams(payloads: Sequence[bytes]) -> list[tuple[int, int]]:
    """[start, end) ranges of ``payloads`` of at most ``_PUT_STREAM_BYTES`` each (at least one
    payload each; an empty put is one empty range, which the server refuses by name)."""
    ranges, start, size = [], 0, 0
    for index, payload in enumerate(payloads):
        if size and size + len(payload) > _PUT_STREAM_BYTES:
            ranges.append((start, index))
            start, size = index, 0
        size += len(payload)
    ranges.append((start, len(payloads)))
    return ranges


def _packed(keys: Sequence[bytes] | np.ndarray) -> bytes:
    """The keys end to end; a key that is not 32 bytes is an error naming its position (a
    short one would shift every key after it)."""
    return key_words(keys, "block_keys").tobytes()


def _unpacked(raw: bytes) -> tuple[BlockKey, ...]:
    return tuple(BlockKey(raw[i : i + KEY_BYTES]) for i in range(0, len(raw), KEY_BYTES))


def _direct_grant(message: Any) -> DirectGrant | None:
    """A ``DirectRead`` message as its ``DirectGrant``; None (read through the gateway) when it
    does not describe one whole set of blocks."""
    try:
        width = int(message.k) + int(message.m)
        keys = np.frombuffer(message.block_keys_packed, "<u8").reshape(-1, 4)
        return DirectGrant(
            capability=bytes(message.capability),
            keys=keys,
            placements=np.frombuffer(message.placements, "<i4").reshape(-1, max(1, width)),
            sizes=np.frombuffer(message.sizes, "<i8"),
            endpoints={int(e.node_id): (str(e.host), int(e.port)) for e in message.endpoints},
            k=int(message.k),
            m=int(message.m),
        )
    except (ValueError, InvalidArgument) as error:
        log.warning("the gateway's direct read grant is malformed, ignored: %s", error)
        return None
