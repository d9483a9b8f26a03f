"""The ``kvstore.v1.KVStore`` servicer: validate every field, translate, call the tier.

The tier is anything implementing ``kvstore.tier.protocols.Tier`` (the deployed cluster's
``ClusterTier`` in ``kvstore up``; a stand-in in the unit tests). Every malformed request is
answered INVALID_ARGUMENT with a message naming the field; errors from the tier map to status
codes through ``kvstore.errors.grpc_status_name``; anything unexpected is logged and answered
INTERNAL — the server itself never goes down on input. Tier calls are synchronous (they wait on
the cluster), so they run in the server's bounded thread pool; a request that finds the pool full
is refused with RESOURCE_EXHAUSTED instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn, TypeVar

import grpc
import numpy as np

from kvstore.api.metrics import ApiMetrics
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.api.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import InvalidArgument, KVStoreError, Overloaded, grpc_status_name
from kvstore.keys import KEY_BYTES, BlockKey, block_keys, key_words
from kvstore.tier.protocols import AsyncHitSource, Tier
from kvstore.tier.records import HitRequest

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_KEYS_PER_REQUEST = 1 << 16  # 8M tokens of prompt: far beyond any model's context
MAX_TOKENS_PER_REQUEST = MAX_KEYS_PER_REQUEST * 128
MAX_LEASE_ID_CHARS = 128
MAX_CLASS_CHARS = 64
_MODES = {
    pb.HIT_MODE_UNSPECIFIED: "standard",
    pb.HIT_MODE_STANDARD: "standard",
    pb.HIT_MODE_BOUNDED_REPLAY: "bounded-replay",
}
_ADVICE = {None: pb.ADVICE_UNSPECIFIED, "fetch": pb.ADVICE_FETCH, "replay": pb.ADVICE_REPLAY}


def _keys(raw: Any, field: str) -> list[BlockKey]:
    if len(raw) > MAX_KEYS_PER_REQUEST:
        raise InvalidArgument(field, f"at most {MAX_KEYS_PER_REQUEST} keys, got {len(raw)}")
    keys = []
    for index, key in enumerate(raw):
        if len(key) != KEY_BYTES:
            raise InvalidArgument(f"{field}[{index}]", f"must be {KEY_BYTES} bytes, got {len(key)}")
        keys.append(BlockKey(bytes(key)))
    return keys


def _key_words(raw: Any, field: str) -> np.ndarray:
    """Many keys at once as (n, 4) uint64 words: no Python object per key (QueryHit's 1,000)."""
    if len(raw) > MAX_KEYS_PER_REQUEST:
        raise InvalidArgument(field, f"at most {MAX_KEYS_PER_REQUEST} keys, got {len(raw)}")
    return key_words(raw, field)


def _packed_key_words(raw: bytes, field: str) -> np.ndarray:
    """Keys given end to end in one bytes field, as (n, 4) uint64 words (no copy)."""
    if len(raw) % KEY_BYTES:
        raise InvalidArgument(
            field, f"must be a multiple of {KEY_BYTES} bytes (whole keys), got {len(raw)}"
        )
    if len(raw) // KEY_BYTES > MAX_KEYS_PER_REQUEST:
        raise InvalidArgument(
            field, f"at most {MAX_KEYS_PER_REQUEST} keys, got {len(raw) // KEY_BYTES}"
        )
    return np.frombuffer(raw, dtype=np.uint64).reshape(-1, 4)


def _short_string(value: str, field: str, limit: int) -> str:
    if len(value) > limit:
        raise InvalidArgument(field, f"at most {limit} characters, got {len(value)}")
    if not value.isprintable():
        raise InvalidArgument(field, "must be printable text")
    return value


def _non_negative(value: int, field: str) -> int:
    if value < 0:
        raise InvalidArgument(field, f"must be ≥ 0, got {value}")
    return value


class KVStoreServicer(pb_grpc.KVStoreServicer):
    def __init__(
        self,
        tier: Tier,
        executor: ThreadPoolExecutor,
        max_in_flight: int,
        metrics: ApiMetrics | None = None,
    ) -> None:
        self._tier = tier
        # A tier that can plan hits on the loop itself (the cluster's) spares the thread hop.
        self._async_hits = tier if isinstance(tier, AsyncHitSource) else None
        self._executor = executor
        self._max_in_flight = max_in_flight
        self._in_flight = 0
        self._metrics = metrics

    # --- plumbing ------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        context: Any,
        work: Callable[[], T],
        inline: bool = False,
        awaited: Callable[[], Awaitable[T]] | None = None,
    ) -> T:
        """Run ``work`` in the pool with admission control; map errors to status codes.
        ``inline``: work that never blocks (the tier protocol says which) runs on the event loop,
        sparing the thread hop that would cost more than the work. ``awaited``: the same work
        as a coroutine the loop runs itself (a tier with an asyncio path), used instead."""
        if self._in_flight >= self._max_in_flight:
            await self._abort(
                context, method, Overloaded(f"{self._max_in_flight} requests in flight")
            )
        self._in_flight += 1
        started = time.perf_counter()
        try:
            if awaited is not None:
                return await awaited()
            if inline:
                return work()
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, work)
        except KVStoreError as error:
            await self._abort(context, method, error)
        except Exception as error:  # the server never dies on a request; log and answer
            log.exception("%s failed", method)
            await self._abort(context, method, error)
        finally:
            self._in_flight -= 1
            if self._metrics is not None:
                self._metrics.observe(method, time.perf_counter() - started)

    async def _abort(self, context: Any, method: str, error: BaseException) -> NoReturn:
        status = grpc_status_name(error)
        if self._metrics is not None:
            self._metrics.error(method, status)
        message = str(error) if isinstance(error, KVStoreError) else f"internal error: {error!r}"
        await context.abort(getattr(grpc.StatusCode, status), message)
        raise AssertionError("context.abort returned")  # pragma: no cover

    async def _validate(self, context: Any, method: str, check: Callable[[], T]) -> T:
        try:
            return check()
        except KVStoreError as error:
            await self._abort(context, method, error)

    # --- RPCs ----------------------------------------------------------------------------

    async def QueryHit(self, request: Any, context: Any) -> Any:
        keys, prompt_len, mode, traffic_class = await self._validate(
            context, "QueryHit", lambda: self._query_args(request)
        )
        hit = HitRequest(
            block_keys=keys,
            prompt_len=prompt_len,
            mode=mode,
            traffic_class=traffic_class,
            take_lease=request.take_lease,
        )
        hits = self._async_hits
        answer = await self._call(
            "QueryHit",
            context,
            lambda: self._tier.query_hit(hit),
            awaited=None if hits is None else lambda: hits.query_hit_async(hit),
        )
        plan = answer.plan
        packed = bool(request.block_keys_packed)
        return pb.QueryHitResponse(
            plan=pb.HitPlan(
                prompt_len=plan.prompt_len,
                cap=plan.cap,
                block_hit_tokens=plan.block_hit_tokens,
                hit_tokens=plan.hit_tokens,
                swa_hit=plan.swa_hit,
                swa_position=-1 if plan.swa_position is None else plan.swa_position,
                swa_owner=answer.swa_owner or "",
                replay_start=-1 if plan.replay_start is None else plan.replay_start,
                replay_tokens=plan.replay_tokens,
                compute_from=plan.compute_from,
                store_at=-1 if plan.store_at is None else plan.store_at,
            ),
            advice=_ADVICE.get(answer.advice, pb.ADVICE_UNSPECIFIED),
            fetch_seconds=answer.fetch_seconds,
            replay_seconds=answer.replay_seconds,
            lease_id=answer.lease_id or "",
            # The response mirrors the request's form of the keys (packed or one per key).
            hit_block_keys=() if packed else list(answer.hit_block_keys),
            hit_block_keys_packed=answer.hit_keys_packed if packed else b"",
        )

    def _query_args(self, request: Any) -> tuple[np.ndarray, int, str, str]:
        if request.mode not in _MODES:
            raise InvalidArgument("mode", f"unknown hit mode {request.mode}")
        traffic_class = _short_string(request.traffic_class, "traffic_class", MAX_CLASS_CHARS)
        prompt_len = _non_negative(request.prompt_len, "prompt_len")
        given = [
            name
            for name in ("token_ids", "block_keys", "block_keys_packed")
            if getattr(request, name)
        ]
        if len(given) > 1:
            raise InvalidArgument(
                given[0],
                f"give one of token_ids, block_keys, block_keys_packed; got {' and '.join(given)}",
            )
        if request.token_ids:
            if len(request.token_ids) > MAX_TOKENS_PER_REQUEST:
                raise InvalidArgument(
                    "token_ids",
                    f"at most {MAX_TOKENS_PER_REQUEST} tokens, got {len(request.token_ids)}",
                )
            if prompt_len not in (0, len(request.token_ids)):
                raise InvalidArgument(
                    "prompt_len",
                    f"{prompt_len} differs from the {len(request.token_ids)} token_ids given",
                )
            prompt_len = len(request.token_ids)
            keys = key_words(block_keys(self._tier.model_fingerprint, list(request.token_ids)))
        elif request.block_keys_packed:
            keys = _packed_key_words(request.block_keys_packed, "block_keys_packed")
        else:
            keys = _key_words(request.block_keys, "block_keys")
            if len(keys) * 128 > prompt_len:
                raise InvalidArgument(
                    "prompt_len",
                    f"{prompt_len} tokens cannot hold the {len(keys)} blocks of block_keys "
                    f"({len(keys) * 128} tokens)",
                )
        return keys, prompt_len, _MODES[request.mode], traffic_class

    async def PutBlocks(self, request_iterator: AsyncIterator[Any], context: Any) -> Any:
        keys: list[BlockKey] = []
        payloads: list[bytes] = []
        traffic_class: str | None = None
        async for message in request_iterator:
            if traffic_class is None:
                traffic_class = await self._validate(
                    context,
                    "PutBlocks",
                    functools.partial(
                        _short_string, message.traffic_class, "traffic_class", MAX_CLASS_CHARS
                    ),
                )
            for block in message.blocks:
                position = len(keys)
                if len(block.key) != KEY_BYTES:
                    await self._abort(
                        context,
                        "PutBlocks",
                        InvalidArgument(
                            f"blocks[{position}].key",
                            f"must be {KEY_BYTES} bytes, got {len(block.key)}",
                        ),
                    )
                if not block.payload:
                    await self._abort(
                        context,
                        "PutBlocks",
                        InvalidArgument(f"blocks[{position}].payload", "is empty"),
                    )
                keys.append(BlockKey(block.key))
                payloads.append(block.payload)
            if len(keys) > MAX_KEYS_PER_REQUEST:
                await self._abort(
                    context,
                    "PutBlocks",
                    InvalidArgument("blocks", f"at most {MAX_KEYS_PER_REQUEST} blocks per stream"),
                )
        if not keys:
            await self._abort(context, "PutBlocks", InvalidArgument("blocks", "no blocks given"))
        answer = await self._call(
            "PutBlocks",
            context,
            lambda: self._tier.put_blocks(keys, payloads, traffic_class or ""),
        )
        return pb.PutBlocksResponse(
            committed=answer.committed,
            existing=answer.existing,
            failed_keys=list(answer.failed_keys),
            busy_keys=list(answer.busy_keys),
        )

    async def GetBlocks(self, request: Any, context: Any) -> AsyncIterator[Any]:
        keys, lease_id = await self._validate(
            context,
            "GetBlocks",
            lambda: (
                _keys(request.keys, "keys"),
                _short_string(request.lease_id, "lease_id", MAX_LEASE_ID_CHARS) or None,
            ),
        )
        reads = await self._call(
            "GetBlocks", context, lambda: self._tier.get_blocks(keys, lease_id)
        )
        for read in reads:
            yield pb.GetBlocksResponse(
                key=read.key,
                found=read.found,
                payload=read.payload or b"",
                miss_reason=read.miss_reason or "",
                degraded=read.degraded,
            )

    async def PutSWAState(self, request: Any, context: Any) -> Any:
        def check() -> tuple[BlockKey, str | None]:
            key = _keys([request.key], "key")[0]
            machine = _short_string(request.machine, "machine", MAX_CLASS_CHARS) or None
            if len(request.state) != self._tier.state_size:
                raise InvalidArgument(
                    "state",
                    f"must be exactly {self._tier.state_size} bytes (state_size_to_disk) at "
                    f"position {request.position}, got {len(request.state)}",
                )
            return key, machine

        key, machine = await self._validate(context, "PutSWAState", check)
        owner = await self._call(
            "PutSWAState",
            context,
            lambda: self._tier.put_swa_state(key, request.position, request.state, machine),
        )
        return pb.PutSWAStateResponse(owner=owner)

    async def GetSWAState(self, request: Any, context: Any) -> Any:
        key = await self._validate(context, "GetSWAState", lambda: _keys([request.key], "key")[0])
        read = await self._call(
            "GetSWAState", context, lambda: self._tier.get_swa_state(key, request.position)
        )
        return pb.GetSWAStateResponse(
            found=read.state is not None,
            state=read.state or b"",
            owner=read.owner or "",
            miss_reason=read.miss_reason or "",
        )

    async def ReleaseLease(self, request: Any, context: Any) -> Any:
        def check() -> str:
            lease_id = _short_string(request.lease_id, "lease_id", MAX_LEASE_ID_CHARS)
            if not lease_id:
                raise InvalidArgument("lease_id", "is empty")
            return lease_id

        lease_id = await self._validate(context, "ReleaseLease", check)
        released = await self._call(
            "ReleaseLease", context, lambda: self._tier.release_lease(lease_id), inline=True
        )
        return pb.ReleaseLeaseResponse(released=released)

    async def GetStats(self, request: Any, context: Any) -> Any:
        import json

        stats = await self._call("GetStats", context, self._tier.stats)
        classes = []
        for name, figures in sorted(stats.classes.items()):
            classes.append(
                pb.ClassStats(
                    traffic_class=name,
                    lookups=int(figures.get("lookups", 0)),
                    hit_blocks=int(figures.get("hit_blocks", 0)),
                    miss_blocks=int(figures.get("miss_blocks", 0)),
                    miss_reasons={k: int(v) for k, v in figures.get("miss_reasons", {}).items()},
                    stored_bytes=int(figures.get("stored_bytes", 0)),
                )
            )
        return pb.GetStatsResponse(
            classes=classes,
            block_bytes_stored=stats.block_bytes_stored,
            swa_bytes_stored=stats.swa_bytes_stored,
            degraded_reads=stats.degraded_reads,
            repairs_done=stats.repairs_done,
            repairs_pending=stats.repairs_pending,
            live_storage_nodes=stats.live_storage_nodes,
            storage_nodes=stats.storage_nodes,
            json=json.dumps(
                {
                    "classes": stats.classes,
                    "block_bytes_stored": stats.block_bytes_stored,
                    "swa_bytes_stored": stats.swa_bytes_stored,
                    "degraded_reads": stats.degraded_reads,
                    "repairs_done": stats.repairs_done,
                    "repairs_pending": stats.repairs_pending,
                    "live_storage_nodes": stats.live_storage_nodes,
                    "storage_nodes": stats.storage_nodes,
                    **stats.extra,
                },
                default=str,
            ),
        )
