"""The block tier of the fleet model (``kvstore simulate``): what one copy of the traffic keeps
where, and kvstore's own rules deciding every step of it.

State is columns indexed by block id (present, last access, creation, class, stripe placement)
and per-machine counters (shards held, bytes sent, received, read, written): no shard bytes
exist, so no erasure coding runs and a read fails only when fewer than k of its stripe's machines
are alive. The decisions are kvstore's code, called as the tier calls it:

- **hit**: ``kvstore.tier.hit.HitQuery`` (the blocks within the cap looked up, ``plan_hit``) over
  ``lookup`` below, which answers as a meta shard does (a lookup touches every block it finds);
- **placement**: ``placement.place`` over the live machines, a put committing the blocks with at
  least ``BlockStoreConfig.write_quorum`` shards (a stored block is not rewritten: EXISTS);
- **GC**: the pass of ``kvstore.gc.worker.GCWorker`` step by step: expire by the class TTL
  (``GCConfig.ttl_seconds_by_class``), then while ``bytes_to_free`` of the machines' usage
  (``capacity.tier_usage``) is positive, every meta shard proposes its LRU prefix
  (``LRUCandidates``) and ``planner.merge_lru`` picks the global one, in at most
  ``MAX_EVICTION_ROUNDS`` rounds with the worker's node-bytes-per-block-byte;
- **repair**: ``repairqueue.RepairQueue`` (most shards lost first, then class, then recency) over
  a ``BlockIndex`` of the stripes that lost a shard, targets from ``placement.replacements``,
  rounds bounded as ``Repairer.round`` bounds them.

The model's own simplifications: a request is instantaneous (its reads finish before any GC pass,
so leases never matter), a lookup sees a dead machine at once (readers hedge), and the shards of
a put that failed its quorum are not counted (a node reclaims them after its orphan grace).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore.blockstore.capacity import tier_usage
from kvstore.blockstore.config import BlockStoreConfig
from kvstore.blockstore.index import BlockIndex
from kvstore.blockstore.placement import meta_shard_of, place, replacements
from kvstore.blockstore.repairqueue import RepairQueue
from kvstore.ec import Codec
from kvstore.errors import InvalidArgument
from kvstore.gc.config import GCConfig
from kvstore.gc.planner import LRUCandidates, merge_lru
from kvstore.gc.worker import MAX_EVICTION_ROUNDS
from kvstore.keys import words_to_keys
from kvstore.pending import Pending
from kvstore.trace.capacity import disk_bytes_per_block

#: Capacity a machine reports when the tier is unbounded (the GC never evicts under it).
UNBOUNDED = 1 << 62
#: Extra machines ranked per block beyond the stripe width, so a placement over the live machines
#: is read off the ranking while that many machines are dead (rendezvous scores do not depend on
#: the set: removing machines keeps the others' order).
SPARE_RANKS = 4


@dataclass(frozen=True)
class ShardSizes:
    """Bytes of one shard of a block of ``block_bytes``, three ways."""

    block_bytes: int
    width: int
    network: int  # on the wire: the self-describing shard (header + fragment)
    live: int  # what a node counts against its capacity: its SHARD record
    disk: int  # what the disk holds: the same record (a put is its own commit mark)

    @classmethod
    def of(cls, block_bytes: int, data_shards: int, parity_shards: int) -> ShardSizes:
        width = data_shards + parity_shards
        disk = disk_bytes_per_block(block_bytes, data_shards, parity_shards) // width
        network = Codec(data_shards, parity_shards).shard_length(block_bytes)
        return cls(block_bytes, width, network, disk, disk)

    @property
    def live_per_block(self) -> int:
        return self.live * self.width


class PlacementCache:
    """``place()`` of every block over all machines, computed once per block (rendezvous
    hashing scores every machine: ~0.1 ms a block at 1,000 machines here) and kept as a
    ranking, so a block written again after an eviction, or placed over the live set while
    machines are dead, costs a lookup."""

    def __init__(self, words: np.ndarray, machines: int, width: int) -> None:
        self.machines = machines
        self.width = width
        self.columns = min(machines, width + SPARE_RANKS)
        self._words = words
        self._rank = np.full((words.shape[0], self.columns), -1, dtype=np.int32)
        self._done = np.zeros(words.shape[0], dtype=bool)
        self._nodes = np.arange(machines, dtype=np.int64)

    def missing(self) -> int:
        """Blocks not ranked yet."""
        return int((~self._done).sum())

    def compute(
        self, ids: np.ndarray, chunk: int = 128, progress: Callable[[int], None] | None = None
    ) -> None:
        """Rank the blocks ``ids`` not ranked yet, ``chunk`` at a time (a chunk's score matrix
        stays in cache)."""
        todo = np.unique(ids[~self._done[ids]])
        for start in range(0, todo.size, chunk):
            part = todo[start : start + chunk]
            self._rank[part] = place(words_to_keys(self._words[part]), self._nodes, self.columns)
            self._done[part] = True
            if progress is not None:
                progress(int(part.size))

    def compute_all(self, progress: Callable[[int], None] | None = None) -> None:
        self.compute(np.arange(self._done.size), progress=progress)

    def live(self, ids: np.ndarray, dead: np.ndarray) -> np.ndarray:
        """(n, width) placement of blocks ``ids`` over the machines not ``dead`` (bool per
        machine): exactly ``place(keys, live machines, width)``; -1 where none is left."""
        self.compute(ids)
        rank = self._rank[ids]
        if not dead.any():
            return rank[:, : self.width].copy()
        alive = ~dead[rank]
        order = np.argsort(~alive, axis=1, kind="stable")[:, : self.width]
        chosen = np.take_along_axis(rank, order, axis=1)
        chosen[~np.take_along_axis(alive, order, axis=1)] = -1
        return chosen


@dataclass
class MachineCounters:
    """Per machine: bytes moved, as float64 arrays."""

    machines: int
    net_in: np.ndarray = field(init=False)
    net_out: np.ndarray = field(init=False)
    disk_read: np.ndarray = field(init=False)
    disk_write: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        for name in ("net_in", "net_out", "disk_read", "disk_write"):
            setattr(self, name, np.zeros(self.machines, dtype=np.float64))

    def add(self, name: str, machines: np.ndarray, nbytes: float) -> None:
        """``nbytes`` to ``name`` of each machine in ``machines`` (repeats add up, -1 none)."""
        flat = machines[machines >= 0]
        if flat.size:
            getattr(self, name)[:] += np.bincount(flat, minlength=self.machines) * nbytes

    def total(self) -> float:
        return float(self.net_in.sum() + self.net_out.sum())


@dataclass
class ClassCounters:
    """Blocks and payload bytes per traffic class name."""

    blocks: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, names: Sequence[str], classes: np.ndarray, block_bytes: int) -> None:
        for class_id, count in zip(*np.unique(classes, return_counts=True), strict=True):
            self.blocks[names[int(class_id)]] += int(count)
            self.bytes[names[int(class_id)]] += int(count) * block_bytes


@dataclass(frozen=True)
class RoundResult:
    """One repair round: stripes and shards restored, shard bytes written, and stripes found
    with fewer than k shards left (they cannot be rebuilt)."""

    stripes: int
    shards: int
    bytes: int
    unrecoverable: int


class SimTier:
    """The tier of one copy of the traffic on ``machines`` counted machines (module doc).
    ``words``: every block's key words, by block id; ``node_capacity``: live bytes each machine
    may hold (None: unbounded); ``tier_refusal``: a put is refused when the whole tier is full
    rather than per machine (the model's choice for many copies, see ``simulate``)."""

    def __init__(
        self,
        words: np.ndarray,
        store: BlockStoreConfig,
        gc: GCConfig,
        placement: PlacementCache,
        sizes: ShardSizes,
        traffic_class: str,
        node_capacity: int | None,
        tier_refusal: bool = False,
    ) -> None:
        machines = store.storage_nodes
        if machines < store.stripe_width:
            raise InvalidArgument(
                "--machines", f"must be >= {store.stripe_width} (one per shard), got {machines}"
            )
        blocks = words.shape[0]
        self.machines = machines
        self.config = store
        self.gc_config = gc
        self.sizes = sizes
        self.placement = placement
        self.words = words
        self.class_names = store.traffic_classes
        self.class_id = store.class_id(traffic_class)
        self.node_capacity = UNBOUNDED if node_capacity is None else int(node_capacity)
        self.bounded = node_capacity is not None
        self.tier_refusal = tier_refusal
        self.now = 0.0
        # Per block (copy 0).
        self.meta_of = meta_shard_of(words, store.meta_shards)
        self.present = np.zeros(blocks, dtype=bool)
        self.last_access = np.zeros(blocks, dtype=np.float64)
        self.created = np.zeros(blocks, dtype=np.float64)
        self.classes = np.zeros(blocks, dtype=np.uint8)
        self.stripes = np.full((blocks, store.stripe_width), -1, dtype=np.int32)
        # Per machine.
        self.shards = np.zeros(machines, dtype=np.int64)
        self.dead = np.zeros(machines, dtype=bool)
        self.counters = MachineCounters(machines)
        self.ttl = gc.ttl_seconds_by_class(self.class_names)
        self.written = ClassCounters()
        self.evicted = ClassCounters()
        self.expired = ClassCounters()
        self.gc_passes = 0
        self.refused_blocks = 0
        self.under_redundant_blocks = 0
        self.lost = np.zeros(blocks, dtype=bool)  # found with fewer than k shards left
        self._request: np.ndarray = np.zeros(0, dtype=np.int64)
        # The repair's view: a BlockIndex of the stripes that lost a shard, and its queue.
        self._repair_index = BlockIndex(stripe_width=store.stripe_width)
        self._queue = RepairQueue(self._repair_index, store.data_shards)
        self._row_of = np.full(blocks, -1, dtype=np.int64)
        self._id_of_row = np.zeros(0, dtype=np.int64)
        self._rank = store.repair_rank()
        self._refresh = False
        self._idle_floor = 0.0  # no block was accessed (or created) before it

    # --- figures ---------------------------------------------------------------------------

    def at(self, seconds: float) -> None:
        """Move the clock to ``seconds`` of simulated time (never backwards)."""
        self.now = max(self.now, seconds)

    def live_machines(self) -> np.ndarray:
        return np.flatnonzero(~self.dead)

    def usages(self) -> Iterator[dict[str, int]]:
        """What each live machine's ``StorageNode.usage()`` would answer (live bytes)."""
        for machine in self.live_machines().tolist():
            live = int(self.shards[machine]) * self.sizes.live
            yield {
                "bytes_used": live,
                "live_bytes": live,
                "capacity_bytes": self.node_capacity,
                "capacity_from_disk": 0,
            }

    def used_live_bytes(self) -> int:
        return int(self.shards[~self.dead].sum()) * self.sizes.live

    def capacity_live_bytes(self) -> int:
        return int((~self.dead).sum()) * self.node_capacity

    def stored_by_class(self) -> dict[str, int]:
        """Payload bytes of the blocks held, per class."""
        counts = np.bincount(self.classes[self.present], minlength=len(self.class_names))
        return {
            name: int(counts[i]) * self.sizes.block_bytes for i, name in enumerate(self.class_names)
        }

    # --- the read path (``kvstore.tier.hit.BlockLookup`` for ``HitQuery``) -------------------

    def serving(self, ids: np.ndarray) -> None:
        """The block ids of the request whose keys the next ``lookup`` gets (its first ones)."""
        self._request = ids

    def lookup(self, keys: np.ndarray) -> Pending[tuple[int, np.ndarray | None]]:
        """The leading run (``leading_run``), for ``HitQuery``: the simulation waits for
        nothing."""
        return Pending.done(self.leading_run(keys))

    def leading_run(self, keys: np.ndarray) -> tuple[int, np.ndarray | None]:
        """The leading run of committed, readable blocks of ``keys`` (a prefix of the serving
        request's) and, as the lease, their ids. Every block found is touched."""
        ids = self._request[: keys.shape[0]]
        found = self.present[ids]
        self.last_access[ids[found]] = self.now
        readable = found
        if self.dead.any():
            placement = self.stripes[ids]
            alive = (placement >= 0) & ~self.dead[np.maximum(placement, 0)]
            readable = found & (alive.sum(axis=1) >= self.config.data_shards)
            self.lost[ids[found & ~readable]] = True  # fewer than k shards: never readable again
        misses = np.flatnonzero(~readable)
        run = int(misses[0]) if misses.size else int(ids.size)
        return run, (ids[:run] if run else None)

    def release(self, lease: np.ndarray | None) -> None:
        """Nothing is held: a request ends before the next GC pass (module doc)."""

    def read(self, ids: np.ndarray, engine: int) -> None:
        """GetBlocks of ``ids``: k shards of each from its first k live machines (data shards
        first, as the reader asks), to the engine's machine."""
        if ids.size == 0:
            return
        placement = self.stripes[ids]
        alive = placement >= 0
        if self.dead.any():
            alive &= ~self.dead[np.maximum(placement, 0)]
        first_k = alive & (np.cumsum(alive, axis=1) <= self.config.data_shards)
        sources = np.where(first_k, placement, -1).ravel()
        size = self.sizes.network
        self.counters.add("net_out", sources, size)
        self.counters.add("disk_read", sources, size)
        self.counters.net_in[engine] += ids.size * self.config.data_shards * size

    # --- the write path --------------------------------------------------------------------

    def put(self, ids: np.ndarray, engine: int) -> tuple[int, int]:
        """PutBlocks of blocks ``ids`` as the block client does it: a stored block is not
        rewritten; the others are placed over the live machines, every shard a machine has
        room for is written, and the blocks with ``write_quorum`` shards are committed.
        Returns (blocks stored, blocks refused)."""
        fresh = ids[~self.present[ids]]
        if fresh.size == 0:
            return 0, 0
        placement = self.placement.live(fresh, self.dead)
        held = np.where(self._accepted(placement), placement, -1)
        sent = held.ravel()
        self.counters.net_out[engine] += int((sent >= 0).sum()) * self.sizes.network
        self.counters.add("net_in", sent, self.sizes.network)
        self.counters.add("disk_write", sent, self.sizes.disk)
        shards = (held >= 0).sum(axis=1)
        enough = shards >= self.config.write_quorum
        stored = fresh[enough]
        committed = held[enough]
        self.present[stored] = True
        self.last_access[stored] = self.now
        self.created[stored] = self.now
        self.classes[stored] = self.class_id
        self.stripes[stored] = committed
        self.shards += np.bincount(committed[committed >= 0], minlength=self.machines)
        self.written.add(self.class_names, self.classes[stored], self.sizes.block_bytes)
        short = stored[shards[enough] < self.config.stripe_width]
        if short.size:  # under-redundant: the repair restores the missing shards first
            self.under_redundant_blocks += int(short.size)
            self._track(short)
        refused = int(fresh.size - stored.size)
        self.refused_blocks += refused
        return int(stored.size), refused

    def _accepted(self, placement: np.ndarray) -> np.ndarray:
        """Which shards of ``placement`` ((n, width) machines, -1 none) the machines take:
        each machine up to its capacity, in order (``StorageNode.put`` refuses a shard past
        it), or, with ``tier_refusal``, whole blocks while the tier has room."""
        wanted = placement >= 0
        if not self.bounded:
            return wanted
        if self.tier_refusal:
            free = self.capacity_live_bytes() - self.used_live_bytes()
            fits = np.arange(placement.shape[0]) < free // self.sizes.live_per_block
            return wanted & fits[:, None]
        live = self.sizes.live
        room = np.maximum(0, (self.node_capacity - self.shards * live) // live)
        if int(room.min()) >= placement.shape[0]:
            return wanted  # every machine has room for a shard of every block
        flat = np.where(wanted, placement, self.machines).ravel()
        order = np.argsort(flat, kind="stable")
        ordered = flat[order]
        within = np.empty_like(order)
        within[order] = np.arange(order.size) - np.searchsorted(ordered, ordered, side="left")
        room = np.append(room, 0)  # the "no machine" slot takes nothing
        return (within < room[flat]).reshape(placement.shape)

    def _remove(self, ids: np.ndarray, tally: ClassCounters) -> None:
        """Blocks leave the index; their shards on live machines are deleted."""
        placement = self.stripes[ids]
        on_live = placement[(placement >= 0) & ~self.dead[np.maximum(placement, 0)]]
        self.shards -= np.bincount(on_live, minlength=self.machines)
        tally.add(self.class_names, self.classes[ids], self.sizes.block_bytes)
        self.present[ids] = False
        self.stripes[ids] = -1
        tracked = ids[self._row_of[ids] >= 0]
        if tracked.size:
            self._repair_index.remove(self.words[tracked])
            self._row_of[tracked] = -1

    # --- GC: ``GCWorker.tick`` step by step ------------------------------------------------

    def gc_due(self) -> bool:
        """Whether a pass now can remove anything: usage above the high watermark, or a block
        idle longer than the shortest TTL. The model skips passes that cannot (each would ask
        every machine for its usage to do nothing)."""
        if self.bounded and self.used_live_bytes() > (
            self.gc_config.high_watermark * self.capacity_live_bytes()
        ):
            return True
        return self._may_expire()

    def _basis(self) -> np.ndarray:
        return self.last_access if self.gc_config.ttl_basis == "last_access" else self.created

    def _may_expire(self) -> bool:
        """Whether a block may be idle (or old) past the shortest TTL. The oldest access (or
        creation) only moves forward, so the floor is refreshed only when it says so."""
        shortest = float(self.ttl.min())
        if self.now - self._idle_floor <= shortest:
            return False
        held = self._basis()[self.present]
        self._idle_floor = float(held.min()) if held.size else self.now
        return self.now - self._idle_floor > shortest

    def gc_pass(self) -> bool:
        """One GC pass at the clock's time, when due: expire, then evict (module doc)."""
        if not self.gc_due():
            return False
        self.gc_passes += 1
        if self._may_expire():
            # ``BlockIndex.expired_rows``: idle (or old) strictly longer than its class's TTL.
            threshold = self.now - self.ttl[self.classes]
            expired = np.flatnonzero(self.present & (self._basis() < threshold))
            if expired.size:
                self._remove(expired, self.expired)
        self._evict()
        return True

    def _evict(self) -> None:
        used, capacity = tier_usage(self.usages())
        if not self.gc_config.bytes_to_free(used, capacity):
            return
        low = self.gc_config.low_watermark * capacity
        for _ in range(MAX_EVICTION_ROUNDS):
            node_bytes = used - low
            if node_bytes <= 0:
                break
            indexed = int(self.present.sum()) * self.sizes.block_bytes
            # The worker's node bytes freed per block byte: measured, never below (k + m) / k.
            ratio = self.config.stripe_width / self.config.data_shards
            if indexed > 0:
                ratio = max(ratio, used / indexed)
            needed = int(math.ceil(node_bytes / ratio))
            chosen = self._lru_prefix(needed)
            if chosen.size == 0:
                break
            self._remove(chosen, self.evicted)
            used, capacity = tier_usage(self.usages())
            low = self.gc_config.low_watermark * capacity

    def _lru_prefix(self, bytes_needed: int) -> np.ndarray:
        """The block ids to evict for ``bytes_needed``: each meta shard proposes its shortest
        least-recently-used prefix reaching it (what ``gc_lru_candidates`` answers), and
        ``merge_lru`` picks the global prefix from them, as the worker does."""
        held = np.flatnonzero(self.present)
        owner = self.meta_of[held]
        take = -(-bytes_needed // self.sizes.block_bytes)
        proposals: list[LRUCandidates] = []
        proposed: dict[bytes, int] = {}
        for shard in range(self.config.meta_shards):
            mine = held[owner == shard]
            if mine.size == 0:
                continue
            last = self.last_access[mine]
            if mine.size > take:  # every block at or below the take-th access time, ties too
                cut = np.partition(last, take - 1)[take - 1]
                mine, last = mine[last <= cut], last[last <= cut]
            order = np.lexsort((mine, last))[:take]  # by access, ties by id
            mine = mine[order]
            keys = words_to_keys(self.words[mine])
            proposed.update(zip(keys, mine.tolist(), strict=True))
            proposals.append(
                LRUCandidates(
                    shard=shard,
                    keys=keys,
                    last_access=self.last_access[mine],
                    sizes=np.full(mine.size, self.sizes.block_bytes, dtype=np.int64),
                    classes=self.classes[mine].astype(np.int64),
                )
            )
        plan = merge_lru(proposals, bytes_needed)
        return np.asarray([proposed[key] for e in plan for key in e.keys], dtype=np.int64)

    # --- failures and repair -----------------------------------------------------------------

    def fail(self, machine: int) -> int:
        """Machine ``machine`` is lost for good, with its shards. Returns the live bytes it
        held; its stripes join the repair's index."""
        if self.dead[machine]:
            return 0
        held = int(self.shards[machine]) * self.sizes.live
        self.dead[machine] = True
        self.shards[machine] = 0
        self._track(np.flatnonzero(self.present & (self.stripes == machine).any(axis=1)))
        return held

    def _track(self, ids: np.ndarray) -> None:
        """Put the stripes ``ids`` in the repair's index (once), with their placement, class
        and last access."""
        ids = ids[self._row_of[ids] < 0]
        if ids.size == 0:
            return
        index = self._repair_index
        rows = index.upsert(
            self.words[ids],
            self.stripes[ids],
            np.full(ids.size, self.sizes.block_bytes, dtype=np.int64),
            self.classes[ids],
            self.now,
        )
        index.touch(rows, self.last_access[ids])
        self._row_of[ids] = rows
        if self._id_of_row.size <= int(rows.max()):
            grown = np.zeros(max(int(rows.max()) + 1, 2 * self._id_of_row.size), dtype=np.int64)
            grown[: self._id_of_row.size] = self._id_of_row
            self._id_of_row = grown
        self._id_of_row[rows] = ids
        if (self.stripes[ids] < 0).any():
            self._queue.lost_shards = True  # the queue scans for -1 shards from now on
        self._refresh = True  # new stripes: the next round rescans

    def repair_pending(self) -> bool:
        return len(self._repair_index) > 0

    def repair_round(self, repair_host: int, dead: Sequence[int]) -> RoundResult:
        """One repair round, knowing ``dead`` (the machines declared dead so far): the most
        urgent stripes (``RepairQueue.take``, bounded as ``Repairer.round`` bounds a round),
        their lost shards rebuilt by the repair process on ``repair_host`` from k shards each
        (data first) and written to ``placement.replacements``."""
        store = self.config
        index = self._repair_index
        tracked = np.flatnonzero(self._row_of >= 0)
        if tracked.size:  # the queue orders by recency: give it the requests' touches
            index.touch(self._row_of[tracked], self.last_access[tracked])
        rows, _summary = self._queue.take(
            sorted(int(m) for m in dead),
            [],
            store.repair_stripes_per_round,
            store.repair_round_bytes,
            self._rank,
            self.now,
            refresh=self._refresh,
        )
        self._refresh = False
        if rows.size == 0:
            return RoundResult(0, 0, 0, 0)
        ids = self._id_of_row[rows]
        placements = self.stripes[ids].astype(np.int64)
        wanted = (placements < 0) | np.isin(placements, np.asarray(list(dead), dtype=np.int64))
        whole = (~wanted).sum(axis=1) >= store.data_shards
        if not whole.all():  # fewer than k shards left: lost for good, nothing to rebuild from
            gone = ids[~whole]
            self.lost[gone] = True
            index.remove(self.words[gone])
            self._row_of[gone] = -1
        ids, placements, wanted = ids[whole], placements[whole], wanted[whole]
        unrecoverable = int(rows.size - ids.size)
        if ids.size == 0:
            return RoundResult(0, 0, 0, unrecoverable)
        keys = words_to_keys(self.words[ids])
        targets = replacements(keys, self.live_machines(), placements, wanted)
        targets = np.where(self._accepted(targets.astype(np.int32)), targets, -1)
        landed = targets >= 0
        self.stripes[ids] = np.where(landed, targets, placements)
        written = targets[landed]
        self.shards += np.bincount(written, minlength=self.machines)
        size = self.sizes.network
        alive = ~wanted
        first_k = alive & (np.cumsum(alive, axis=1) <= store.data_shards)
        sources = np.where(first_k, placements, -1).ravel()
        self.counters.add("net_out", sources, size)
        self.counters.add("disk_read", sources, size)
        self.counters.net_in[repair_host] += ids.size * store.data_shards * size
        self.counters.net_out[repair_host] += written.size * size
        self.counters.add("net_in", written, size)
        self.counters.add("disk_write", written, self.sizes.disk)
        whole_again = (landed | alive).all(axis=1)
        done = ids[whole_again]  # out of the repair's index
        if done.size:
            index.remove(self.words[done])
            self._row_of[done] = -1
        # A stripe with a shard no machine could take stays, with what did land.
        for row, column in zip(*np.nonzero(landed & ~whole_again[:, None]), strict=True):
            index.set_placement(int(self._row_of[ids[row]]), int(column), int(targets[row, column]))
        return RoundResult(
            int(ids.size), int(written.size), int(written.size) * size, unrecoverable
        )
