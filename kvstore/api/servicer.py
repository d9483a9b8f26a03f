"""The ``kvstore.v1.KVStore`` servicer: who is asking, validate every field, call their tier.

Each request acts for a tenant (``kvstore.api.auth``) and is served by that tenant's view of
the tier (``kvstore.tier.tenancy.TenantView``: its keys namespaced, its policy applied). Every
malformed request is answered INVALID_ARGUMENT with a message naming the field; errors from the
tier map to status codes through ``kvstore.errors.grpc_status_name``; anything unexpected is
logged and answered INTERNAL — the server itself never goes down on input.

Bounded in memory and time (``GatewayLimits``): requests in flight are admitted up to a count,
a stream counted until it finishes; bytes held for GetBlocks and PutBlocks are reserved from a
``ByteBudget`` (in total, per tenant, per connection); GetBlocks reads in batches, the next only
once the client took the last, and ends a reader that stalls; long token lists are hashed in the
worker pool, never on the event loop; every call has a server-side deadline. Tier calls wait on
the cluster, so they run in the bounded thread pool (QueryHit on the loop itself when the tier
can plan from it).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import grpc
import numpy as np

from kvstore.api.auth import Authenticator
from kvstore.api.budget import MIB, BudgetLimits, ByteBudget
from kvstore.api.metrics import ApiMetrics, CachedStats
from kvstore.api.shares import CostShares
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.api.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import ConfigError, InvalidArgument, KVStoreError, Overloaded, grpc_status_name
from kvstore.keys import BLOCK_TOKENS, KEY_BYTES, BlockKey, key_words
from kvstore.tenants import RateLimiter, Tenant
from kvstore.tier.prefill import PrefillRates
from kvstore.tier.records import MAX_CLASS_CHARS, DirectGrant, HitRequest, Layout
from kvstore.tier.tenancy import TenantView, TenantViews

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_KEYS_PER_REQUEST = 1 << 16  # 8M tokens of prompt: far beyond any model's context
MAX_LEASE_ID_CHARS = 128

_MODES = {
    pb.HIT_MODE_UNSPECIFIED: "standard",
    pb.HIT_MODE_STANDARD: "standard",
    pb.HIT_MODE_BOUNDED_REPLAY: "bounded-replay",
    pb.HIT_MODE_FULL_ATTENTION: "full-attention",
    pb.HIT_MODE_EXACT_WINDOW: "exact-window",
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


def _layout(message: Any, limits: GatewayLimits) -> Layout | None:
    """The layout a request names (None: the tier's own), checked."""
    if not message.HasField("layout"):
        return None
    given = message.layout
    layout = Layout(bytes(given.fingerprint), int(given.block_bytes), int(given.state_bytes))
    if layout.block_bytes > limits.max_put_bytes:
        raise InvalidArgument(
            "layout.block_bytes",
            f"{layout.block_bytes} bytes: a block must fit one PutBlocks stream "
            f"({limits.max_put_bytes} bytes)",
        )
    if layout.state_bytes > limits.max_put_bytes:
        raise InvalidArgument(
            "layout.state_bytes",
            f"{layout.state_bytes} bytes: at most {limits.max_put_bytes} bytes",
        )
    return layout


def _peer_host(peer: str) -> str:
    """The IP address in a gRPC peer string (``ipv4:10.0.0.5:5000``, ``ipv6:[::1]:5000``)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rpartition("]")[0].lstrip("[")
    return rest.rpartition(":")[0] if kind == "ipv4" else ""


@dataclass(frozen=True)
class GatewayLimits:
    """What one request, connection or tenant may hold of the gateway (``kvstore up`` flags)."""

    #: Token ids one QueryHit may carry (a 1 M-token prompt is beyond any model served today).
    max_tokens: int = 1 << 20
    #: Token lists longer than this are hashed in the worker pool (≈ 11 µs per 1,000 tokens,
    #: the GIL released) so a long prompt never stalls the event loop and every call behind it.
    inline_hash_tokens: int = 16_384
    #: Payload bytes one PutBlocks stream may carry (the Python client splits larger puts).
    max_put_bytes: int = 64 * MIB
    #: Bytes of blocks one GetBlocks reads at a time (the next batch once the client took
    #: this one).
    get_batch_bytes: int = 8 * MIB
    #: What the transport may buffer for one stream beyond the batch (the client's HTTP/2
    #: window), reserved for the stream's whole life.
    stream_window_bytes: int = 4 * MIB
    #: A GetBlocks whose reader takes no message for this long is ended (DEADLINE_EXCEEDED).
    stall_s: float = 20.0
    #: A PutBlocks stream that sends no message for this long (its first one included) is
    #: ended (DEADLINE_EXCEEDED): an idle stream holds a slot and bytes others need.
    message_wait_s: float = 5.0
    #: Requests and streams one tenant may have in flight at once: its share of the gateway's
    #: ``max_in_flight``, so no tenant takes every slot.
    tenant_in_flight: int = 64
    #: Blocks of QueryHit one tenant may have running at once (``kvstore.api.shares``): one
    #: lookup at the prompt cap, or hundreds of an engine's ordinary ones.
    tenant_blocks_in_flight: int = 8_192
    #: How old the figures GetStats answers with may be (per tenant).
    stats_max_age_s: float = 1.0
    #: The largest message the server takes (the server sets it from
    #: ``ServerOptions.max_message_bytes``): what a PutBlocks stream reserves before it reads
    #: its next message.
    message_bytes: int = 16 * MIB
    #: No call runs longer than this on the server (DEADLINE_EXCEEDED).
    rpc_deadline_s: float = 120.0
    max_streams_per_connection: int = 64
    connection_idle_s: float = 300.0
    connection_age_s: float = 3600.0
    budget: BudgetLimits = field(default_factory=BudgetLimits)

    def request_bytes(self, method: str) -> int:
        """The largest request message ``method`` can validly take: one larger is refused
        before it is parsed (parsing holds the event loop: a 16 MiB QueryHit took ~25 ms)."""
        room = 64 * 1024  # a layout's fingerprint, a class, a lease id and the framing
        if method == "QueryHit":  # token ids as varints of at most 5 bytes, or the keys
            return (
                max(5 * self.max_tokens, (KEY_BYTES + 3) * self.max_tokens // BLOCK_TOKENS) + room
            )
        if method == "GetBlocks":
            return (KEY_BYTES + 3) * MAX_KEYS_PER_REQUEST + room
        if method in ("PutBlocks", "PutSWAState"):
            return self.message_bytes
        return room

    def __post_init__(self) -> None:
        for name in (
            "max_tokens",
            "max_put_bytes",
            "get_batch_bytes",
            "max_streams_per_connection",
            "tenant_in_flight",
            "tenant_blocks_in_flight",
            "message_bytes",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be ≥ 1, got {getattr(self, name)}")
        for name in (
            "stall_s",
            "message_wait_s",
            "rpc_deadline_s",
            "connection_idle_s",
            "connection_age_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        smallest = min(self.budget.connection_bytes, self.budget.tenant_bytes)
        # What one stream holds at most: a put's payloads and the next message read into
        # room reserved for it; a read's batch and what the transport buffers beyond it.
        for name, beyond, what in (
            ("max_put_bytes", self.message_bytes, "message"),
            ("get_batch_bytes", self.stream_window_bytes, "stream window"),
        ):
            if getattr(self, name) + beyond > smallest:
                raise ConfigError(
                    name,
                    f"{getattr(self, name)} bytes (plus a {beyond}-byte {what}) could never "
                    f"fit the {smallest}-byte budget of a connection",
                )


class _Call:
    """One admitted request: who it is for, where it came from, what it holds."""

    __slots__ = ("method", "tenant", "view", "peer", "started")

    def __init__(self, method: str, tenant: Tenant, view: TenantView, peer: str) -> None:
        self.method = method
        self.tenant = tenant
        self.view = view
        self.peer = peer
        self.started = time.perf_counter()


class KVStoreServicer(pb_grpc.KVStoreServicer):
    def __init__(
        self,
        views: TenantViews,
        auth: Authenticator,
        executor: ThreadPoolExecutor,
        max_in_flight: int,
        limits: GatewayLimits | None = None,
        metrics: ApiMetrics | None = None,
    ) -> None:
        self._views = views
        self._auth = auth
        self._executor = executor
        self._max_in_flight = max_in_flight
        self._limits = limits or GatewayLimits()
        self._budget = ByteBudget(self._limits.budget)
        # Lookups wait for their tenant's share as long as puts wait for bytes.
        self._shares = CostShares(self._limits.tenant_blocks_in_flight, self._limits.budget.wait_s)
        self._rates = RateLimiter()
        self._in_flight = 0
        self._tenant_in_flight: Counter[str] = Counter()
        self._stats: dict[str, CachedStats] = {}
        self._metrics = metrics
        #: Engines' prefill rates per tenant and layout, answered to engines without their own.
        self._prefill = PrefillRates()

    @property
    def limits(self) -> GatewayLimits:
        return self._limits

    # --- plumbing ------------------------------------------------------------------------

    async def _enter(self, method: str, context: Any) -> _Call:
        """Identify the caller, apply its rate and the admission limit; the call is counted in
        flight until ``_leave`` (for a stream: until it finishes, not when it first yields)."""
        try:
            tenant = self._auth.tenant(context.invocation_metadata() or (), context.auth_context())
            if not self._rates.allow(tenant):
                raise Overloaded(
                    f"tenant {tenant.name!r} is over its {tenant.max_requests_per_s:g} "
                    "requests per second"
                )
            if self._in_flight >= self._max_in_flight:
                raise Overloaded(f"{self._max_in_flight} requests in flight")
            share = self._limits.tenant_in_flight
            if self._tenant_in_flight[tenant.name] >= share:
                raise Overloaded(
                    f"tenant {tenant.name!r} has {share} requests in flight (its share)"
                )
        except KVStoreError as error:
            await self._abort(context, method, error)
        self._in_flight += 1
        self._tenant_in_flight[tenant.name] += 1
        return _Call(method, tenant, self._views.view(tenant), context.peer() or "")

    def _leave(self, call: _Call) -> None:
        self._in_flight -= 1
        self._tenant_in_flight[call.tenant.name] -= 1
        if self._metrics is not None:
            self._metrics.observe(call.method, time.perf_counter() - call.started)

    async def _run(
        self,
        call: _Call,
        context: Any,
        work: Callable[[], T],
        inline: bool = False,
        awaited: Callable[[], Awaitable[T]] | None = None,
    ) -> T:
        """Run ``work`` in the pool (``inline``: on the loop, for work that never blocks;
        ``awaited``: as a coroutine on the loop) under the server-side deadline; map errors
        to status codes."""
        try:
            if awaited is not None:
                job: Awaitable[T] = awaited()
            elif inline:
                return work()
            else:
                job = asyncio.get_running_loop().run_in_executor(self._executor, work)
            return await asyncio.wait_for(job, self._limits.rpc_deadline_s)
        except KVStoreError as error:
            await self._abort(context, call.method, error)
        except TimeoutError:
            await self._abort_with(
                context,
                call.method,
                "DEADLINE_EXCEEDED",
                f"{call.method} ran past the server's {self._limits.rpc_deadline_s:g} s",
            )
        except Exception as error:  # the server never dies on a request; log and answer
            log.exception("%s failed", call.method)
            await self._abort(context, call.method, error)

    async def _abort(self, context: Any, method: str, error: BaseException) -> NoReturn:
        message = str(error) if isinstance(error, KVStoreError) else f"internal error: {error!r}"
        await self._abort_with(context, method, grpc_status_name(error), message)

    async def _abort_with(self, context: Any, method: str, status: str, message: str) -> NoReturn:
        if self._metrics is not None:
            self._metrics.error(method, status)
        await context.abort(getattr(grpc.StatusCode, status), message)
        raise AssertionError("context.abort returned")  # pragma: no cover

    async def _validate(self, context: Any, method: str, check: Callable[[], T]) -> T:
        try:
            return check()
        except KVStoreError as error:
            await self._abort(context, method, error)

    # --- RPCs ----------------------------------------------------------------------------

    async def QueryHit(self, request: Any, context: Any) -> Any:
        call = await self._enter("QueryHit", context)
        try:
            return await self._query_hit(call, request, context)
        finally:
            self._leave(call)

    async def _query_hit(self, call: _Call, request: Any, context: Any) -> Any:
        hit = await self._validate(context, "QueryHit", lambda: self._hit_request(request))
        blocks = hit.block_count()
        try:
            async with self._shares.admit(call.tenant.name, blocks):
                return await self._answer_hit(call, hit, bool(request.block_keys_packed), context)
        except Overloaded as error:  # its share stayed full for the whole wait
            await self._abort(context, "QueryHit", error)

    async def _answer_hit(self, call: _Call, hit: HitRequest, packed: bool, context: Any) -> Any:
        view = call.view
        tokens = hit.token_ids
        fingerprint = view.layout(hit.layout).fingerprint
        self._prefill.report(call.tenant.name, fingerprint, hit.prefill_tokens_per_s)
        if tokens is not None:
            # Hashed here, once, under the layout's fingerprint; long prompts in the pool.
            words = await self._run(
                call,
                context,
                lambda: hit.words(fingerprint),
                inline=len(tokens) <= self._limits.inline_hash_tokens,
            )
            hit = hit.with_words(words)
        answer = await self._run(
            call,
            context,
            lambda: view.query_hit(hit),
            awaited=(lambda: view.query_hit_async(hit)) if view.async_capable else None,
        )
        plan = answer.plan
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
            direct=None if answer.direct is None else _direct_message(answer.direct),
            prefill_tokens_per_s=self._prefill.rate(call.tenant.name, fingerprint),
            stored_blocks=answer.stored_blocks,
        )

    def _hit_request(self, request: Any) -> HitRequest:
        """The message as the one checked ``HitRequest`` (its token ids not hashed yet)."""
        if request.mode not in _MODES:
            raise InvalidArgument("mode", f"unknown hit mode {request.mode}")
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
        tokens = len(request.token_ids)
        if tokens > self._limits.max_tokens:
            raise InvalidArgument(
                "token_ids", f"at most {self._limits.max_tokens} tokens, got {tokens}"
            )
        keys = None
        if request.block_keys_packed:
            keys = _packed_key_words(request.block_keys_packed, "block_keys_packed")
        elif not tokens:
            keys = _key_words(request.block_keys, "block_keys")
        # One cap on the prompt whichever form it takes (keys stand for whole blocks).
        most = self._limits.max_tokens
        if keys is not None and keys.shape[0] * BLOCK_TOKENS > most:
            raise InvalidArgument(
                given[0] if given else "block_keys",
                f"at most {most // BLOCK_TOKENS} keys (a {most}-token prompt), got {keys.shape[0]}",
            )
        if request.prompt_len > most:
            raise InvalidArgument("prompt_len", f"at most {most} tokens, got {request.prompt_len}")
        return HitRequest(
            # (Slicing or copying the repeated field would go element by element: ~50 ms for 1M.)
            token_ids=request.token_ids if tokens else None,
            block_keys=keys,
            prompt_len=request.prompt_len,
            mode=_MODES[request.mode],
            traffic_class=request.traffic_class,
            take_lease=request.take_lease,
            layout=_layout(request, self._limits),
            direct=request.direct and request.take_lease,
            prefill_tokens_per_s=request.prefill_tokens_per_s,
        )

    async def PutBlocks(self, request_iterator: AsyncIterator[Any], context: Any) -> Any:
        call = await self._enter("PutBlocks", context)
        held = 0  # bytes this stream has reserved: payloads read, and room for the next message
        try:
            keys: list[BlockKey] = []
            payloads: list[bytes] = []
            started = False
            traffic_class, shared = "", False
            layout: Layout | None = None
            size = received = 0
            limit = self._limits.max_put_bytes
            messages = aiter(request_iterator)
            while True:
                # Room for the next message is reserved before it is read: a stream's bytes are
                # admitted before they arrive (until then the transport holds only its window),
                # so many fat streams wait here instead of filling the gateway's memory.
                ahead = self._limits.message_bytes
                await self._reserve(call, context, ahead)
                held += ahead
                message = await self._next_message(call, context, messages)
                if message is None:
                    break
                if not started:
                    started = True
                    traffic_class, shared = str(message.traffic_class), bool(message.shared)
                    await self._validate(
                        context,
                        "PutBlocks",
                        functools.partial(
                            _short_string,
                            str(message.traffic_class),
                            "traffic_class",
                            MAX_CLASS_CHARS,
                        ),
                    )
                    layout = await self._validate(
                        context, "PutBlocks", functools.partial(_layout, message, self._limits)
                    )
                    size = call.view.layout(layout).block_bytes
                incoming = 0
                for block in message.blocks:
                    position = len(keys)
                    problem = None
                    if len(block.key) != KEY_BYTES:
                        problem = InvalidArgument(
                            f"blocks[{position}].key",
                            f"must be {KEY_BYTES} bytes, got {len(block.key)}",
                        )
                    elif len(block.payload) != size:
                        problem = InvalidArgument(
                            f"blocks[{position}].payload",
                            f"must be one block of its layout ({size} bytes), got "
                            f"{len(block.payload)}",
                        )
                    if problem is not None:
                        await self._abort(context, "PutBlocks", problem)
                    keys.append(BlockKey(block.key))
                    payloads.append(block.payload)
                    incoming += len(block.payload)
                if len(keys) > MAX_KEYS_PER_REQUEST:
                    await self._abort(
                        context,
                        "PutBlocks",
                        InvalidArgument(
                            "blocks", f"at most {MAX_KEYS_PER_REQUEST} blocks per stream"
                        ),
                    )
                if received + incoming > limit:
                    await self._abort(
                        context,
                        "PutBlocks",
                        Overloaded(
                            f"blocks: a PutBlocks stream carries at most {limit} payload bytes; "
                            "split the put"
                        ),
                    )
                received += incoming
                del message  # its payloads are copied out: hold them once, not twice
                # The message fit its room (the server refuses larger ones); what it did not
                # fill goes back.
                unused = max(0, ahead - incoming)
                self._budget.release(unused, call.tenant.name, call.peer)
                held -= unused
            if not keys:
                await self._abort(
                    context, "PutBlocks", InvalidArgument("blocks", "no blocks given")
                )
            view = call.view
            answer = await self._run(
                call,
                context,
                lambda: view.put_blocks(
                    keys, payloads, traffic_class, shared=shared, layout=layout
                ),
            )
            return pb.PutBlocksResponse(
                committed=answer.committed,
                existing=answer.existing,
                failed_keys=list(answer.failed_keys),
                busy_keys=list(answer.busy_keys),
            )
        finally:
            self._budget.release(held, call.tenant.name, call.peer)
            self._leave(call)

    async def _next_message(self, call: _Call, context: Any, messages: AsyncIterator[Any]) -> Any:
        """The stream's next message (None: it ended); a stream that sends nothing for
        ``message_wait_s`` is ended, so an idle one gives back its slot and bytes in seconds."""
        wait = self._limits.message_wait_s
        try:
            return await asyncio.wait_for(anext(messages), wait)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            await self._abort_with(
                context,
                call.method,
                "DEADLINE_EXCEEDED",
                f"{call.method}: the stream sent no message for {wait:g} s",
            )

    async def GetBlocks(self, request: Any, context: Any) -> None:
        """Written with ``context.write`` (not yield) so a reader that stops taking messages is
        noticed: each write waits for the transport, at most ``stall_s``."""
        call = await self._enter("GetBlocks", context)
        limits = self._limits
        window = limits.stream_window_bytes
        held = 0
        lease_id = None
        try:
            keys, lease_id, layout = await self._validate(
                context,
                "GetBlocks",
                lambda: (
                    _keys(request.keys, "keys"),
                    _short_string(request.lease_id, "lease_id", MAX_LEASE_ID_CHARS) or None,
                    _layout(request, limits),
                ),
            )
            view = call.view
            block_bytes = view.layout(layout).block_bytes
            distinct = list(dict.fromkeys(keys))  # a key asked twice is read (and sent) once
            per_batch = max(1, limits.get_batch_bytes // max(1, block_bytes))
            await self._reserve(call, context, window)
            held += window
            for start in range(0, len(distinct), per_batch):
                part = distinct[start : start + per_batch]
                size = len(part) * block_bytes
                await self._reserve(call, context, size)
                held += size
                reads = await self._run(
                    call,
                    context,
                    functools.partial(
                        view.get_blocks, part, lease_id, keep_lease=True, layout=layout
                    ),
                )
                for read in reads:
                    reply = pb.GetBlocksResponse(
                        key=read.key,
                        found=read.found,
                        payload=read.payload or b"",
                        miss_reason=read.miss_reason or "",
                        degraded=read.degraded,
                    )
                    try:
                        await asyncio.wait_for(context.write(reply), limits.stall_s)
                    except TimeoutError:
                        await self._abort_with(
                            context,
                            "GetBlocks",
                            "DEADLINE_EXCEEDED",
                            f"the client took no block for {limits.stall_s:g} s",
                        )
                del reads
                self._budget.release(size, call.tenant.name, call.peer)
                held -= size
        finally:
            if lease_id is not None:
                call.view.release_lease(lease_id)  # the read is done: GC may collect again
            self._budget.release(held, call.tenant.name, call.peer)
            self._leave(call)

    async def _reserve(self, call: _Call, context: Any, size: int) -> None:
        try:
            await self._budget.acquire(size, call.tenant.name, call.peer)
        except KVStoreError as error:
            await self._abort(context, call.method, error)

    async def PutSWAState(self, request: Any, context: Any) -> Any:
        call = await self._enter("PutSWAState", context)
        try:
            view = call.view

            def check() -> tuple[BlockKey, str | None, Layout | None]:
                key = _keys([request.key], "key")[0]
                machine = _short_string(request.machine, "machine", MAX_CLASS_CHARS) or None
                if machine is None:
                    # Kept in the memory of the machine that made it (docs/rules.md §7), when the
                    # put comes from one of the tier's machines.
                    machine = self._views.tier.machine_at(_peer_host(call.peer))
                # The state's size is its layout's: the tenant's view checks it.
                return key, machine, _layout(request, self._limits)

            key, machine, layout = await self._validate(context, "PutSWAState", check)
            owner = await self._run(
                call,
                context,
                lambda: view.put_swa_state(
                    key,
                    request.position,
                    request.state,
                    machine,
                    shared=request.shared,
                    layout=layout,
                ),
            )
            return pb.PutSWAStateResponse(owner=owner)
        finally:
            self._leave(call)

    async def GetSWAState(self, request: Any, context: Any) -> Any:
        call = await self._enter("GetSWAState", context)
        try:
            key, layout = await self._validate(
                context,
                "GetSWAState",
                lambda: (_keys([request.key], "key")[0], _layout(request, self._limits)),
            )
            view = call.view
            read = await self._run(
                call, context, lambda: view.get_swa_state(key, request.position, layout=layout)
            )
            return pb.GetSWAStateResponse(
                found=read.state is not None,
                state=read.state or b"",
                owner=read.owner or "",
                miss_reason=read.miss_reason or "",
            )
        finally:
            self._leave(call)

    async def ReleaseLease(self, request: Any, context: Any) -> Any:
        call = await self._enter("ReleaseLease", context)
        try:

            def check() -> str:
                lease_id = _short_string(request.lease_id, "lease_id", MAX_LEASE_ID_CHARS)
                if not lease_id:
                    raise InvalidArgument("lease_id", "is empty")
                return lease_id

            lease_id = await self._validate(context, "ReleaseLease", check)
            view = call.view
            released = await self._run(
                call, context, lambda: view.release_lease(lease_id), inline=True
            )
            return pb.ReleaseLeaseResponse(released=released)
        finally:
            self._leave(call)

    def _stats_of(self, call: _Call) -> CachedStats:
        """The caller's figures, asked of the tier at most once per ``stats_max_age_s`` per
        tenant: a tenant polling GetStats cannot make the gateway fan out to the cluster."""
        cached = self._stats.get(call.tenant.name)
        if cached is None:
            cached = CachedStats(call.view.stats, self._limits.stats_max_age_s)
            self._stats[call.tenant.name] = cached
        return cached

    async def GetStats(self, request: Any, context: Any) -> Any:
        call = await self._enter("GetStats", context)
        try:
            stats = await self._run(call, context, self._stats_of(call))
        finally:
            self._leave(call)
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


def _direct_message(grant: DirectGrant) -> Any:
    """A ``DirectGrant`` as its ``DirectRead`` message (arrays as little-endian bytes)."""
    return pb.DirectRead(
        capability=grant.capability,
        block_keys_packed=np.ascontiguousarray(grant.keys, "<u8").tobytes(),
        placements=np.ascontiguousarray(grant.placements, "<i4").tobytes(),
        sizes=np.ascontiguousarray(grant.sizes, "<i8").tobytes(),
        endpoints=[
            pb.ReadEndpoint(node_id=node, host=host, port=port)
            for node, (host, port) in sorted(grant.endpoints.items())
        ],
        k=grant.k,
        m=grant.m,
    )
