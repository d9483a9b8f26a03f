"""The gateway's backend on a real cluster: the in-cluster block and SWA clients behind one facade.

It owns what only a gateway needs: the table of leases handed out over gRPC (a lease id is a
string on the wire; the in-cluster ``Lease`` carries the shard locations), the per-class hit
counters of QueryHit, and the merge of every tier's figures into one ``Stats``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from kvstore.api.backend import BlockRead, HitAnswer, PutAnswer, StateRead, Stats
from kvstore.api.coalesce import Coalescer
from kvstore.blockstore.client import BlockStoreClient
from kvstore.blockstore.records import Lease
from kvstore.errors import InvalidArgument, LeaseError, StoreError
from kvstore.geometry import GeometryConfig
from kvstore.hitplan import MODES, check_store_position
from kvstore.keys import BlockKey
from kvstore.swa.client import SWAClient
from kvstore.swa.directory import StoreRef
from kvstore.swa.hit import HitQuery

log = logging.getLogger(__name__)

#: Leases the gateway remembers at most (older ones are released first when it is full).
MAX_OPEN_LEASES = 100_000
_STATS_TIMEOUT_S = 5.0


class _LeaseTable:
    """lease id → in-cluster ``Lease``; expired entries are dropped as new ones arrive."""

    def __init__(self, capacity: int = MAX_OPEN_LEASES) -> None:
        self._leases: OrderedDict[str, Lease] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def add(self, lease: Lease) -> list[Lease]:
        """Remember ``lease``; returns leases pushed out (expired or over capacity) to release."""
        dropped = []
        now = time.time()
        with self._lock:
            self._leases[lease.lease_id] = lease
            while self._leases:
                oldest_id, oldest = next(iter(self._leases.items()))
                if oldest.until >= now and len(self._leases) <= self._capacity:
                    break
                del self._leases[oldest_id]
                dropped.append(oldest)
        return dropped

    def take(self, lease_id: str) -> Lease | None:
        with self._lock:
            return self._leases.pop(lease_id, None)

    def __len__(self) -> int:
        return len(self._leases)


class _CoalescedBlocks:
    """``BlockLookup`` for one traffic class, through the gateway's shared lookup coalescer."""

    def __init__(self, backend: ClusterBackend, traffic_class: str) -> None:
        self._backend = backend
        self._traffic_class = traffic_class

    def lookup(self, keys: np.ndarray) -> tuple[int, Any]:
        result = self._backend._lookups.call((keys, self._traffic_class))
        return int(result.hit_blocks), result.lease

    def release(self, lease: Any) -> None:
        self._backend._release(lease)


class _CoalescedStates:
    """``StateLocator`` through the gateway's shared directory-lookup coalescer."""

    def __init__(self, backend: ClusterBackend) -> None:
        self._backend = backend

    def locate(self, key: BlockKey, prefer_machine: str | None = None) -> StoreRef | None:
        return self._backend._locates.call(key)


class ClusterBackend:
    """``kvstore.api.backend.Backend`` over a deployed block tier and SWA tier."""

    def __init__(
        self,
        *,
        blocks: BlockStoreClient,
        swa: SWAClient,
        geometry: GeometryConfig,
        meta_handles: Sequence[Any],
        repair_handle: Any | None,
        storage_nodes: int,
        traffic_classes: Sequence[str],
    ) -> None:
        self.model_fingerprint = geometry.fingerprint()
        self.state_size = geometry.state_size_to_disk
        self._geometry = geometry
        self._blocks = blocks
        self._swa = swa
        self._metas = list(meta_handles)
        self._repair = repair_handle
        self._storage_nodes = storage_nodes
        self._classes = tuple(traffic_classes)
        self._leases = _LeaseTable()
        self._counters: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._degraded_reads = 0
        self._lock = threading.Lock()
        # Concurrent QueryHits share one round of meta-shard and directory calls.
        self._lookups: Coalescer[tuple[np.ndarray, str], Any] = Coalescer(blocks.lookup_many)
        self._locates: Coalescer[BlockKey, StoreRef | None] = Coalescer(
            lambda keys: swa.lookup(list(keys))
        )

    def _release(self, lease: Lease | None) -> None:
        # Deferred: it rides on the next lookup to each meta shard (``release_batch_s``), so
        # a ReleaseLease costs no cluster call of its own under load.
        if lease is not None:
            self._blocks.release_many([lease], wait=False)

    # --- helpers -----------------------------------------------------------------------------

    def _class(self, traffic_class: str) -> str:
        name = traffic_class or "default"
        if name not in self._classes:
            raise InvalidArgument(
                "traffic_class", f"unknown class {name!r}; known: {', '.join(self._classes)}"
            )
        return name

    def _count(self, traffic_class: str, **figures: int) -> None:
        with self._lock:
            for name, value in figures.items():
                self._counters[traffic_class][name] += value

    def _hit_query(self, traffic_class: str) -> HitQuery:
        return HitQuery(
            blocks=_CoalescedBlocks(self, traffic_class),
            states=_CoalescedStates(self),
            advisor=self._swa.advisor,
            geometry=self._geometry,
            local_machine=self._swa.local_machine,
        )

    # --- Backend -----------------------------------------------------------------------------

    def query_hit(
        self,
        keys: Sequence[BlockKey] | np.ndarray,
        prompt_len: int,
        mode: str,
        traffic_class: str,
        take_lease: bool,
    ) -> HitAnswer:
        name = self._class(traffic_class)
        if mode not in MODES:
            raise InvalidArgument("mode", f"must be one of {', '.join(MODES)}, got {mode!r}")
        result = self._hit_query(name).query_hit(keys, prompt_len, mode)
        plan = result.plan
        lease: Lease | None = result.lease
        hit_blocks = plan.block_hit_tokens // self._geometry.block_tokens
        looked_up = min(len(keys), plan.cap // self._geometry.block_tokens)
        self._count(name, lookups=1, hit_blocks=hit_blocks, miss_blocks=looked_up - hit_blocks)
        lease_id: str | None = None
        if lease is not None:
            if take_lease and len(lease):
                lease_id = lease.lease_id
                for old in self._leases.add(lease):
                    self._release(old)
            else:
                self._release(lease)
        advice = result.advice
        return HitAnswer(
            plan=plan,
            swa_owner=None if result.swa_owner is None else result.swa_owner.machine_id,
            advice=None if advice is None else advice.choice,
            fetch_seconds=0.0 if advice is None else advice.fetch_s,
            replay_seconds=0.0 if advice is None else advice.replay_s,
            lease_id=lease_id,
            hit_keys=result.lease.key_words[:hit_blocks]
            if hit_blocks and result.lease is not None
            else (),
        )

    def put_blocks(
        self, keys: list[BlockKey], payloads: list[bytes], traffic_class: str
    ) -> PutAnswer:
        name = self._class(traffic_class)
        result = self._blocks.put_blocks(keys, payloads, name)
        # "busy": another writer is storing that key right now; it becomes visible when that
        # writer commits, so it is neither committed by this call nor failed.
        committed = len(result.stored) + len(result.existing)
        return PutAnswer(committed=committed, failed_keys=tuple(result.failed))

    def get_blocks(self, keys: list[BlockKey], lease_id: str | None) -> list[BlockRead]:
        lease = self._leases.take(lease_id) if lease_id else None
        if lease_id and lease is None:
            raise LeaseError(f"lease {lease_id!r} is unknown or has expired; query again")
        degraded_before = self._blocks.counters.get("degraded_blocks", 0)
        try:
            payloads = self._blocks.get_blocks(keys, lease)
        finally:
            self._release(lease)  # the read is done: GC may collect again
        degraded = self._blocks.counters.get("degraded_blocks", 0) - degraded_before
        with self._lock:
            self._degraded_reads += int(degraded)
        return [
            BlockRead(
                key=key,
                payload=None if payload is None else payload.tobytes(),
                miss_reason=None if payload is not None else "unreadable_or_missing",
                degraded=payload is not None and degraded > 0,
            )
            for key, payload in zip(keys, payloads, strict=True)
        ]

    def put_swa_state(self, key: BlockKey, position: int, state: bytes, machine: str | None) -> str:
        check_store_position(position, "position", block_tokens=self._geometry.block_tokens)
        stores = sorted(self._swa.deployment.stores)
        if machine is None:
            # The engine did not say where it runs: spread states over the machines by key.
            machine = max(stores, key=lambda m: hashlib.blake2b(key + m.encode()).digest())
        elif machine not in stores:
            raise InvalidArgument("machine", f"no SWA store on {machine!r}; known: {stores}")
        self._swa.put(machine, key, position, state)
        return machine

    def get_swa_state(self, key: BlockKey, position: int) -> StateRead:
        check_store_position(position, "position", block_tokens=self._geometry.block_tokens)
        fetched = self._swa.get(key)
        if fetched is None:
            return StateRead(state=None, miss_reason="not_in_directory_or_owner_lost")
        return StateRead(state=fetched.blob.tobytes(), owner=fetched.owner.machine_id)

    def release_lease(self, lease_id: str) -> bool:
        lease = self._leases.take(lease_id)
        if lease is None:
            return False
        self._release(lease)
        return True

    def stats(self) -> Stats:
        metas = _gather([handle.stats.remote() for handle in self._metas])
        repair = _gather([self._repair.stats.remote()])[0] if self._repair is not None else None
        classes: dict[str, dict[str, Any]] = {}
        with self._lock:
            for name in self._classes:
                counters = self._counters.get(name, {})
                classes[name] = {
                    "lookups": counters.get("lookups", 0),
                    "hit_blocks": counters.get("hit_blocks", 0),
                    "miss_blocks": counters.get("miss_blocks", 0),
                    "miss_reasons": defaultdict(int),
                    "stored_bytes": 0,
                }
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
        return Stats(
            classes=classes,
            block_bytes_stored=block_bytes,
            swa_bytes_stored=self._swa_bytes(),
            degraded_reads=degraded,
            repairs_done=int(repair.get("stripes", 0)) if repair else 0,
            repairs_pending=len(dead),
            live_storage_nodes=self._storage_nodes - len(down),
            storage_nodes=self._storage_nodes,
            extra={
                "model_fingerprint": self.model_fingerprint.hex(),
                "open_leases": len(self._leases),
                "meta_shards_answering": sum(meta is not None for meta in metas),
                "dead_nodes": sorted(dead),
                "repair": repair or {},
                "client": self._blocks.stats(),
                # How well concurrent QueryHits share cluster calls: requests per batch.
                "coalescing": {
                    name: {"batches": c.batches, "requests": c.items}
                    for name, c in (("lookups", self._lookups), ("locates", self._locates))
                },
            },
        )

    def _swa_bytes(self) -> int:
        try:
            stats = self._swa.stats() if hasattr(self._swa, "stats") else {}
        except StoreError:
            return 0
        return int(stats.get("bytes", 0)) if isinstance(stats, dict) else 0


def _gather(refs: list[Any]) -> list[Any]:
    """Results of ``refs``; None for each one that failed or did not answer in time."""
    out: list[Any] = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=_STATS_TIMEOUT_S))
        except Exception as error:  # stats must answer even when part of the cluster is down
            log.info("stats source unavailable: %s", error)
            out.append(None)
    return out
