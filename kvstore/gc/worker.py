"""The GC worker: one pass = expire by TTL, then evict by LRU while capacity runs high.

Written against the block tier's ``Fanout`` protocol (``kvstore.blockstore.fanout``): the same
logic runs over Ray actors (``RayFanout``, in ``kvstore.runtime.gc_actors``) and in-process over
plain ``MetaShard``/``StorageNode`` objects (``LocalFanout``, in unit tests). Time comes from an
injected ``Clock``; tests move it by days.

Invariants (also in gc/README.md):

1. Never a leased block. Candidates are chosen without leases, and the meta shard checks the
   lease again at removal time (``BlockIndex.remove(unless_leased_at=now)``), so a lease taken
   between the scan and the removal still wins.
2. Index first, shards second. A block leaves its meta shard's index before any of its shards is
   deleted, so a reader either finds it whole (all shards still there) or not at all. A worker
   killed between the two leaves orphan shards: invisible to readers, counted in node usage
   until the node scrub (``StorageNode.reclaim_orphans``) reclaims them.
3. Idempotent. A pass only removes what is expired or least recently used *now*; running it
   twice, or again after a crash, removes nothing more than one pass would. Shard deletes of
   unknown keys are no-ops, and ``not_after`` keeps a shard re-written after the removal.
4. Global LRU. Every meta shard proposes its own least recently used blocks for the whole
   ``bytes_needed``; the worker merges them by last access (``planner.merge_lru``), so the
   blocks evicted are the least recently used of the whole tier, not of each shard.
5. A failing step is logged and skipped; the pass goes on with the other shards and nodes, and
   the loop (``ReconcileLoop``) goes on with the next pass.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from kvstore.blockstore.calls import MetaShardCalls, StorageNodeCalls, meta_target, node_target
from kvstore.blockstore.capacity import tier_usage
from kvstore.blockstore.fanout import Fanout, Ticket, gather
from kvstore.blockstore.records import RemovedBlock
from kvstore.clock import Clock
from kvstore.errors import InvalidArgument, NodeUnavailable
from kvstore.gc.config import GCConfig
from kvstore.gc.planner import LRUCandidates, merge_lru

log = logging.getLogger("kvstore.gc")

#: Eviction rounds per pass: each round re-reads usage, so headers and racing writes converge.
MAX_EVICTION_ROUNDS = 8

R = TypeVar("R")


@dataclass
class Tally:
    """Blocks and bytes per class name."""

    blocks: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, removed: Iterable[RemovedBlock]) -> None:
        for block in removed:
            self.blocks[block.traffic_class] += 1
            self.bytes[block.traffic_class] += block.size

    @property
    def total_blocks(self) -> int:
        return sum(self.blocks.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {
            name: {"blocks": self.blocks[name], "bytes": self.bytes[name]}
            for name in sorted(self.blocks)
        }


@dataclass
class PassReport:
    """What one GC pass did."""

    now: float
    expired: Tally = field(default_factory=Tally)
    evicted: Tally = field(default_factory=Tally)
    used_bytes_before: int = 0
    used_bytes_after: int = 0
    capacity_bytes: int = 0
    shards_deleted: int = 0
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {
            "now": self.now,
            "expired": self.expired.as_dict(),
            "evicted": self.evicted.as_dict(),
            "used_bytes_before": self.used_bytes_before,
            "used_bytes_after": self.used_bytes_after,
            "capacity_bytes": self.capacity_bytes,
            "shards_deleted": self.shards_deleted,
            "errors": list(self.errors),
        }


class GCWorker:
    """Runs GC passes over a set of meta shards and storage nodes."""

    def __init__(
        self,
        config: GCConfig,
        fanout: Fanout,
        meta_shards: Sequence[int],
        nodes: Sequence[int],
        class_names: Sequence[str],
        clock: Clock,
        data_shards: int = 10,
        parity_shards: int = 2,
        call_timeout_s: float = 30.0,
    ) -> None:
        if not isinstance(config, GCConfig):
            raise InvalidArgument("config", f"must be a GCConfig, got {type(config).__name__}")
        if not class_names:
            raise InvalidArgument("class_names", "must name at least one traffic class")
        if data_shards < 1 or parity_shards < 0:
            raise InvalidArgument("data_shards", "need data_shards >= 1 and parity_shards >= 0")
        self.config = config
        self._fanout = fanout
        self._meta = list(meta_shards)
        self._nodes = list(nodes)
        self._class_names = tuple(class_names)
        self._clock = clock
        # Node usage counts every shard, parity included: a block of S bytes takes about
        # S * (k + m) / k of node bytes (plus headers, which the next round's re-read absorbs).
        self._stored_per_block_byte = (data_shards + parity_shards) / data_shards
        self._timeout = call_timeout_s
        # The TTL each meta shard applies, by its class names (absent classes: default's TTL).
        self._ttl_by_name = {name: config.ttl_for(name) for name in self._class_names}
        self._lock = threading.Lock()

    def set_nodes(self, nodes: Sequence[int]) -> None:
        """Storage nodes changed (one lost, one added by repair)."""
        self._nodes = list(nodes)

    # --- remote calls ----------------------------------------------------------------------

    def _answers(
        self, tickets: Iterable[Ticket[R]], report: PassReport
    ) -> list[tuple[Ticket[R], R]]:
        """Wait for every call (call timeouts are real elapsed time: the injected clock may
        stand still in tests); a failing target is recorded in ``report`` and left out, one
        failed step rather than a failed pass."""
        answered = []
        for ticket, outcome in gather(self._fanout, tickets, self._timeout).items():
            if isinstance(outcome, NodeUnavailable):
                message = f"{ticket.target}: {ticket.method} failed: {outcome!r}"
                log.warning("gc: %s", message)
                report.errors.append(message)
            else:
                answered.append((ticket, outcome))
        return answered

    # --- the pass --------------------------------------------------------------------------

    def run_once(self) -> PassReport:
        """One pass at the clock's current time."""
        return self.tick(self._clock.now())

    def tick(self, now: float) -> PassReport:
        """One pass at ``now``: expire, then evict if capacity is above the high watermark."""
        with self._lock:
            report = PassReport(now=now)
            self._expire(now, report)
            self._evict(now, report)
            return report

    def _delete_shards(self, removed: Sequence[RemovedBlock], report: PassReport) -> None:
        """Delete the shards of blocks already gone from the index: one call per node."""
        by_node: dict[int, list[bytes]] = defaultdict(list)
        oldest_removal: dict[int, float] = {}
        for block in removed:
            for node in block.nodes:
                by_node[node].append(bytes(block.key))
                oldest_removal[node] = min(oldest_removal.get(node, math.inf), block.removed_at)
        tickets = [
            self._fanout.submit(
                node_target(node), StorageNodeCalls.delete, by_node[node], oldest_removal[node]
            )
            for node in sorted(by_node)
        ]
        # A node that fails here leaves orphans (the index no longer has these blocks),
        # reclaimed by that node's scrub. Nothing a reader can see is half there.
        for _, deleted in self._answers(tickets, report):
            report.shards_deleted += int(deleted)

    def _expire(self, now: float, report: PassReport) -> None:
        batch = self.config.delete_batch
        shards = list(self._meta)
        while shards:
            tickets = {
                self._fanout.submit(
                    meta_target(shard),
                    MetaShardCalls.gc_expire,
                    now,
                    self._ttl_by_name,
                    self.config.ttl_basis,
                    batch,
                ): shard
                for shard in shards
            }
            removed: list[RemovedBlock] = []
            still_full = []
            for ticket, expired in self._answers(tickets, report):
                removed.extend(expired)
                if len(expired) >= batch:
                    still_full.append(tickets[ticket])  # may hold more: ask again
            report.expired.add(removed)
            if removed:
                self._delete_shards(removed, report)
            shards = still_full

    def _usage(self, report: PassReport) -> tuple[int, int] | None:
        """(disk bytes held, capacity) of the nodes that answered: a filesystem that several
        nodes share counts its free space once (``capacity.tier_usage``)."""
        tickets = [
            self._fanout.submit(node_target(node), StorageNodeCalls.usage) for node in self._nodes
        ]
        replies = [outcome for _, outcome in self._answers(tickets, report)]
        return tier_usage(replies) if replies else None

    def _evict(self, now: float, report: PassReport) -> None:
        usage = self._usage(report)
        if usage is None:
            return
        used, capacity = usage
        report.used_bytes_before = report.used_bytes_after = used
        report.capacity_bytes = capacity
        if used <= self.config.high_watermark * capacity:
            return
        low = self.config.low_watermark * capacity
        for _ in range(MAX_EVICTION_ROUNDS):
            node_bytes = used - low
            if node_bytes <= 0:
                break
            needed = int(math.ceil(node_bytes / self._node_bytes_per_block_byte(used, report)))
            evicted = self._evict_bytes(now, needed, report)
            usage = self._usage(report)
            if usage is None:
                break
            used, capacity = usage
            low = self.config.low_watermark * capacity
            report.used_bytes_after = used
            if evicted == 0:
                break  # nothing evictable left (everything leased): try next pass

    def _node_bytes_per_block_byte(self, used: int, report: PassReport) -> float:
        """How many node bytes evicting one block byte frees: measured (node usage over indexed
        block bytes: shard headers included) but never below the (k + m) / k of the code.

        Orphan shards inflate the measure, which only makes a round evict less than needed; the
        next round (usage re-read) evicts the rest, so the evicted set stays the shortest LRU
        prefix rather than overshooting."""
        tickets = [
            self._fanout.submit(meta_target(shard), MetaShardCalls.stored_bytes_by_class)
            for shard in self._meta
        ]
        indexed = 0
        for _, by_class in self._answers(tickets, report):
            indexed += sum(int(v) for v in by_class.values())
        if indexed <= 0:
            return self._stored_per_block_byte
        return max(self._stored_per_block_byte, used / indexed)

    def _evict_bytes(self, now: float, bytes_needed: int, report: PassReport) -> int:
        """Evict the globally least recently used unleased blocks summing to ``bytes_needed``
        block bytes; returns how many blocks left the index."""
        tickets = {
            self._fanout.submit(
                meta_target(shard), MetaShardCalls.gc_lru_candidates, now, bytes_needed
            ): shard
            for shard in self._meta
        }
        candidates = []
        for ticket, proposed in self._answers(tickets, report):
            if not proposed:
                continue
            last_access, keys, sizes = zip(*proposed, strict=True)
            candidates.append(
                LRUCandidates(
                    shard=tickets[ticket],
                    keys=list(keys),
                    last_access=np.asarray(last_access, dtype=np.float64),
                    sizes=np.asarray(sizes, dtype=np.int64),
                    classes=np.zeros(len(keys), dtype=np.int64),
                )
            )
        plan = {e.shard: e.keys for e in merge_lru(candidates, bytes_needed)}
        evicted = 0
        batch = self.config.delete_batch
        for start in range(0, max((len(keys) for keys in plan.values()), default=0), batch):
            chunk = {shard: keys[start : start + batch] for shard, keys in plan.items()}
            chunk = {shard: keys for shard, keys in chunk.items() if keys}
            evictions = [
                # chosen_at=now: the candidates are the LRU order as of this pass's start; a
                # block read since then (a pass can take seconds) stays.
                self._fanout.submit(
                    meta_target(shard), MetaShardCalls.gc_evict, chunk[shard], now, now
                )
                for shard in sorted(chunk)
            ]
            removed: list[RemovedBlock] = []
            for _, gone in self._answers(evictions, report):
                removed.extend(gone)
            report.evicted.add(removed)
            evicted += len(removed)
            if removed:
                self._delete_shards(removed, report)
        return evicted


class ReconcileLoop:
    """Runs ``step`` every ``interval_s`` until stopped; a failing step is logged, not fatal.

    ``wait`` is injected (an ``Event.wait``-like callable returning True when stopped) so tests
    drive the loop without sleeping."""

    def __init__(
        self,
        step: Callable[[], object],
        interval_s: float,
        stop: threading.Event | None = None,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise InvalidArgument("interval_s", f"must be > 0, got {interval_s}")
        self._step = step
        self._interval = interval_s
        self.stop_event = stop or threading.Event()
        self._on_error = on_error
        self.passes = 0
        self.failures = 0
        self.last_error: str | None = None

    def run(self, max_passes: int | None = None) -> None:
        while not self.stop_event.is_set():
            try:
                self._step()
            except Exception as error:  # the loop outlives any one failing pass
                self.failures += 1
                self.last_error = repr(error)
                log.exception("gc: pass failed; next pass in %.1f s", self._interval)
                if self._on_error is not None:
                    self._on_error(error)
            self.passes += 1
            if max_passes is not None and self.passes >= max_passes:
                return
            if self.stop_event.wait(self._interval):
                return

    def stop(self) -> None:
        self.stop_event.set()
