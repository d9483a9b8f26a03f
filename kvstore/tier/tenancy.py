"""One tenant's view of a tier: its keys namespaced, its policy applied (docs/rules.md §10).

``TenantView`` wraps any ``kvstore.tier.protocols.Tier`` (the cluster, a directory of files) and
is itself one. Every key a tenant sends is mapped into its namespace
(``kvstore.tenants.namespaced``: BLAKE2b keyed with the tenant's secret salt) before the tier
sees it, and every key it answers with is the caller's own again. A key another tenant computed
from the same tokens is therefore a different key in the tier: never found, never read, never
overwritten — which is what makes the first-writer-wins block store and the last-writer-wins
SWA directory safe to share.

A tenant allowed to read the shared namespace (public system prompts) gets the run of shared
blocks first and its own blocks after it; only the trusted writer role (``shared = "write"``)
writes there. Its leases are its own: the tier's one lease table tags each with its tenant
(``kvstore.tier.leases``), so an id handed to one tenant is nobody else's, and takes a tenant's
cap on open leases with the lease, so one tenant cannot push another's leases out of the tier's
bounded table. Its SWA states are put under its name, so each SWA store keeps them in the
tenant's own share (another tenant's flood never evicts them, ``kvstore.swa.store``), and their
bytes count toward its ``max_bytes`` quota beside its blocks'. Its lookups are counted once, in
the tier's hit figures under its name (``kvstore.tier.counters``). Policy (classes, quotas,
payload sizes, the shared role) is checked before the tier is asked anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from typing import Any

import numpy as np

from kvstore.errors import Forbidden, InvalidArgument, LeaseError, Overloaded
from kvstore.keys import check_key, check_keys, key_words, words_to_keys
from kvstore.tenants import Tenant, namespaced, namespaced_key
from kvstore.tier.counters import class_stats
from kvstore.tier.protocols import AsyncHitSource, Tier
from kvstore.tier.records import (
    BlockRead,
    HitAnswer,
    HitRequest,
    Layout,
    LeaseTag,
    PutAnswer,
    StateRead,
    Stats,
)

#: Open leases one tenant may hold when the operator set no ``max_leases`` (the tier's table
#: holds 100,000: ten tenants at their cap still fit).
DEFAULT_MAX_LEASES = 10_000
#: How old the stored-bytes figure a quota is checked against may be.
_USAGE_MAX_AGE_S = 1.0
#: Lookups of more blocks than this have their keys namespaced off the event loop (~0.15 µs a
#: key a namespace: 512 keys are well under a tenth of a millisecond).
_INLINE_NAMESPACE_BLOCKS = 512


@dataclasses.dataclass(frozen=True)
class _Asked:
    """One QueryHit as this tenant asks it: its keys in words, their namespaced forms."""

    request: HitRequest
    traffic_class: str
    words: np.ndarray
    own: np.ndarray
    shared: np.ndarray | None
    holder: LeaseTag

    def to_tier(self, words: np.ndarray, shared_blocks: int = 0) -> HitRequest:
        """The request to the tier for ``words`` (the keys in one namespace or a mix: the first
        ``shared_blocks`` in the shared one), its lease tagged as this tenant's and its lookup
        counted by the view, once for the whole question."""
        shared: frozenset[bytes] = frozenset()
        if shared_blocks and self.request.take_lease:
            shared = frozenset(k.tobytes() for k in self.words[:shared_blocks])
        return self.request.with_words(
            words,
            traffic_class=self.traffic_class,
            layout=None,
            holder=dataclasses.replace(self.holder, shared=shared),
            counted=False,
        )


class TenantView:
    """The tier as ``tenant`` sees it. Thread-safe; one per tenant (``TenantViews``) so its
    quota figures outlive a request. ``foreign_leases``: this view reads for a process
    whose other half took the leases (an engine's fetcher), so a lease id it does not know is
    read with (the tier decides) instead of refused."""

    def __init__(self, tier: Tier, tenant: Tenant, *, foreign_leases: bool = False) -> None:
        self._tier = tier
        self.tenant = tenant
        self.model_fingerprint = tier.model_fingerprint
        self.state_size = tier.state_size
        self.block_bytes = tier.block_bytes
        #: The layout of a request that names none: the tier's own.
        self.default_layout = Layout(tier.model_fingerprint, tier.block_bytes, tier.state_size)
        self.hit_counters = tier.hit_counters
        self._async = tier if isinstance(tier, AsyncHitSource) else None
        self._foreign_leases = foreign_leases
        self._lock = threading.Lock()
        # (when, bytes stored in its classes and its SWA states)
        self._usage: tuple[float, int] | None = None
        self._put_since_usage = 0
        self._reserved = 0  # bytes of puts running now (``_bytes_reserved``)

    @property
    def async_capable(self) -> bool:
        """Whether ``query_hit_async`` runs without parking a thread (the tier has a loop path)."""
        return self._async is not None

    # --- HitSource -----------------------------------------------------------------------------

    def query_hit(self, request: HitRequest) -> HitAnswer:
        steps = self._steps(self._prepare(request))
        asked = next(steps)
        while True:
            answers: list[HitAnswer | BaseException] = []
            for part in asked:
                try:
                    answers.append(self._tier.query_hit(part))
                except Exception as error:  # handed to the plan, which gives back the rest
                    answers.append(error)
            try:
                asked = steps.send(answers)
            except StopIteration as done:
                return done.value

    async def query_hit_async(self, request: HitRequest) -> HitAnswer:
        hits = self._async
        loop = asyncio.get_running_loop()
        if hits is None:
            return await loop.run_in_executor(None, self.query_hit, request)
        if request.block_count() > _INLINE_NAMESPACE_BLOCKS:
            # A large lookup's keys are renamed in the pool (the hash releases the GIL): on
            # the loop, 8,192 keys held every other request back ~1.2 ms per namespace.
            prepared = await loop.run_in_executor(None, self._prepare, request)
        else:
            prepared = self._prepare(request)
        steps = self._steps(prepared)
        asked = next(steps)
        while True:
            if len(asked) == 1:  # one part: awaited as it is (no task for the loop)
                try:
                    answers: list[HitAnswer | BaseException] = [
                        await hits.query_hit_async(asked[0])
                    ]
                except Exception as error:  # handed to the plan, as from a thread
                    answers = [error]
            else:
                # The parts of one step at once: they coalesce into one round of cluster calls.
                answers = list(
                    await asyncio.gather(
                        *(hits.query_hit_async(part) for part in asked), return_exceptions=True
                    )
                )
            try:
                asked = steps.send(answers)
            except StopIteration as done:
                return done.value

    def _steps(
        self, asked: _Asked
    ) -> Generator[list[HitRequest], list[HitAnswer | BaseException], HitAnswer]:
        """The question in the tier's terms, one step at a time: it yields the requests to ask
        together and is sent their answers (or errors), so the same rule runs from a thread
        and from an asyncio loop. A tenant reading the shared namespace asks both namespaces
        at once; the mixed run (shared blocks, then its own) only when the shared run ends
        inside the prompt. Every lease not answered with is given back."""
        if asked.shared is None:
            (own,) = yield [asked.to_tier(asked.own)]
            return self._finish(asked, _answer(own))
        first, own = yield [
            asked.to_tier(asked.shared, asked.words.shape[0]),
            asked.to_tier(asked.own),
        ]
        failed = [answer for answer in (first, own) if isinstance(answer, BaseException)]
        if failed:
            for answer in (first, own):
                if isinstance(answer, HitAnswer):
                    self._give_back(answer)
            raise failed[0]
        assert isinstance(first, HitAnswer) and isinstance(own, HitAnswer)
        run, within = _runs(first, asked.words.shape[0])
        if run == 0:
            self._give_back(first)
            return self._finish(asked, own)
        self._give_back(own)
        if run >= within:
            return self._finish(asked, first)
        self._give_back(first)
        mixed = np.concatenate([asked.shared[:run], asked.own[run:]])
        (answer,) = yield [asked.to_tier(mixed, run)]
        return self._finish(asked, _answer(answer))

    def _prepare(self, request: HitRequest) -> _Asked:
        tenant = self.tenant
        traffic_class = self._traffic_class(request.traffic_class)
        layout = self.layout(request.layout)
        words = request.words(layout.fingerprint)
        own_salt, shared_salt = self._salts(layout)
        shared = namespaced(shared_salt, words) if tenant.reads_shared else None
        # The cap is taken with the lease, in the tier's one table (concurrent asks cannot
        # slip past it).
        holder = LeaseTag(tenant.name, tenant.max_leases or DEFAULT_MAX_LEASES)
        return _Asked(request, traffic_class, words, namespaced(own_salt, words), shared, holder)

    def _finish(self, asked: _Asked, answer: HitAnswer) -> HitAnswer:
        """Count the question once, give back the caller's keys."""
        self._tier.hit_counters.count(
            self.tenant.name, asked.traffic_class, answer.plan, asked.words.shape[0]
        )
        hit = len(answer.hit_keys)
        # The grant names the stored keys (this tenant's namespace), which the engine reads
        # by; it passes only with a lease this tenant holds (its capability is that lease's).
        direct = answer.direct
        if direct is not None and (
            answer.lease_id is None or self.lease_tag(answer.lease_id) is None
        ):
            direct = None
        return dataclasses.replace(answer, hit_keys=asked.words[:hit], direct=direct)

    def _give_back(self, answer: HitAnswer) -> None:
        if answer.lease_id is not None:
            self._tier.release_lease(answer.lease_id)

    def lease_tag(self, lease_id: str) -> LeaseTag | None:
        """The tag of ``lease_id`` if this tenant holds it (None: another's, or not open)."""
        tag = self._tier.lease_tag(lease_id)
        return tag if tag is not None and tag.tenant == self.tenant.name else None

    def open_leases(self, tenant: str) -> int:
        return self._tier.open_leases(tenant) if tenant == self.tenant.name else 0

    def release_lease(self, lease_id: str) -> bool:
        if self.lease_tag(lease_id) is None:
            return False  # unknown, expired, or another tenant's
        return self._tier.release_lease(lease_id)

    # --- TierReader ----------------------------------------------------------------------------

    def get_blocks(
        self,
        keys: Sequence[bytes],
        lease_id: str | None = None,
        *,
        keep_lease: bool = False,
        layout: Layout | None = None,
    ) -> list[BlockRead]:
        checked = check_keys(keys, "keys")
        tenant = self.tenant
        own_salt, shared_salt = self._salts(self.layout(layout))
        lease = self.lease_tag(lease_id) if lease_id else None
        if lease_id and lease is None and not self._foreign_leases:
            raise LeaseError(f"lease {lease_id!r} is unknown or has expired; query again")
        shared_of = lease.shared if lease is not None else frozenset()
        own = namespaced(own_salt, key_words(checked)) if checked else np.empty((0, 4))
        stored = words_to_keys(own)
        if shared_of:
            shared = words_to_keys(namespaced(shared_salt, key_words(checked)))
            stored = [
                s if k in shared_of else o for k, o, s in zip(checked, stored, shared, strict=True)
            ]
        reads = self._tier.get_blocks(stored, lease_id, keep_lease=keep_lease)
        if tenant.reads_shared and lease is None:
            # Read without this tenant's lease: a block missing from its own namespace may be
            # a shared one.
            missing = [i for i, read in enumerate(reads) if not read.found]
            if missing:
                words = namespaced(shared_salt, key_words([checked[i] for i in missing]))
                for i, read in zip(
                    missing, self._tier.get_blocks(words_to_keys(words)), strict=True
                ):
                    if read.found:
                        reads[i] = read
        return [
            dataclasses.replace(read, key=key) for key, read in zip(checked, reads, strict=True)
        ]

    def get_swa_state(
        self, key: bytes, position: int, *, layout: Layout | None = None
    ) -> StateRead:
        key = check_key(key)
        chosen = self.layout(layout)
        size = self._state_size(chosen)
        own_salt, shared_salt = self._salts(chosen)
        read = self._tier.get_swa_state(namespaced_key(own_salt, key), position, state_bytes=size)
        if read.state is None and self.tenant.reads_shared:
            shared = self._tier.get_swa_state(
                namespaced_key(shared_salt, key), position, state_bytes=size
            )
            if shared.state is not None:
                return shared
        return read

    # --- TierWriter ----------------------------------------------------------------------------

    def put_blocks(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[bytes],
        traffic_class: str = "",
        *,
        shared: bool = False,
        layout: Layout | None = None,
    ) -> PutAnswer:
        """Write blocks into the tenant's namespace (``shared``: into the shared one, for the
        trusted writer role) under ``layout`` (None: the tier's own). Every payload must be
        exactly one block of that layout."""
        checked = check_keys(keys, "keys")
        if len(payloads) != len(checked):
            raise InvalidArgument("payloads", f"{len(payloads)} payloads for {len(checked)} keys")
        name = self._traffic_class(traffic_class)
        chosen = self.layout(layout)
        size = chosen.block_bytes
        for index, payload in enumerate(payloads):
            if len(payload) != size:
                raise InvalidArgument(
                    f"payloads[{index}]",
                    f"must be one block of its layout ({size} bytes), got {len(payload)}",
                )
        if len(set(checked)) != len(checked):
            raise InvalidArgument("keys", "a key is given twice in one put")
        salt = self._salt_to_write(shared, chosen)
        stored = words_to_keys(namespaced(salt, key_words(checked))) if checked else []
        with self._bytes_reserved(size * len(checked)):
            answer = self._tier.put_blocks(stored, payloads, name)
            with self._lock:
                self._put_since_usage += size * answer.stored
        back = dict(zip(stored, checked, strict=True))
        return PutAnswer(
            stored=answer.stored,
            existing=answer.existing,
            busy_keys=tuple(back[key] for key in answer.busy_keys),
            under_redundant=answer.under_redundant,
            failed_keys=tuple(back[key] for key in answer.failed_keys),
        )

    def put_swa_state(
        self,
        key: bytes,
        position: int,
        state: bytes,
        machine: str | None = None,
        *,
        shared: bool = False,
        layout: Layout | None = None,
    ) -> str:
        """Store a state under ``layout`` (None: the tier's own): exactly its state size, in
        the tenant's share of the SWA stores and within its bytes quota."""
        chosen = self.layout(layout)
        if len(state) != chosen.state_bytes:
            held = (
                "keeps no SWA state"
                if chosen.state_bytes == 0
                else (f"takes states of exactly {chosen.state_bytes} bytes")
            )
            raise InvalidArgument(
                "state", f"its layout {held}; got {len(state)} bytes at position {position}"
            )
        salt = self._salt_to_write(shared, chosen)
        with self._bytes_reserved(len(state)):
            where = self._tier.put_swa_state(
                namespaced_key(salt, check_key(key)),
                position,
                state,
                machine,
                state_bytes=self._state_size(chosen),
                owner=self.tenant.name,
            )
            with self._lock:
                self._put_since_usage += len(state)
        return where

    # --- figures -------------------------------------------------------------------------------

    def stats(self) -> Stats:
        """The tenant's own figures: its lookups and hits, the bytes of the classes the
        operator gave it, the tier's health. An admin tenant sees the whole tier."""
        base = self._tier.stats()
        if self.tenant.admin:
            return base
        mine = set(self.tenant.classes or ())
        exclusive = set(self.tenant.exclusive_classes)
        counted = self._tier.hit_counters.by_class(self.tenant.name)
        classes: dict[str, dict[str, Any]] = {}
        for name in sorted(mine | set(counted)):
            figures = counted.get(name, {})
            theirs = base.classes.get(name, {}) if name in exclusive else {}
            classes[name] = class_stats(figures)
            # A class's own figures (bytes, evictions, expiries) are the tenant's only if no
            # other tenant may use the class: never those of a class others share.
            classes[name]["miss_reasons"] = dict(theirs.get("miss_reasons", {}))
            classes[name]["stored_bytes"] = int(theirs.get("stored_bytes", 0))
        return Stats(
            classes=classes,
            block_bytes_stored=sum(figures["stored_bytes"] for figures in classes.values()),
            swa_bytes_stored=_swa_bytes(base, self.tenant.name),
            degraded_reads=base.degraded_reads,
            repairs_done=base.repairs_done,
            repairs_pending=base.repairs_pending,
            live_storage_nodes=base.live_storage_nodes,
            storage_nodes=base.storage_nodes,
            extra={
                "tenant": self.tenant.name,
                "open_leases": self._tier.open_leases(self.tenant.name),
                "model_fingerprint": self.model_fingerprint.hex(),
                "block_bytes": self.block_bytes,
            },
        )

    # --- policy --------------------------------------------------------------------------------

    def _traffic_class(self, asked: str) -> str:
        try:
            return self.tenant.traffic_class(asked)
        except PermissionError as error:
            raise Forbidden(str(error)) from None

    def layout(self, layout: Layout | None) -> Layout:
        """The layout a request is made under (one that names none: the tier's own)."""
        return self.default_layout if layout is None else layout

    def _salts(self, layout: Layout) -> tuple[bytes, bytes]:
        """(own, shared) namespaces of ``layout``: the tenant's own for the tier's layout (so
        what was stored before layouts existed is found), one per layout inside it otherwise."""
        tenant = self.tenant
        if layout == self.default_layout:
            return tenant.salt, tenant.shared_salt
        return layout.salt(tenant.salt), layout.salt(tenant.shared_salt)

    def _state_size(self, layout: Layout) -> int | None:
        """The state size to hand the tier (None: its own)."""
        return None if layout == self.default_layout else layout.state_bytes

    def _salt_to_write(self, shared: bool, layout: Layout) -> bytes:
        tenant = self.tenant
        own, shared_salt = self._salts(layout)
        if not shared:
            return own
        if tenant.shared != "write":
            raise Forbidden(f"tenant {tenant.name!r} may not write the shared namespace")
        return shared_salt

    @contextlib.contextmanager
    def _bytes_reserved(self, incoming: int) -> Iterator[None]:
        """Hold ``incoming`` bytes of the tenant's quota while a put runs: checked and taken in
        one step under the view's lock, so concurrent puts can never pass the quota together
        (each sees the others' reservations); given back when the put is done (what it stored
        is counted by then)."""
        tenant = self.tenant
        if tenant.max_bytes is None:
            yield
            return
        self._refresh_usage()
        with self._lock:
            assert self._usage is not None
            used = self._usage[1] + self._put_since_usage + self._reserved
            if used + incoming > tenant.max_bytes:
                raise Overloaded(
                    f"tenant {tenant.name!r} stores or is writing {used} of its "
                    f"{tenant.max_bytes} bytes: {incoming} more do not fit (GC frees its oldest "
                    "blocks as they expire, the SWA stores its idle states)"
                )
            self._reserved += incoming
        try:
            yield
        finally:
            with self._lock:
                self._reserved -= incoming

    def _refresh_usage(self) -> None:
        """Bytes stored in the tenant's classes and its SWA states, from the tier's figures
        when these are over a second old; what this view wrote since the figures were asked
        for is counted beside them (``_put_since_usage``), whatever they already hold of it
        (over, never under)."""
        usage = self._usage
        now = time.monotonic()
        if usage is not None and now - usage[0] <= _USAGE_MAX_AGE_S:
            return
        with self._lock:
            written_before = self._put_since_usage
        stats = self._tier.stats()
        total = _swa_bytes(stats, self.tenant.name) + sum(
            int(stats.classes.get(name, {}).get("stored_bytes", 0))
            for name in self.tenant.classes or ()
        )
        with self._lock:
            self._usage = (now, total)
            # Puts that finished while the figure was asked for may be missing from it.
            self._put_since_usage -= written_before


class TenantViews:
    """One ``TenantView`` per tenant over one tier, made on first use and kept (its leases
    and figures live with it); a tenant whose policy changed in the tokens file gets it."""

    def __init__(self, tier: Tier, *, foreign_leases: bool = False) -> None:
        self.tier = tier
        self._foreign_leases = foreign_leases
        self._views: dict[str, TenantView] = {}
        self._lock = threading.Lock()

    def view(self, tenant: Tenant) -> TenantView:
        view = self._views.get(tenant.name)
        if view is None:
            with self._lock:
                view = self._views.get(tenant.name)
                if view is None:
                    view = TenantView(
                        self.tier,
                        tenant,
                        foreign_leases=self._foreign_leases,
                    )
                    self._views[tenant.name] = view
        if view.tenant is not tenant:
            view.tenant = tenant  # reloaded tokens file: same salts, maybe new policy
        return view


def _swa_bytes(stats: Stats, owner: str) -> int:
    """Bytes of SWA states ``owner`` holds in the tier's stores (``SWAClient.stats``; none in a
    tier without them)."""
    return int(stats.extra.get("swa", {}).get("bytes_by_owner", {}).get(owner, 0))


def _answer(outcome: HitAnswer | BaseException) -> HitAnswer:
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def _runs(answer: HitAnswer, keys: int) -> tuple[int, int]:
    """(blocks in the answer's leading run, blocks looked up: those of ``keys`` within the
    cap)."""
    block = answer.plan.block_tokens
    return answer.plan.block_hit_tokens // block, min(keys, answer.plan.cap // block)
