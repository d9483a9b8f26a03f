"""``ClusterTier``: the deployed tier (block store + SWA tier) behind the one seam.

The gRPC gateway serves it, the engine connector's fetcher reads through it, the demo and the
chaos load drive it. It owns what every caller of the cluster needs once:

- the **lease table**, the tier's only one: a lease is an id to its callers, a ``Lease`` with
  shard locations inside (so a read with the lease needs no second meta round trip), tagged
  with the tenant holding it; bounded, swept on a timer (``kvstore.tier.leases``);
- **coalescing**: concurrent ``query_hit`` calls share one round of meta-shard and directory
  calls (``kvstore.tier.coalesce``), so the cluster's call rate stays flat as concurrency grows;
- the **answer translations** (``HitResult.answer``, ``PutAnswer`` from the block client's
  ``PutResult``) and the hit figures (``kvstore.tier.counters``, per tenant and class);
- the merge of every part's figures into one ``Stats``.

It holds no Ray: the block client reaches its nodes through a ``Fanout``, the SWA client
through an ``SWATransport``, and the figures that only the control plane has (meta-shard and
repair statistics) come through a ``TierControl``. ``kvstore.runtime.tiers`` wires it to Ray;
the unit tests wire it to in-process objects.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from kvstore.blockstore.capability import ReadCapability, mint_for_lease
from kvstore.blockstore.client import BlockStoreClient
from kvstore.blockstore.records import Lease, PutResult
from kvstore.clock import Clock, SystemClock
from kvstore.errors import InvalidArgument, LeaseError, Overloaded, StoreError
from kvstore.hitplan import check_store_position
from kvstore.keys import BlockKey, check_key, check_keys, state_slot
from kvstore.pending import Pending
from kvstore.swa.client import SWAClient
from kvstore.swa.directory import StoreRef
from kvstore.tier.coalesce import Coalesced
from kvstore.tier.counters import HitCounters, class_stats
from kvstore.tier.hit import HitGeometry, HitQuery, HitResult, NoStates
from kvstore.tier.leases import MAX_OPEN_LEASES, LeaseTable
from kvstore.tier.records import (
    BlockRead,
    DirectGrant,
    HitAnswer,
    HitRequest,
    LeaseTag,
    PutAnswer,
    StateRead,
    Stats,
)
from kvstore.tier.revoke import Revoker

log = logging.getLogger(__name__)

#: Why a block read came back empty, as the gateway reports it.
UNREADABLE = "unreadable_or_missing"


class TierControl(Protocol):
    """Figures only the control plane has. Each answers None for a part that did not answer."""

    def meta_stats(self) -> list[dict[str, Any] | None]:
        """Every meta shard's ``stats()``."""
        ...

    def repair_stats(self) -> dict[str, Any] | None: ...


class NoControl:
    """No control plane to ask (a tier seen from an engine process): no such figures."""

    def meta_stats(self) -> list[dict[str, Any] | None]:
        return []

    def repair_stats(self) -> dict[str, Any] | None:
        return None


class _CoalescedBlocks:
    """``BlockLookup`` for one traffic class, through the tier's shared lookup coalescer."""

    def __init__(self, tier: ClusterTier, traffic_class: str) -> None:
        self._tier = tier
        self._traffic_class = traffic_class

    def lookup(self, keys: np.ndarray) -> Pending[tuple[int, Any]]:
        found = self._tier._lookups.call((keys, self._traffic_class))
        return found.then(lambda result: (int(result.hit_blocks), result.lease))

    def release(self, lease: Any) -> None:
        self._tier._release(lease)


class _CoalescedStates:
    """``StateLocator`` through the tier's shared directory-lookup coalescer (a state is kept
    under its key bound to its position, ``kvstore.keys.state_slot``)."""

    def __init__(self, tier: ClusterTier) -> None:
        self._tier = tier

    def locate(
        self, key: BlockKey, position: int, prefer_machine: str | None = None
    ) -> Pending[StoreRef | None]:
        return self._tier._locates.call(state_slot(key, position))


class ClusterTier:
    """``kvstore.tier.protocols.Tier`` over a deployed block tier and (optionally) SWA tier.
    Thread-safe: the gateway calls it from a pool of threads."""

    def __init__(
        self,
        *,
        blocks: BlockStoreClient,
        swa: SWAClient | None,
        geometry: HitGeometry,
        state_size: int,
        block_bytes: int,
        control: TierControl | None = None,
        max_open_leases: int = MAX_OPEN_LEASES,
        clock: Clock | None = None,
        foreign_leases: bool = False,
        machine_addresses: Mapping[str, str] | None = None,
        read_key: bytes | None = None,
        read_endpoints: Callable[[], Mapping[int, tuple[str, int]]] | None = None,
        revoker: Revoker | None = None,
    ) -> None:
        """``foreign_leases``: this tier reads for another process that took the leases (an
        engine's fetcher process; its scheduler-side tier holds the leases and releases them
        after the load), so a lease id it does not know is read without a lease instead of
        being refused (the gateway refuses: NOT_FOUND). ``machine_addresses``: IP address →
        machine id of the machines with an SWA store (``machine_at``). ``read_key``: the
        cluster read key (``kvstore.blockstore.capability``), for minting the read capability
        of a lease (``read_capability``); None: this tier mints none (an engine's own tier
        never holds the key). ``read_endpoints``: the nodes' engine read sockets as they are now
        (a restarted node listens on another port), and ``revoker``: where a released lease's
        capability is revoked on the nodes; with both and the key, a lease asked for
        ``direct``ly is answered with its ``DirectGrant``."""
        self._machine_addresses = dict(machine_addresses or {})
        self._read_key = read_key
        self._read_endpoints = read_endpoints
        self._revoker = revoker
        # Leases whose capability was handed out: only their release is worth a revocation.
        self._granted: set[str] = set()
        self.model_fingerprint = geometry.fingerprint()
        self.state_size = state_size
        self.block_bytes = block_bytes
        self.lease_seconds = blocks.config.lease_seconds
        self._geometry = geometry
        self._blocks = blocks
        self._swa = swa
        self._control = control or NoControl()
        self._classes = tuple(blocks.config.traffic_classes)
        self._storage_nodes = blocks.config.storage_nodes
        self._clock = clock or SystemClock()
        self._leases: LeaseTable[Lease] = LeaseTable(max_open_leases, self._clock)
        self.hit_counters = HitCounters()
        self._degraded_reads = 0
        self._lock = threading.Lock()
        # Concurrent QueryHits (threads, or the gateway's loop) share one round of meta-shard
        # and directory calls.
        self._lookups: Coalesced[tuple[np.ndarray, str], Any] = Coalesced(blocks.lookups)
        self._locates: Coalesced[BlockKey, StoreRef | None] = Coalesced(
            lambda keys: (
                swa.lookup(list(keys)) if swa is not None else Pending.done([None] * len(keys))
            )
        )
        # One hit query per traffic class, built once (it hashes the geometry's fingerprint).
        states = _CoalescedStates(self) if swa is not None else NoStates()
        self._queries = {
            name: HitQuery(
                blocks=_CoalescedBlocks(self, name),
                states=states,
                geometry=geometry,
                advisor=None if swa is None else swa.advisor,
                local_machine=None if swa is None else swa.local_machine,
            )
            for name in self._classes
        }
        # Leases nobody gives back leave the table on a timer, not only when others come.
        self._sweep_every = max(1.0, blocks.config.lease_seconds / 4)
        self._closed = threading.Event()
        self._sweeper: threading.Thread | None = None
        self._foreign_leases = foreign_leases

    def machine_at(self, address: str) -> str | None:
        """The machine (with an SWA store) at IP ``address``, if one is known: a state put
        from there is kept in that machine's memory, the one that produced it."""
        return self._machine_addresses.get(address)

    @property
    def local_machine(self) -> str | None:
        return None if self._swa is None else self._swa.local_machine

    # --- helpers -------------------------------------------------------------------------------

    def _class(self, traffic_class: str) -> str:
        name = traffic_class or "default"
        if name not in self._classes:
            raise InvalidArgument(
                "traffic_class", f"unknown class {name!r}; known: {', '.join(self._classes)}"
            )
        return name

    def _release(self, lease: Lease | None) -> None:
        # Deferred: it rides on the next lookup to each meta shard (``release_batch_s``), so
        # a release costs no cluster call of its own under load.
        if lease is not None:
            self._blocks.release_many([lease], wait=False)
            self._revoke(lease)

    def _revoke(self, lease: Lease) -> None:
        """The nodes stop honouring ``lease``'s capability, if one was handed out (a lease past
        its end needs nothing: every node refuses it already)."""
        if self._revoker is None or not self._granted:
            return
        with self._lock:
            if lease.lease_id not in self._granted:
                return
            self._granted.discard(lease.lease_id)
        if lease.until > self._clock.now():
            self._revoker.revoke(lease.lease_id, float(lease.until))

    def _keep_lease(self, lease: Lease, holder: LeaseTag) -> str:
        try:
            dropped = self._leases.add(lease, holder)
        except Overloaded:  # the holder is at its cap: this lease is not handed out
            self._release(lease)
            raise
        for old in dropped:
            self._release(old)
        if self._sweeper is None:
            with self._lock:
                if self._sweeper is None:
                    self._sweeper = threading.Thread(
                        target=self._sweep_loop, name="lease-sweep", daemon=True
                    )
                    self._sweeper.start()
        return lease.lease_id

    def sweep_leases(self) -> int:
        """Drop the leases past their end and give them back; returns how many. The sweeper
        thread runs it every quarter lease length."""
        expired = self._leases.sweep()
        for lease in expired:
            self._release(lease)
        return len(expired)

    def _sweep_loop(self) -> None:
        while not self._closed.wait(self._sweep_every):
            try:
                self.sweep_leases()
            except Exception:  # a control loop survives a failing step
                log.exception("sweeping expired leases failed")

    def close(self) -> None:
        """Stop the lease sweeper and send every release still deferred."""
        self._closed.set()
        if self._revoker is not None:
            self._revoker.close()
        stop = getattr(self._read_endpoints, "close", None)  # a refreshing map's thread
        if callable(stop):
            stop()
        try:
            self._blocks.flush_releases()
        except StoreError:
            log.info("releases not sent at close", exc_info=True)

    # --- HitSource -----------------------------------------------------------------------------

    def query_hit(self, request: HitRequest) -> HitAnswer:
        name = self._class(request.traffic_class)
        return self._answer(name, self._queries[name].query_hit(request), request)

    async def query_hit_async(self, request: HitRequest) -> HitAnswer:
        """``query_hit`` for a caller on an asyncio loop (the gateway's hit path): the same
        answer, no thread parked on the cluster's replies."""
        name = self._class(request.traffic_class)
        return self._answer(name, await self._queries[name].query_hit_async(request), request)

    def _answer(self, name: str, result: HitResult, request: HitRequest) -> HitAnswer:
        """Keep or give back the lookup's lease, count it, and answer."""
        lease: Lease | None = result.lease
        lease_id = None
        if lease is not None:
            if request.take_lease and len(lease):
                lease_id = self._keep_lease(lease, request.holder)
            else:
                self._release(lease)
        if request.counted:
            self.hit_counters.count(request.holder.tenant, name, result.plan, result.keys.shape[0])
        answer = result.answer(lease_id)
        if lease_id is not None and request.direct:
            grant = self._direct_grant(lease_id, result.hit_words)
            if grant is not None:
                answer = dataclasses.replace(answer, direct=grant)
        return answer

    def _direct_grant(self, lease_id: str, hit_words: np.ndarray) -> DirectGrant | None:
        """The ``DirectGrant`` of the lease just kept for the hit blocks ``hit_words``; None when
        this tier cannot grant one (no key, no endpoints, no revoker: a capability nobody could
        revoke must not be handed out), the lease is already gone, or the grant would not fit
        (the engine then reads through ``get_blocks``)."""
        if self._read_key is None or self._read_endpoints is None or self._revoker is None:
            return None
        lease = self._leases.peek(lease_id)
        n = int(hit_words.shape[0])
        if lease is None or n == 0 or n > len(lease):
            return None
        # The lease holds the run from the prompt's start, so the hit blocks are its first rows.
        if not np.array_equal(lease.key_words[:n], hit_words):
            log.warning("lease %s does not start with its hit blocks: no direct grant", lease_id)
            return None
        try:
            endpoints = self._read_endpoints()
            with self._lock:
                self._granted.add(lease_id)  # before it is handed out: its release revokes it
            capability = self.read_capability(lease_id)
        except (InvalidArgument, StoreError) as error:
            log.info("lease %s: no direct grant: %s", lease_id, error)
            capability = None
        if capability is None or not endpoints:
            return None
        if self._leases.peek(lease_id) is None:  # released meanwhile: its revocation may be out
            return None
        config = self._blocks.config
        return DirectGrant(
            capability=capability.encode(),
            keys=np.ascontiguousarray(lease.key_words[:n]),
            placements=np.ascontiguousarray(lease.placements[:n], dtype=np.int32),
            sizes=np.ascontiguousarray(lease.sizes[:n], dtype=np.int64),
            endpoints=dict(endpoints),
            k=config.data_shards,
            m=config.parity_shards,
        )

    def read_capability(self, lease_id: str) -> ReadCapability | None:
        """The read capability of a lease this tier holds: its tenant may read every shard of
        its blocks straight from the node the lookup placed it on, until the lease ends
        (``capability.mint_for_lease``). None when this tier has no read key or the lease is
        unknown (taken, released, swept): the engine then reads through ``get_blocks``."""
        if self._read_key is None:
            return None
        lease = self._leases.peek(lease_id)
        tag = self._leases.tag(lease_id)
        if lease is None or tag is None:
            return None
        return mint_for_lease(self._read_key, lease, tag.tenant, self._clock.now())

    def lease_tag(self, lease_id: str) -> LeaseTag | None:
        return self._leases.tag(lease_id)

    def open_leases(self, tenant: str) -> int:
        return self._leases.held(tenant)

    def release_lease(self, lease_id: str) -> bool:
        lease = self._leases.take(lease_id)
        if lease is None:
            return False
        self._release(lease)
        return True

    # --- TierReader ----------------------------------------------------------------------------

    def get_blocks(
        self, keys: Sequence[bytes], lease_id: str | None = None, *, keep_lease: bool = False
    ) -> list[BlockRead]:
        checked = check_keys(keys, "keys")
        lease = None
        if lease_id:
            lease = self._leases.peek(lease_id) if keep_lease else self._leases.take(lease_id)
        if lease_id and lease is None and not self._foreign_leases:
            raise LeaseError(f"lease {lease_id!r} is unknown or has expired; query again")
        try:
            outcome = self._blocks.read(checked, lease)
        finally:
            if not keep_lease:
                self._release(lease)  # the read is done: GC may collect again
        degraded = sum(outcome.degraded)
        if degraded:
            with self._lock:
                self._degraded_reads += degraded
        return [
            BlockRead(key=key, payload=payload.tobytes(), degraded=was_degraded)
            if payload is not None
            else BlockRead(
                key=key, payload=None, miss_reason=UNREADABLE, miss_detail=outcome.why.get(p)
            )
            for p, (key, payload, was_degraded) in enumerate(
                zip(checked, outcome.payloads, outcome.degraded, strict=True)
            )
        ]

    def get_swa_state(
        self, key: bytes, position: int, *, state_bytes: int | None = None
    ) -> StateRead:
        check_store_position(position, "position", block_tokens=self._geometry.block_tokens)
        if self._swa is None:
            return StateRead(state=None, miss_reason="no_swa_tier")
        # Kept under its key bound to its position: another position's state is a miss.
        fetched = self._swa.get(state_slot(check_key(key), position), state_bytes=state_bytes)
        if fetched is None:
            return StateRead(state=None, miss_reason="not_in_directory_or_owner_lost")
        return StateRead(state=fetched.blob.tobytes(), owner=fetched.owner.machine_id)

    # --- TierWriter ----------------------------------------------------------------------------

    def put_blocks(
        self, keys: Sequence[bytes], payloads: Sequence[bytes], traffic_class: str = ""
    ) -> PutAnswer:
        name = self._class(traffic_class)
        return put_answer(self._blocks.put_blocks(keys, payloads, name))

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
        check_store_position(position, "position", block_tokens=self._geometry.block_tokens)
        key = check_key(key)
        if self._swa is None:
            raise StoreError("this tier has no SWA tier to store the state in")
        stores = self._swa.machines
        target = machine or self.local_machine
        if target is None:
            # The writer did not say where it runs: spread states over the machines by key.
            target = max(stores, key=lambda m: hashlib.blake2b(key + m.encode()).digest())
        elif target not in stores:
            raise InvalidArgument("machine", f"no SWA store on {target!r}; known: {stores}")
        slot = state_slot(key, position)
        self._swa.put(
            target,
            slot,
            position,
            np.frombuffer(state, dtype=np.uint8),
            state_bytes=state_bytes,
            owner=owner,
        )
        return target

    # --- figures -------------------------------------------------------------------------------

    def stats(self) -> Stats:
        metas = self._control.meta_stats()
        repair = self._control.repair_stats()
        classes: dict[str, dict[str, Any]] = {}
        counted = self.hit_counters.by_class()
        for name in self._classes:
            classes[name] = class_stats(counted.get(name, {}))
            classes[name]["miss_reasons"] = defaultdict(int, classes[name]["miss_reasons"])
        with self._lock:
            degraded = self._degraded_reads
        block_bytes = 0
        for meta in metas:
            if meta is None:
                continue
            block_bytes += int(meta.get("bytes", 0))
            for name, size in meta.get("bytes_by_class", {}).items():
                if name in classes:
                    classes[name]["stored_bytes"] += int(size)
            for name, reasons in meta.get("misses", {}).items():
                target = classes.get(name)
                if target is None:
                    continue
                for reason, count in reasons.items():
                    target["miss_reasons"][reason] += int(count)
        for figures in classes.values():
            figures["miss_reasons"] = dict(figures["miss_reasons"])
        dead = list(repair.get("dead_nodes", [])) if repair else []
        down = set(self._blocks.down_nodes()) | set(dead)
        swa = self._swa_stats()
        return Stats(
            classes=classes,
            block_bytes_stored=block_bytes,
            swa_bytes_stored=int(swa.get("used_bytes", 0)),
            degraded_reads=degraded,
            repairs_done=int(repair.get("stripes", 0)) if repair else 0,
            repairs_pending=_pending(repair, dead),
            live_storage_nodes=self._storage_nodes - len(down),
            storage_nodes=self._storage_nodes,
            extra={
                "model_fingerprint": self.model_fingerprint.hex(),
                "block_bytes": self.block_bytes,
                "open_leases": len(self._leases),
                "meta_shards_answering": sum(meta is not None for meta in metas),
                "dead_nodes": sorted(dead),
                "repair": repair or {},
                "client": self._blocks.stats(),
                "swa": swa,
                # Which machine a state put from an address is kept on (``machine_at``).
                "machines_by_address": dict(self._machine_addresses),
                # How well concurrent QueryHits share cluster calls: requests per batch.
                "coalescing": self._coalescing(),
            },
        )

    def _coalescing(self) -> dict[str, dict[str, int]]:
        """How well concurrent QueryHits share cluster calls: requests per batch (threaded
        callers and the gateway's loop together)."""
        return {
            name: {"batches": coalesced.batches, "requests": coalesced.items}
            for name, coalesced in (("lookups", self._lookups), ("locates", self._locates))
        }

    def _swa_stats(self) -> dict[str, Any]:
        if self._swa is None:
            return {}
        try:
            return self._swa.stats()
        except StoreError:
            log.info("SWA figures unavailable", exc_info=True)
            return {}


def put_answer(result: PutResult) -> PutAnswer:
    """The block client's ``PutResult`` as the seam's ``PutAnswer``."""
    return PutAnswer(
        stored=len(result.stored),
        existing=len(result.existing),
        busy_keys=tuple(result.busy),
        failed_keys=tuple(result.failed),
        under_redundant=len(result.under_redundant),
    )


def _pending(repair: dict[str, Any] | None, dead: list[int]) -> int:
    """Stripes still to repair or move (the repair queues' figure); the dead nodes, from a
    repair loop that does not report one."""
    progress = (repair or {}).get("progress")
    if isinstance(progress, dict) and "stripes_left" in progress:
        return int(progress["stripes_left"])
    return len(dead)
