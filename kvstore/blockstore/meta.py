"""A meta shard: the block index of one slice of the keyspace (split by key hash).

It answers "which blocks of this prompt are cached, and where are their shards?", arbitrates
writers (one reservation per key), takes leases so GC never removes a block being read, and is
a *cache* of what the storage nodes hold: a restarted shard rebuilds itself from the nodes'
manifests (``begin_rebuild`` / ``absorb_manifest`` / ``finish_rebuild``); until it is done its
keys are misses, never errors.

Rebuild rule: a key is restored when at least k committed shards of one write of it are found
(a write is named by the payload hash every shard of it carries, ``kvstore.ec.shard``, which
each manifest row lists). A shard is committed only after its writer had at least
``min_write_shards`` shards acknowledged durable (``client.py``), so a writer that died before
committing leaves nothing a rebuild could resurrect; and a block whose commit was acknowledged
to its writer has that many committed shards (k+m, or k+1 for an under-redundant write), of
which at most that many minus k may be on unreachable nodes for it to be restored.

Not thread-safe: one actor thread (or a lock in the shell) owns one shard.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from kvstore.blockstore.config import BlockStoreConfig
from kvstore.blockstore.index import BlockIndex, BlockRecords
from kvstore.blockstore.indexsnapshot import index_from_table, index_to_table
from kvstore.blockstore.placement import meta_shard_of
from kvstore.blockstore.records import (
    MetaReply,
    MissReason,
    PutStatus,
    RemovedBlock,
    StripeRecord,
)
from kvstore.blockstore.repairqueue import RepairQueue
from kvstore.clock import Clock, SystemClock
from kvstore.errors import InvalidArgument
from kvstore.keys import KEY_BYTES, BlockKey, check_key, check_keys, key_words

if TYPE_CHECKING:
    from kvstore.blockstore.calls import MetaShardCalls


@dataclass(slots=True)
class _Found:
    """One write of a block (shards agreeing on its 8-byte payload hash) seen in a rebuild."""

    placement: list[int]
    stamps: list[float]
    size: int
    class_id: int
    created: float

    @property
    def shards(self) -> int:
        return sum(1 for node in self.placement if node >= 0)


class MetaShard:
    def __init__(
        self,
        shard_id: int,
        config: BlockStoreConfig | None = None,
        clock: Clock | None = None,
        rebuilding: bool = False,
    ) -> None:
        self.config = config or BlockStoreConfig()
        if not 0 <= shard_id < self.config.meta_shards:
            raise InvalidArgument(
                "shard_id", f"must be in [0, {self.config.meta_shards}), got {shard_id}"
            )
        self.shard_id = shard_id
        self._clock = clock or SystemClock()
        self._width = self.config.stripe_width
        self._k = self.config.data_shards
        self._index = BlockIndex(stripe_width=self._width)
        self._reservations: dict[bytes, tuple[int, float]] = {}
        self._down: set[int] = set()
        self._tombstones: OrderedDict[bytes, tuple[str, int]] = OrderedDict()
        self._rebuilding = rebuilding
        self._rebuild_found: dict[bytes, dict[bytes, _Found]] = {}
        #: Releases that rode on a lookup, applied once its reply is out (``after_reply``).
        self._after: list[tuple[Any, Any]] = []
        self._rebuild_sources = 0
        #: Stripes to repair, most urgent first (it also knows whether some placement may
        #: hold -1: a shard lost to corruption, unseen in a rebuild, or never written).
        self._repair = RepairQueue(self._index, self._k)
        classes = (*self.config.traffic_classes, "unknown")
        self._misses = {name: dict.fromkeys(MissReason.ALL, 0) for name in classes}
        self._counters = {
            "lookups": 0,
            "lookup_keys": 0,
            "hit_keys": 0,
            "commits": 0,
            "leases": 0,
            "releases": 0,
            "rebuilds": 0,
            "rebuilt_blocks": 0,
            "placement_updates": 0,
        }

    # --- helpers ---------------------------------------------------------------------------

    def _keys(self, keys: Sequence[bytes], argument: str = "keys") -> list[BlockKey]:
        checked = check_keys(keys, argument)
        self._key_array(checked, argument)  # each must belong to this shard
        return checked

    def _readable(self, placements: np.ndarray, extra_down: Sequence[int]) -> np.ndarray:
        down = self._down | {int(node) for node in extra_down}
        alive = placements >= 0
        if down:
            alive &= ~np.isin(placements, np.fromiter(down, dtype=np.int64))
        return np.asarray(alive.sum(axis=1) >= self._k)

    def _class_name(self, class_id: int | None) -> str:
        if class_id is None:
            return "unknown"
        return self.config.class_name(int(class_id))

    def _tombstone(self, removed: BlockRecords, reason: str) -> None:
        if self.config.tombstones == 0:
            return
        for key, class_id in zip(removed.keys, removed.classes, strict=True):
            self._tombstones[bytes(key)] = (reason, int(class_id))
            self._tombstones.move_to_end(bytes(key))
        while len(self._tombstones) > self.config.tombstones:
            self._tombstones.popitem(last=False)

    def _removed(self, records: BlockRecords, reason: str, now: float) -> list[RemovedBlock]:
        return [
            RemovedBlock(
                key=records.keys[i],
                nodes=tuple(int(n) for n in records.placements[i] if n >= 0),
                size=int(records.sizes[i]),
                traffic_class=self.config.class_name(int(records.classes[i])),
                removed_at=now,
                reason=reason,
            )
            for i in range(len(records))
        ]

    # --- writers ---------------------------------------------------------------------------

    def begin_put(self, keys: Sequence[bytes], token: int) -> list[int]:
        """Reserve ``keys`` for writer ``token``: one ``PutStatus`` per key."""
        checked = self._keys(keys)
        now = self._clock.now()
        rows = self._index.find(checked) if checked else np.zeros(0, np.int64)
        until = now + self.config.put_reservation_s
        answers: list[int] = []
        for key, row in zip(checked, rows, strict=True):
            if row >= 0:
                answers.append(PutStatus.EXISTS)
                continue
            held = self._reservations.get(key)
            if held is not None and held[0] != token and held[1] > now:
                answers.append(PutStatus.BUSY)
                continue
            self._reservations[key] = (token, until)
            answers.append(PutStatus.GRANTED)
        if len(self._reservations) > 4 * len(checked) + 10_000:
            self._reservations = {k: v for k, v in self._reservations.items() if v[1] > now}
        return answers

    def commit(
        self,
        keys: Sequence[bytes],
        token: int,
        placements: np.ndarray,
        sizes: Sequence[int] | np.ndarray,
        class_id: int,
    ) -> list[bool]:
        """Insert blocks whose shards were committed on their nodes (the visibility point).

        A placement may hold -1: a shard not written (an under-redundant stripe, ``client.py``),
        restored by the repair. Each row must still place at least k shards, on distinct nodes.
        Refused (False) for a key already committed or reserved by another live writer.
        """
        checked = self._keys(keys)
        placement_array = np.asarray(placements, dtype=np.int32).reshape(-1, self._width)
        if placement_array.shape[0] != len(checked) or len(sizes) != len(checked):
            raise InvalidArgument("placements", "must have one row (and size) per key")
        placed = placement_array >= 0
        counts = placed.sum(axis=1)
        short = np.flatnonzero(counts < self._k)
        if short.size:
            row = int(short[0])
            raise InvalidArgument(
                f"placements[{row}]",
                f"places {int(counts[row])} shards; a stripe needs at least {self._k} "
                "(data_shards) to be readable",
            )
        # Unplaced entries get distinct negatives so that only a node named twice repeats.
        ordered = np.sort(np.where(placed, placement_array, -1 - np.arange(self._width)), axis=1)
        doubled = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
        if doubled.size:
            row = int(doubled[0])
            raise InvalidArgument(
                f"placements[{row}]",
                f"names a node twice ({placement_array[row].tolist()}): a stripe never has two "
                "shards in one failure domain",
            )
        now = self._clock.now()
        rows = self._index.find(checked) if checked else np.zeros(0, np.int64)
        accept = []
        for position, (key, row) in enumerate(zip(checked, rows, strict=True)):
            held = self._reservations.get(key)
            if row >= 0 or (held is not None and held[0] != token and held[1] > now):
                continue
            accept.append(position)
            self._reservations.pop(key, None)
            self._tombstones.pop(key, None)
        if accept:
            chosen = np.asarray(accept, dtype=np.int64)
            self._index.upsert(
                [checked[i] for i in accept],
                placement_array[chosen],
                np.asarray(sizes, dtype=np.int64)[chosen],
                np.full(len(accept), class_id, dtype=np.uint8),
                now,
            )
            # Let the repair's scan for lost (-1) shards find the under-redundant stripes.
            self._lost_shards |= bool((~placed[chosen]).any())
        self._counters["commits"] += len(accept)
        accepted = set(accept)
        return [i in accepted for i in range(len(checked))]

    def abort_put(self, keys: Sequence[bytes], token: int) -> None:
        for key in keys:
            held = self._reservations.get(bytes(key))
            if held is not None and held[0] == token:
                del self._reservations[bytes(key)]

    # --- readers ---------------------------------------------------------------------------

    def _key_array(self, keys: Sequence[bytes] | np.ndarray, argument: str = "keys") -> np.ndarray:
        """``keys`` as (n, 4) uint64 words, each checked to belong to this shard."""
        words = key_words(keys, argument)
        if words.shape[0] and self.config.meta_shards > 1:  # with one shard, every key is ours
            owners = meta_shard_of(words, self.config.meta_shards)
            wrong = np.flatnonzero(owners != self.shard_id)
            if wrong.size:
                raise InvalidArgument(
                    f"{argument}[{int(wrong[0])}]",
                    f"belongs to meta shard {int(owners[wrong[0]])}, not {self.shard_id}",
                )
        return words

    def _answer(
        self,
        words: np.ndarray,
        down_nodes: Sequence[int],
        traffic_class: str | None,
        lease_until: float | None,
        lease_for: float | None,
    ) -> MetaReply:
        n = words.shape[0]
        rows = np.full(n, -1, np.int64)
        readable = np.zeros(n, bool)
        placements = np.full((n, self._width), -1, np.int32)
        sizes = np.zeros(n, np.int64)
        if self._rebuilding or n == 0:
            if n:
                self._count_absent(words, MissReason.REBUILDING, traffic_class)
            return MetaReply(
                rows >= 0, readable, placements, sizes, 0.0, self._rebuilding, (), rows
            )
        now = self._clock.now()
        rows = self._index.find(words)
        found = rows >= 0
        hits = rows[found]
        unreadable_classes = np.zeros(0, np.uint8)
        if hits.size:
            placements[found], sizes[found], classes = self._index.locations(hits)
            readable_hits = self._readable(placements[found], down_nodes)
            readable[found] = readable_hits
            unreadable_classes = classes[~readable_hits]
            self._index.touch(hits, now)
        until = 0.0
        leased = int(readable.sum())
        if lease_for is not None and leased:
            until = now + lease_for
            self._index.acquire_lease(rows[readable], until)
            self._counters["leases"] += leased
        if unreadable_classes.size:
            self._count_unreadable(unreadable_classes, traffic_class)
        if leased + unreadable_classes.size < n:
            expired = lease_until is not None and lease_until <= now
            absent = words[~found]
            self._count_absent(absent, MissReason.LEASE_EXPIRED if expired else None, traffic_class)
        self._counters["lookup_keys"] += n
        self._counters["hit_keys"] += leased
        return MetaReply(
            found, readable, placements, sizes, until, False, tuple(sorted(self._down)), rows
        )

    def _miss_counts(self, name: str) -> dict[str, int]:
        counts = self._misses.get(name)
        if counts is None:
            counts = self._misses[name] = dict.fromkeys(MissReason.ALL, 0)
        return counts

    def _count_unreadable(self, classes: np.ndarray, traffic_class: str | None) -> None:
        """Committed but unreadable blocks, counted under the asking class (or their own)."""
        if traffic_class in self._misses:
            self._miss_counts(str(traffic_class))[MissReason.UNREADABLE] += int(classes.size)
            return
        for class_id, count in zip(*np.unique(classes, return_counts=True), strict=True):
            name = self.config.class_name(int(class_id))
            self._miss_counts(name)[MissReason.UNREADABLE] += int(count)

    def _count_absent(
        self, words: np.ndarray, reason: str | None, traffic_class: str | None
    ) -> None:
        """Keys not in the index. Without a ``reason``, the tombstone of a removed key says why
        (evicted, expired) and which class it had; otherwise it was never written."""
        known = traffic_class if traffic_class in self._misses else None
        if not self._tombstones:
            name = known or "unknown"
            self._miss_counts(name)[reason or MissReason.NEVER_WRITTEN] += int(words.shape[0])
            return
        raw = np.ascontiguousarray(words).tobytes()
        tomb_of = self._tombstones.get
        for start in range(0, len(raw), KEY_BYTES):
            tomb = tomb_of(raw[start : start + KEY_BYTES])
            why = reason or (tomb[0] if tomb is not None else MissReason.NEVER_WRITTEN)
            name = known or (self._class_name(tomb[1]) if tomb is not None else "unknown")
            self._miss_counts(name)[why] += 1

    def lookup(
        self,
        keys: Sequence[bytes] | np.ndarray,
        down_nodes: Sequence[int] = (),
        traffic_class: str | None = None,
        lease_seconds: float | None = None,
        release_keys: Sequence[bytes] | np.ndarray | None = None,
        release_rows: np.ndarray | None = None,
    ) -> MetaReply:
        """Which keys are committed and readable; leases every readable one (the client
        releases those beyond the consecutive prefix). ``keys``: 32-byte keys, or their (n, 4)
        uint64 / (n, 32) uint8 array (what the block client sends: no object per key).
        ``release_keys``/``release_rows``: leases to give back first (``release``), riding on
        this call instead of costing one of their own."""
        if release_keys is not None:
            self.release(release_keys, release_rows)
        words = self._key_array(keys)
        self._counters["lookups"] += 1
        lease_for = self.config.lease_seconds if lease_seconds is None else lease_seconds
        if lease_for <= 0:
            raise InvalidArgument("lease_seconds", f"must be > 0, got {lease_for}")
        return self._answer(words, down_nodes, traffic_class, None, lease_for)

    def lookup_wire(self, request: tuple[Any, ...]) -> tuple[Any, ...]:
        """``lookup`` with its arguments as one tuple and its reply as ``MetaReply.to_wire``:
        the form the block client calls across Ray (one argument, no dataclass). The releases
        riding on it are kept for ``after_reply``: the caller does not wait for them."""
        keys, down, traffic_class, lease_seconds, *release = request
        if release and release[0] is not None:
            self._after.append((release[0], release[1] if len(release) > 1 else None))
        return self.lookup(keys, down, traffic_class, lease_seconds).to_wire()

    def after_reply(self) -> None:
        """Apply the releases that rode on the lookups answered since the last call (a lease
        released a moment late only protects its blocks from the GC a moment longer)."""
        pending, self._after = self._after, []
        for keys, rows in pending:
            self.release(keys, rows)

    def locate(
        self,
        keys: Sequence[bytes] | np.ndarray,
        down_nodes: Sequence[int] = (),
        traffic_class: str | None = None,
        lease_until: float | None = None,
    ) -> MetaReply:
        """Like ``lookup`` without taking a lease (``lease_until``: the caller's lease, to tell a
        miss caused by its expiry)."""
        return self._answer(self._key_array(keys), down_nodes, traffic_class, lease_until, None)

    def release(self, keys: Sequence[bytes] | np.ndarray, rows: np.ndarray | None = None) -> int:
        """Release one lease on each of ``keys`` (unknown keys are ignored). ``rows``: the rows
        ``lookup`` answered for them, which saves the probe; a row that no longer holds its key
        (freed, or renumbered by a rebuild) is looked up again."""
        if self._rebuilding:
            return 0
        words = key_words(keys)
        if words.shape[0] == 0:
            return 0
        if rows is None:
            found = self._index.find(words)
        else:
            found = np.array(rows, dtype=np.int64)
            stale = ~self._index.rows_holding(found, words)
            if stale.any():
                found[stale] = self._index.find(words[stale])
        found = found[found >= 0]
        if found.size:
            self._index.release_lease(found)
        self._counters["releases"] += int(found.size)
        return int(found.size)

    # --- repair ----------------------------------------------------------------------------

    def mark_nodes(self, down: Sequence[int] = (), up: Sequence[int] = ()) -> list[int]:
        """Record nodes known dead (their shards do not count as readable); returns the set."""
        self._down |= {int(node) for node in down}
        self._down -= {int(node) for node in up}
        return sorted(self._down)

    @property
    def _lost_shards(self) -> bool:
        return self._repair.lost_shards

    @_lost_shards.setter
    def _lost_shards(self, value: bool) -> None:
        self._repair.lost_shards = value

    def repair_queue(
        self,
        dead_nodes: Sequence[int],
        draining_nodes: Sequence[int],
        limit: int,
        max_bytes: int,
        class_rank: Sequence[int] = (),
        refresh: bool = False,
    ) -> tuple[list[StripeRecord], dict[str, Any]]:
        """The next stripes to repair, most urgent first (``kvstore.blockstore.repairqueue``):
        up to ``limit``, about ``max_bytes`` of shards to read at most, with a shard lost (-1
        or on a dead node) or on a draining node (to move); and the queue's figures (stripes
        and shard bytes left, by urgency and per draining node). ``refresh`` rescans first."""
        if self._rebuilding or limit <= 0:
            return [], {"rebuilding": int(self._rebuilding)}
        dead = sorted({int(node) for node in dead_nodes})
        draining = sorted({int(node) for node in draining_nodes} - set(dead))
        rows, summary = self._repair.take(
            dead, draining, limit, max_bytes, list(class_rank), self._clock.now(), refresh
        )
        if rows.size == 0:
            return [], summary
        records = self._index.get(rows)
        stripes = [
            StripeRecord(
                key=records.keys[i],
                placement=records.placements[i].copy(),
                size=int(records.sizes[i]),
                class_id=int(records.classes[i]),
                created=float(records.created[i]),
            )
            for i in range(len(records))
        ]
        return stripes, summary

    def set_placements(self, moves: Sequence[tuple[bytes, int, int, int]]) -> list[bool]:
        """Batched compare-and-set of shard locations: (key, shard_index, new node, expected
        node). A move whose shard is no longer on ``expected`` (GC removed the block, another
        repair won) is refused. One index lookup for the batch (repair moves thousands)."""
        if self._rebuilding or not moves:
            return [False] * len(moves)
        rows = self._index.find([check_key(key) for key, _, _, _ in moves])
        found = np.flatnonzero(rows >= 0)
        current = np.full((len(moves), self._width), -2, dtype=np.int64)
        if found.size:
            current[found] = self._index.locations(rows[found])[0]
        answers = [False] * len(moves)
        for position in found.tolist():
            _key, index, node, expected = moves[position]
            row = int(rows[position])
            if int(current[position, int(index)]) != expected:
                continue
            self._index.set_placement(row, int(index), int(node))
            current[rows == row, int(index)] = int(node)  # a later move of the same shard sees it
            self._lost_shards |= node < 0
            answers[position] = True
        self._counters["placement_updates"] += sum(answers)
        return answers

    def set_placement(self, key: bytes, shard_index: int, node_id: int, expected: int) -> bool:
        """Move shard ``shard_index`` of ``key`` to ``node_id`` if it is still on ``expected``."""
        if self._rebuilding:
            return False
        row = int(self._index.find([check_key(key)])[0])
        if row < 0:
            return False
        current = int(self._index.get([row]).placements[0, int(shard_index)])
        if current != expected:
            return False
        self._index.set_placement(row, shard_index, node_id)
        self._lost_shards |= node_id < 0
        self._counters["placement_updates"] += 1
        return True

    def referenced(self, keys: Sequence[bytes], node_id: int) -> list[bool]:
        """Whether this shard still needs ``node_id``'s copy of each key (orphan scrub)."""
        if self._rebuilding:
            return [True] * len(keys)  # know nothing yet: keep everything
        checked = [check_key(key) for key in keys]
        rows = self._index.find(checked) if checked else np.zeros(0, np.int64)
        answer = [False] * len(checked)
        present = np.flatnonzero(rows >= 0)
        if present.size:
            placements = self._index.get(rows[present]).placements
            for j, row_position in enumerate(present.tolist()):
                answer[row_position] = bool((placements[j] == node_id).any())
        now = self._clock.now()
        for position, key in enumerate(checked):
            held = self._reservations.get(key)
            if held is not None and held[1] > now:
                answer[position] = True
        return answer

    # --- rebuild from manifests -------------------------------------------------------------

    @property
    def rebuilding(self) -> bool:
        return self._rebuilding

    def begin_rebuild(self) -> None:
        self._rebuilding = True
        self._rebuild_found = {}
        self._rebuild_sources = 0

    def absorb_manifest(self, node_id: int, table: pa.Table) -> int:
        """Add one node's manifest (``StorageNode.manifest``) to the rebuild; returns rows used."""
        if not self._rebuilding:
            raise InvalidArgument("absorb_manifest", "no rebuild in progress")
        columns = table.to_pydict()
        used = 0
        owners = (
            meta_shard_of(columns["key"], self.config.meta_shards)
            if columns["key"]
            else np.zeros(0, np.int64)
        )
        for position, key in enumerate(columns["key"]):
            if owners[position] != self.shard_id:
                continue
            index = int(columns["shard_index"][position])
            if not 0 <= index < self._width:
                continue
            writes = self._rebuild_found.setdefault(key, {})
            digest = columns["payload_hash"][position]
            found = writes.get(digest)
            if found is None:
                found = _Found(
                    [-1] * self._width,
                    [0.0] * self._width,
                    int(columns["payload_len"][position]),
                    int(columns["class_id"][position]),
                    float(columns["created"][position]),
                )
                writes[digest] = found
            stamp = float(columns["stamp"][position])
            if node_id in found.placement:
                continue  # one node never holds two shards of a stripe
            # Two copies of one shard (a node came back after its shard was repaired onto
            # another): the newer copy is the one the index pointed at.
            if found.placement[index] == -1 or stamp > found.stamps[index]:
                found.placement[index] = node_id
                found.stamps[index] = stamp
                used += 1
        self._rebuild_sources += 1
        return used

    def finish_rebuild(self) -> int:
        """Install the rebuilt entries (keys with >= k shards found); blocks committed while
        the rebuild ran are kept as they are. Returns the number of blocks restored."""
        if not self._rebuilding:
            return 0
        live_table = index_to_table(self._index)
        known = set(live_table.column("key").to_pylist()) if live_table.num_rows else set()
        keys: list[bytes] = []
        placements: list[list[int]] = []
        sizes: list[int] = []
        classes: list[int] = []
        created: list[float] = []
        for key, writes in self._rebuild_found.items():
            if key in known:
                continue
            # Several writes of one key (an old copy outlived an eviction and re-put): keep the
            # one with the most shards, the newest on a tie. Readers group shards by payload
            # hash anyway, so a stray old shard can never be mixed in.
            found = max(writes.values(), key=lambda f: (f.shards, f.created))
            if found.shards < self._k:
                continue
            keys.append(key)
            placements.append(found.placement)
            sizes.append(found.size)
            classes.append(found.class_id)
            created.append(found.created)
        if keys:
            restored = pa.table(
                {
                    "key": pa.array(keys, type=pa.binary(KEY_BYTES)),
                    "placement": pa.FixedSizeListArray.from_arrays(
                        pa.array(np.asarray(placements, np.int32).reshape(-1), pa.int32()),
                        self._width,
                    ),
                    "size": pa.array(sizes, pa.int64()),
                    "class": pa.array(classes, pa.uint8()),
                    "created": pa.array(created, pa.float64()),
                    "last_access": pa.array(created, pa.float64()),
                    "lease_until": pa.array([0.0] * len(keys), pa.float64()),
                    "lease_count": pa.array([0] * len(keys), pa.int32()),
                }
            )
            merged = pa.concat_tables(
                [
                    live_table.replace_schema_metadata(None),
                    restored.cast(live_table.schema.remove_metadata()),
                ]
            ).replace_schema_metadata(live_table.schema.metadata)
            self._index = index_from_table(merged)
        self._rebuilding = False
        self._lost_shards |= any(-1 in placement for placement in placements)
        self._rebuild_found = {}
        self._counters["rebuilds"] += 1
        self._counters["rebuilt_blocks"] += len(keys)
        return len(keys)

    # --- garbage collection ----------------------------------------------------------------

    def gc_expire(
        self,
        now: float,
        ttl_seconds_by_class: dict[str, float],
        basis: str = "last_access",
        limit: int | None = None,
    ) -> list[RemovedBlock]:
        """Remove unleased blocks past their class TTL (index first; the GC deletes shards)."""
        if self._rebuilding:
            return []
        unknown = set(ttl_seconds_by_class) - set(self.config.traffic_classes)
        if unknown:
            raise InvalidArgument("ttl_seconds_by_class", f"unknown classes {sorted(unknown)}")
        ttl = np.array(
            [ttl_seconds_by_class.get(name, np.inf) for name in self.config.traffic_classes],
            dtype=np.float64,
        )
        rows = self._index.expired_rows(now, ttl, basis, limit)  # type: ignore[arg-type]
        if rows.size == 0:
            return []
        keys = self._index.get(rows).keys
        removed = self._index.remove(keys, unless_leased_at=now)
        self._tombstone(removed, MissReason.EXPIRED)
        return self._removed(removed, MissReason.EXPIRED, now)

    def gc_lru_candidates(self, now: float, bytes_needed: int) -> list[tuple[float, bytes, int]]:
        """(last_access, key, size) of unleased blocks, least recently used first."""
        if self._rebuilding:
            return []
        rows = self._index.lru_rows(now, bytes_needed)
        records = self._index.get(rows)
        return [
            (float(records.last_access[i]), bytes(records.keys[i]), int(records.sizes[i]))
            for i in range(len(records))
        ]

    def gc_evict(
        self, keys: Sequence[bytes], now: float, chosen_at: float | None = None
    ) -> list[RemovedBlock]:
        """Remove ``keys`` unless leased at ``now`` or, given ``chosen_at`` (when the evictor
        read them as least recently used), accessed since: a pass takes seconds on a busy tier,
        and a block hit meanwhile is no longer the one to evict. Checked at removal time."""
        if self._rebuilding or not keys:
            return []
        removed = self._index.remove(
            [check_key(key) for key in keys], unless_leased_at=now, unless_used_after=chosen_at
        )
        self._tombstone(removed, MissReason.EVICTED)
        return self._removed(removed, MissReason.EVICTED, now)

    def stored_bytes_by_class(self) -> dict[str, int]:
        by_class = self._index.bytes_by_class(len(self.config.traffic_classes))
        return {name: int(by_class[i]) for i, name in enumerate(self.config.traffic_classes)}

    # --- introspection ---------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def snapshot_table(self) -> pa.Table:
        return index_to_table(self._index)

    def stats(self) -> dict[str, object]:
        return {
            "shard_id": self.shard_id,
            "blocks": len(self._index),
            "bytes": self._index.total_bytes(),
            "bytes_by_class": self.stored_bytes_by_class(),
            "rebuilding": self._rebuilding,
            "down_nodes": sorted(self._down),
            "reservations": len(self._reservations),
            "misses": {name: dict(reasons) for name, reasons in self._misses.items()},
            "index_memory_bytes": self._index.memory_bytes(),
            "under_redundant_stripes": self._under_redundant_stripes(),
            **self._counters,
        }

    def _under_redundant_stripes(self) -> int:
        """Live stripes with fewer than k+m shards placed on nodes not known dead (a chunk of
        rows at a time: no Python object per row, and bounded memory on a large index)."""
        live = self._index.live_rows()
        down = np.fromiter(self._down, dtype=np.int64, count=len(self._down))
        count = 0
        for offset in range(0, live.size, 65536):
            placements = self._index.locations(live[offset : offset + 65536])[0]
            healthy = placements >= 0
            if down.size:
                healthy &= ~np.isin(placements, down)
            count += int((healthy.sum(axis=1) < self._width).sum())
        return count


if TYPE_CHECKING:
    # The plain object answers every call a client makes through a fanout (``calls.py``).
    _calls: type[MetaShardCalls] = MetaShard
