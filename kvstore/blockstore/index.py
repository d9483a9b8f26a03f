"""The compact columnar block index: what a meta shard knows about each block it owns.

Why columnar: the index is the part of the tier that grows with the cache. 1 PB of 111 KiB blocks
is ~9 billion entries; at Python-object prices (a dict entry plus a dataclass is several hundred
bytes) that is petabytes of RAM for metadata alone. Here one block costs a fixed row across numpy
columns plus a slot of an open-addressing hash table, ~80-115 bytes all told (measured by
``benchmarks/gc.py``), and every GC decision is a vectorised scan over the columns.

Columns (one row per block; ``W`` = stripe width, 12 for 10+2):

=============  ==============  ============================================================
column         dtype           meaning
=============  ==============  ============================================================
key            uint64 x 4      the 32-byte block key, as four native-endian words
placement      uint16 x W      storage node id holding shard i (``0xFFFF`` = none, -1 in API)
size           uint32          block payload bytes (< 4 GiB; a block is ~111 KiB)
class          uint8           traffic class id (position in the configured class names);
                               255 marks a free row
created        uint32          seconds since the Unix epoch, rounded *up*
last_access    float64         seconds since the Unix epoch, exact (LRU needs a total order)
lease_until    uint32          seconds since the Unix epoch, rounded *up*; 0 = no lease
lease_count    uint16          leases acquired and not yet released; saturates at 65,535
                               (then only ``lease_until`` ends the lease: see acquire_lease)
=============  ==============  ============================================================

Times: the API takes and returns float seconds since the Unix epoch (what ``kvstore.clock``
gives). ``created`` and ``lease_until`` are stored as uint32 whole seconds (valid until 2106)
rounded up, which is the conservative direction for both: a block never expires early and a
lease never ends early (each can last up to one second longer). ``last_access`` stays float64
so least-recently-used order is exact.

Key -> row map: an open-addressing (linear probing) table of int32 row numbers, sized a power of
two and kept at most 70 % full; the slot is chosen by a multiplicative hash of the XOR of the
key's four words (keys are BLAKE2b digests, but tests and tools use structured keys too). Removal
leaves a tombstone; the table is rebuilt (vectorised) when live + tombstones pass 70 %. Inserts
run as vectorised probe rounds over the whole batch; lookups in C (``_probe.c``, one pass).

Rows of removed blocks go on a free stack and are reused by the next inserts, so row numbers are
only meaningful until the next ``remove``. Not thread-safe: a meta shard (one Ray actor, one
thread) owns one index.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey, key_words, words_to_keys

_native: ModuleType | None
try:  # the probe loop in C; without a compiler at install, the numpy reference serves
    from kvstore.blockstore import _probe as _native
except ImportError:  # pragma: no cover - the CI machine builds it
    _native = None

#: Value of the ``class`` column that marks a free (unused) row.
FREE_CLASS = 255
#: Largest traffic class id a block may carry.
MAX_CLASS = FREE_CLASS - 1
#: Largest storage node id a placement may name (uint16, 0xFFFF reserved for "none").
MAX_NODE_ID = 0xFFFE
_NO_NODE = 0xFFFF
_MAX_SIZE = 2**32 - 1
_MAX_TIME = float(2**32 - 1)
_MAX_LEASES = 2**16 - 1

_EMPTY = -1
_TOMBSTONE = -2
#: A slot ``claim_slots`` holds for a key of the batch it inserts (-3 - its position).
_CLAIMED = -3
_MAX_LOAD = 0.7
_MIN_TABLE = 1024
_GROWTH = 1.25
_HASH_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)

TimeBasis = Literal["last_access", "created"]


@dataclass(frozen=True)
class BlockRecords:
    """A copy of some rows of the index (arrays aligned with ``rows``)."""

    rows: np.ndarray  # int64 (n,)
    keys: list[BlockKey]
    placements: np.ndarray  # int32 (n, stripe_width); -1 = no node
    sizes: np.ndarray  # int64 (n,)
    classes: np.ndarray  # uint8 (n,)
    created: np.ndarray  # float64 (n,) seconds since the epoch (whole seconds)
    last_access: np.ndarray  # float64 (n,)
    lease_until: np.ndarray  # float64 (n,); 0 = no lease
    lease_count: np.ndarray  # int32 (n,)

    def __len__(self) -> int:
        return int(self.rows.size)


#: Keys <-> the key column's (n, 4) uint64 format (``kvstore.keys``), under the index's names.
keys_to_array = key_words
array_to_keys = words_to_keys


def _claim(table: np.ndarray, at: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """One winner per distinct slot among ``candidates`` (whose slots ``at[candidates]`` are all
    empty): each writes its own negative code, and whoever's code stuck owns the slot. No sort.
    The caller then overwrites every claimed slot with a real row."""
    slots = at[candidates]
    codes = (-3 - np.arange(candidates.size, dtype=np.int64)).astype(np.int32)
    table[slots] = codes
    return candidates[table[slots] == codes]


def _next_pow2(value: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, value))))


def _check_time(value: float, argument: str) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0 or value > _MAX_TIME:
        raise InvalidArgument(
            argument, f"must be seconds since the Unix epoch in [0, 2**32), got {value}"
        )
    return value


class BlockIndex:
    """Key -> (placement, size, class, times, leases) for the blocks one meta shard owns."""

    def __init__(self, stripe_width: int = 12, initial_capacity: int = 1024) -> None:
        if isinstance(stripe_width, bool) or not isinstance(stripe_width, int):
            raise InvalidArgument("stripe_width", f"must be an int, got {stripe_width!r}")
        if not 1 <= stripe_width <= 255:
            raise InvalidArgument("stripe_width", f"must be in [1, 255], got {stripe_width}")
        if initial_capacity < 1:
            raise InvalidArgument("initial_capacity", f"must be >= 1, got {initial_capacity}")
        self._width = stripe_width
        self._live = 0  # live rows
        self._high = 0  # rows [0, high) are in use or on the free stack
        self._allocate_columns(initial_capacity)
        self._free = np.zeros(0, dtype=np.int32)
        self._free_count = 0
        self._table = np.full(_MIN_TABLE, _EMPTY, dtype=np.int32)
        self._used_slots = 0  # live entries + tombstones in the table

    # --- storage ---------------------------------------------------------------------------

    def _allocate_columns(self, capacity: int) -> None:
        self._key = np.zeros((capacity, 4), dtype=np.uint64)
        self._placement = np.full((capacity, self._width), _NO_NODE, dtype=np.uint16)
        self._size = np.zeros(capacity, dtype=np.uint32)
        self._class = np.full(capacity, FREE_CLASS, dtype=np.uint8)
        self._created = np.zeros(capacity, dtype=np.uint32)
        self._last = np.zeros(capacity, dtype=np.float64)
        self._lease_until = np.zeros(capacity, dtype=np.uint32)
        self._lease_count = np.zeros(capacity, dtype=np.uint16)

    def _columns(self) -> tuple[str, ...]:
        return (
            "_key",
            "_placement",
            "_size",
            "_class",
            "_created",
            "_last",
            "_lease_until",
            "_lease_count",
        )

    def _grow_columns(self, needed: int) -> None:
        capacity = self._class.size
        if needed <= capacity:
            return
        new_capacity = max(needed, int(capacity * _GROWTH) + 1)
        for name in self._columns():
            old = getattr(self, name)
            fill = FREE_CLASS if name == "_class" else (_NO_NODE if name == "_placement" else 0)
            new = np.full((new_capacity, *old.shape[1:]), fill, dtype=old.dtype)
            new[: self._high] = old[: self._high]
            setattr(self, name, new)

    def _allocate_rows(self, count: int) -> np.ndarray:
        """Row numbers for ``count`` new blocks: freed rows first, then fresh ones."""
        reused = min(count, self._free_count)
        rows = np.empty(count, dtype=np.int64)
        if reused:
            rows[:reused] = self._free[self._free_count - reused : self._free_count]
            self._free_count -= reused
        fresh = count - reused
        if fresh:
            self._grow_columns(self._high + fresh)
            rows[reused:] = np.arange(self._high, self._high + fresh, dtype=np.int64)
            self._high += fresh
        return rows

    def _push_free(self, rows: np.ndarray) -> None:
        needed = self._free_count + rows.size
        if needed > self._free.size:
            grown = np.zeros(max(needed, int(self._free.size * _GROWTH) + 16), dtype=np.int32)
            grown[: self._free_count] = self._free[: self._free_count]
            self._free = grown
        self._free[self._free_count : needed] = rows
        self._free_count = needed

    def memory_bytes(self) -> int:
        """Bytes allocated by the index: every column (with its spare capacity), the hash table
        and the free stack. Python object headers (a few hundred bytes in all) are not counted."""
        total = sum(getattr(self, name).nbytes for name in self._columns())
        return int(total + self._table.nbytes + self._free.nbytes)

    # --- hash table ------------------------------------------------------------------------

    def _home(self, keys4: np.ndarray) -> np.ndarray:
        mixed = keys4[:, 0] ^ keys4[:, 1] ^ keys4[:, 2] ^ keys4[:, 3]
        bits = int(self._table.size).bit_length() - 1
        with np.errstate(over="ignore"):
            hashed = mixed * _HASH_MULTIPLIER
        return (hashed >> np.uint64(64 - bits)).astype(np.int64)

    def _reserve_slots(self, extra: int) -> None:
        if self._used_slots + extra <= _MAX_LOAD * self._table.size:
            return
        size = max(_MIN_TABLE, _next_pow2(2 * (self._live + extra)))
        self._rebuild_table(size)

    def _rebuild_table(self, size: int) -> None:
        self._table = np.full(size, _EMPTY, dtype=np.int32)
        self._used_slots = 0
        rows = np.flatnonzero(self._class[: self._high] != FREE_CLASS)
        self._place(rows)

    def _place(self, rows: np.ndarray) -> None:
        """Insert ``rows`` (whose keys are distinct and absent from the table)."""
        mask = self._table.size - 1
        slots = self._home(self._key[rows])
        pending = np.arange(rows.size)
        table = self._table
        while pending.size:
            at = slots[pending]
            empty = table[at] == _EMPTY
            candidates = np.flatnonzero(empty)
            placed = np.zeros(pending.size, dtype=bool)
            if candidates.size:
                winners = _claim(table, at, candidates)
                table[at[winners]] = rows[pending[winners]]
                placed[winners] = True
            moving = pending[~placed]
            slots[moving] = (slots[moving] + 1) & mask
            pending = moving
        self._used_slots += rows.size

    def _insert(self, keys4: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Find or add ``keys4``: (rows, is_new: the first occurrence of a key this call added).
        In C when the extension is built (``claim_slots``: an upsert of 16 keys took ~15 numpy
        probe rounds, as many as its longest chain), else ``_probe``, the reference."""
        if _native is None:
            rows, _, is_new = self._probe(keys4, insert=True)
            return rows, is_new
        n = keys4.shape[0]
        self._reserve_slots(n)
        rows = np.empty(n, dtype=np.int64)
        slots = np.empty(n, dtype=np.int64)
        first = np.empty(n, dtype=np.int64)
        keys4 = np.ascontiguousarray(keys4)
        bits = int(self._table.size).bit_length() - 1
        table = self._table
        try:
            _native.claim_slots(
                table, self._key, keys4, rows, slots, first, int(_HASH_MULTIPLIER), bits
            )
            is_new = first == np.arange(n)
            new_rows = self._allocate_rows(int(is_new.sum()))
        except BaseException:
            table[table <= _CLAIMED] = _EMPTY  # give back the slots claimed for new keys
            raise
        self._key[new_rows] = keys4[is_new]
        self._class[new_rows] = 0  # live (a table rebuild keeps it); upsert sets the real class
        table[slots[is_new]] = new_rows
        rows[is_new] = new_rows
        again = (rows < 0) & ~is_new  # a key repeated in this call: its first position's row
        rows[again] = rows[first[again]]
        self._used_slots += new_rows.size
        self._live += new_rows.size
        return rows, is_new

    def _probe(self, keys4: np.ndarray, insert: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Find (and with ``insert``, add) keys. Returns (rows, slots, is_new).

        rows[i] = -1 when key i is absent (only without ``insert``); slots[i] is the table slot
        holding it; is_new[i] is True for the first occurrence of a key this call inserted.
        """
        n = keys4.shape[0]
        if insert:
            if n > 4096:
                # Count the new keys first, then size the table and the columns once, exactly,
                # instead of growing columns by 25 % per probe round (leaving up to a quarter of
                # every column unused) or reserving table room for keys that already exist.
                missing = int((self.find(keys4) < 0).sum())
                self._reserve_slots(missing)
                self._grow_columns(self._high + max(0, missing - self._free_count))
            else:
                self._reserve_slots(n)
        table = self._table
        mask = table.size - 1
        slots = self._home(keys4)
        rows = np.full(n, -1, dtype=np.int64)
        is_new = np.zeros(n, dtype=bool)
        pending = np.arange(n)
        while pending.size:
            at = slots[pending]
            occupant = table[at].astype(np.int64)
            matched = np.zeros(pending.size, dtype=bool)
            live = np.flatnonzero(occupant >= 0)
            if live.size:
                same = (self._key[occupant[live]] == keys4[pending[live]]).all(axis=1)
                matched[live[same]] = True
                rows[pending[live[same]]] = occupant[live[same]]
            empty = occupant == _EMPTY
            if not insert:
                finished = matched | empty
                advance = ~finished
            else:
                claimed = np.zeros(pending.size, dtype=bool)
                candidates = np.flatnonzero(empty)
                if candidates.size:
                    winners = _claim(table, at, candidates)
                    new_rows = self._allocate_rows(winners.size)
                    self._key[new_rows] = keys4[pending[winners]]
                    # A class must be set now so a table rebuild would see the row as live;
                    # the caller overwrites it with the real class.
                    self._class[new_rows] = 0
                    table[at[winners]] = new_rows
                    rows[pending[winners]] = new_rows
                    is_new[pending[winners]] = True
                    claimed[winners] = True
                    self._used_slots += winners.size
                    self._live += winners.size
                # Losers of a claim stay on their slot: next round they see the winner's key and
                # either match it (a duplicate in this batch) or move on.
                finished = matched | claimed
                advance = ~(finished | empty)
            moving = pending[advance]
            slots[moving] = (slots[moving] + 1) & mask
            pending = pending[~finished]
        return rows, slots, is_new

    # --- validation ------------------------------------------------------------------------

    def _check_rows(self, rows: Sequence[int] | np.ndarray, argument: str = "rows") -> np.ndarray:
        array = np.asarray(rows)
        if array.ndim == 0:
            array = array.reshape(1)
        if array.ndim != 1:
            raise InvalidArgument(argument, f"must be one-dimensional, got shape {array.shape}")
        if array.size == 0:
            return np.zeros(0, dtype=np.int64)
        if not np.issubdtype(array.dtype, np.integer):
            raise InvalidArgument(argument, f"must be integers, got dtype {array.dtype}")
        array = array.astype(np.int64, copy=False)
        if array.min() < 0 or array.max() >= self._high:
            raise InvalidArgument(argument, f"row out of range [0, {self._high})")
        if (self._class[array] == FREE_CLASS).any():
            bad = int(array[self._class[array] == FREE_CLASS][0])
            raise InvalidArgument(argument, f"row {bad} holds no block")
        return array

    def _last_occurrences(self, rows: np.ndarray) -> np.ndarray:
        """Positions of the last occurrence of each distinct row, ascending.

        numpy leaves the order of repeated fancy assignments unspecified, so a key given twice
        in one upsert keeps exactly one position (the last) explicitly."""
        n = rows.size
        positions = np.arange(n, dtype=np.int64)
        if n <= 4096 or n < self._high // 8:
            _, last_reversed = np.unique(rows[::-1], return_index=True)
            if last_reversed.size == n:
                return positions
            return np.sort(n - 1 - last_reversed)
        # Big batch: a scatter of positions over a row-sized scratch beats sorting n rows.
        owner = np.full(self._high, -1, dtype=np.int64)
        np.maximum.at(owner, rows, positions)
        return positions[owner[rows] == positions]

    def _check_node(self, node_id: int, argument: str) -> int:
        if isinstance(node_id, bool) or not isinstance(node_id, int | np.integer):
            raise InvalidArgument(argument, f"must be an int, got {node_id!r}")
        node = int(node_id)
        if node != -1 and not 0 <= node <= MAX_NODE_ID:
            raise InvalidArgument(argument, f"must be -1 or in [0, {MAX_NODE_ID}], got {node}")
        return _NO_NODE if node == -1 else node

    # --- public API ------------------------------------------------------------------------

    @property
    def stripe_width(self) -> int:
        return self._width

    def __len__(self) -> int:
        return self._live

    def upsert(
        self,
        keys: Sequence[BlockKey] | np.ndarray,
        placements: np.ndarray,
        sizes: np.ndarray | Sequence[int],
        classes: np.ndarray | Sequence[int],
        now: float,
    ) -> np.ndarray:
        """Insert or replace blocks; returns their rows (int64, aligned with ``keys``).

        New blocks: created = last_access = now, no lease. Existing blocks: placement, size and
        class replaced, last_access = max(last_access, now), created and leases kept. A key given
        twice in one call takes the values of its last occurrence.
        """
        keys4 = keys_to_array(keys)
        n = keys4.shape[0]
        now = _check_time(now, "now")
        placement_array = np.asarray(placements)
        if placement_array.shape != (n, self._width):
            raise InvalidArgument(
                "placements", f"must have shape ({n}, {self._width}), got {placement_array.shape}"
            )
        if n and not np.issubdtype(placement_array.dtype, np.integer):
            raise InvalidArgument("placements", f"must be integers, got {placement_array.dtype}")
        if n and (placement_array.min() < -1 or placement_array.max() > MAX_NODE_ID):
            raise InvalidArgument("placements", f"node ids must be -1 or in [0, {MAX_NODE_ID}]")
        size_array = np.asarray(sizes)
        if size_array.shape != (n,):
            raise InvalidArgument("sizes", f"must have shape ({n},), got {size_array.shape}")
        if n and (
            not np.issubdtype(size_array.dtype, np.integer)
            or size_array.min() < 0
            or size_array.max() > _MAX_SIZE
        ):
            raise InvalidArgument("sizes", f"must be integers in [0, {_MAX_SIZE}]")
        class_array = np.asarray(classes)
        if class_array.shape != (n,):
            raise InvalidArgument("classes", f"must have shape ({n},), got {class_array.shape}")
        if n and (
            not np.issubdtype(class_array.dtype, np.integer)
            or class_array.min() < 0
            or class_array.max() > MAX_CLASS
        ):
            raise InvalidArgument("classes", f"must be integers in [0, {MAX_CLASS}]")
        if n == 0:
            return np.zeros(0, dtype=np.int64)

        rows, is_new = self._insert(keys4)
        # Last occurrence wins for duplicated keys: numpy leaves the order of repeated fancy
        # assignments unspecified, so keep one position per row explicitly.
        chosen = self._last_occurrences(rows)
        target = rows[chosen]
        self._placement[target] = np.where(
            placement_array[chosen] < 0, _NO_NODE, placement_array[chosen]
        ).astype(np.uint16)
        self._size[target] = size_array[chosen].astype(np.uint32)
        self._class[target] = class_array[chosen].astype(np.uint8)
        new_rows = rows[is_new]
        self._created[new_rows] = np.uint32(math.ceil(now))
        self._last[new_rows] = now
        self._lease_until[new_rows] = 0
        self._lease_count[new_rows] = 0
        self._last[target] = np.maximum(self._last[target], now)
        return rows

    def find(self, keys: Sequence[BlockKey] | np.ndarray) -> np.ndarray:
        """Rows of ``keys`` (int64), -1 where a key is absent. In C when the extension is built
        (``_probe.c``: one pass instead of a numpy round per probe step), else ``_probe``."""
        keys4 = keys_to_array(keys)
        if keys4.shape[0] == 0:
            return np.zeros(0, dtype=np.int64)
        if _native is None:
            return self._probe(keys4, insert=False)[0]
        rows = np.empty(keys4.shape[0], dtype=np.int64)
        bits = int(self._table.size).bit_length() - 1
        keys4 = np.ascontiguousarray(keys4)
        _native.find_rows(self._table, self._key, keys4, rows, int(_HASH_MULTIPLIER), bits)
        return rows

    def get(self, rows: Sequence[int] | np.ndarray) -> BlockRecords:
        """A copy of the given rows."""
        array = self._check_rows(rows)
        placement = self._placement[array].astype(np.int32)
        placement[placement == _NO_NODE] = -1
        return BlockRecords(
            rows=array.copy(),
            keys=array_to_keys(self._key[array]),
            placements=placement,
            sizes=self._size[array].astype(np.int64),
            classes=self._class[array].copy(),
            created=self._created[array].astype(np.float64),
            last_access=self._last[array].copy(),
            lease_until=self._lease_until[array].astype(np.float64),
            lease_count=self._lease_count[array].astype(np.int32),
        )

    def locations(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(placements int32 with -1 for none, sizes int64, classes uint8) of ``rows``: what a
        lookup answers, without the per-key objects of ``get``."""
        array = self._check_rows(rows)
        placement = self._placement[array].astype(np.int32)
        placement[placement == _NO_NODE] = -1
        return placement, self._size[array].astype(np.int64), self._class[array]

    def rows_holding(self, rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """True where ``rows[i]`` is a live row holding key ``keys[i]`` ((n, 4) uint64): lets a
        caller that remembered rows act on them directly, safe against a row freed and reused
        (or renumbered by a restart) since."""
        array = np.asarray(rows, dtype=np.int64)
        words = keys_to_array(keys)
        if array.shape != (words.shape[0],):
            raise InvalidArgument("rows", f"must have one row per key, got {array.shape}")
        ok = (array >= 0) & (array < self._high)
        inside = np.flatnonzero(ok)
        ok[inside] = (self._class[array[inside]] != FREE_CLASS) & (
            self._key[array[inside]] == words[inside]
        ).all(axis=1)
        return ok

    def touch(self, rows: Sequence[int] | np.ndarray, now: float | np.ndarray) -> None:
        """Record an access at ``now`` (last access never moves backwards). ``now`` may also be
        an array of times aligned with ``rows`` (replaying an access log, a rebuild)."""
        array = self._check_rows(rows)
        if np.ndim(now) == 0:
            when = _check_time(float(now), "now")
            self._last[array] = np.maximum(self._last[array], when)
            return
        times = np.asarray(now, dtype=np.float64)
        if times.shape != array.shape:
            raise InvalidArgument("now", f"must be one time or {array.size} times")
        if times.size and not (
            np.isfinite(times).all() and times.min() >= 0 and times.max() <= _MAX_TIME
        ):
            raise InvalidArgument("now", "times must be seconds since the Unix epoch in [0, 2**32)")
        np.maximum.at(self._last, array, times)  # repeated rows: the latest time wins

    def acquire_lease(self, rows: Sequence[int] | np.ndarray, until: float) -> None:
        """Take one lease on each row, valid until ``until`` (the later of old and new ends).

        Never fails for being asked too often: a count that would pass 65,535 saturates there
        and stays (``release_lease`` leaves it), so the row is held until its ``lease_until``
        passes — a block never loses a lease early, and no lookup fails because of how many
        others hold the same block."""
        array = self._check_rows(rows)
        until = _check_time(until, "until")
        touched, counts = np.unique(array, return_counts=True)
        after = np.minimum(self._lease_count[touched].astype(np.int64) + counts, _MAX_LEASES)
        self._lease_count[touched] = after.astype(np.uint16)
        self._lease_until[touched] = np.maximum(
            self._lease_until[touched], np.uint32(math.ceil(until))
        )

    def release_lease(self, rows: Sequence[int] | np.ndarray) -> None:
        """Give back one lease per row occurrence; a row whose count reaches 0 is unleased.

        Releasing more leases than were taken stops at 0 (a late release after a crash or a
        retry is harmless). A saturated count is not lowered: how many it stands for is no
        longer known, so only the lease's end frees the row."""
        array = self._check_rows(rows)
        if array.size == 0:
            return
        touched, counts = np.unique(array, return_counts=True)
        before = self._lease_count[touched].astype(np.int64)
        after = np.where(before == _MAX_LEASES, before, np.maximum(before - counts, 0))
        self._lease_count[touched] = after.astype(np.uint16)
        self._lease_until[touched[after == 0]] = 0

    def is_leased(self, rows: Sequence[int] | np.ndarray, now: float) -> np.ndarray:
        """True where a row holds at least one lease that has not ended at ``now``."""
        array = self._check_rows(rows)
        return (self._lease_count[array] > 0) & (self._lease_until[array] > now)

    def set_placement(self, row: int, shard_index: int, node_id: int) -> None:
        """Record that shard ``shard_index`` of the block at ``row`` now lives on ``node_id``
        (-1: nowhere)."""
        array = self._check_rows([row], "row")
        if isinstance(shard_index, bool) or not isinstance(shard_index, int | np.integer):
            raise InvalidArgument("shard_index", f"must be an int, got {shard_index!r}")
        if not 0 <= int(shard_index) < self._width:
            raise InvalidArgument(
                "shard_index", f"must be in [0, {self._width}), got {shard_index}"
            )
        self._placement[array[0], int(shard_index)] = self._check_node(node_id, "node_id")

    def remove(
        self,
        keys: Sequence[BlockKey] | np.ndarray,
        unless_leased_at: float | None = None,
        unless_used_after: float | None = None,
    ) -> BlockRecords:
        """Remove blocks; returns the records of those removed (absent keys are skipped).

        With ``unless_leased_at=now``, blocks leased at ``now`` are kept and not returned, so a
        caller checks leases and removes in one step. With ``unless_used_after=t``, so are
        blocks last accessed after ``t`` (an evictor that chose them as least recently used at
        ``t`` must not evict one a reader has used since)."""
        keys4 = keys_to_array(keys)
        if keys4.shape[0] == 0:
            return self.get(np.zeros(0, dtype=np.int64))
        rows, slots, _ = self._probe(keys4, insert=False)
        present = rows >= 0
        rows, slots = rows[present], slots[present]
        rows, first = np.unique(rows, return_index=True)
        slots = slots[first]
        if unless_leased_at is not None and rows.size:
            free = ~self.is_leased(rows, unless_leased_at)
            rows, slots = rows[free], slots[free]
        if unless_used_after is not None and rows.size:
            unused = self._last[rows] <= unless_used_after
            rows, slots = rows[unused], slots[unused]
        removed = self.get(rows)
        self._table[slots] = _TOMBSTONE
        self._class[rows] = FREE_CLASS
        self._placement[rows] = _NO_NODE
        self._lease_count[rows] = 0
        self._lease_until[rows] = 0
        self._push_free(rows)
        self._live -= rows.size
        return removed

    # --- scans (vectorised over every row) ---------------------------------------------------

    def _live_mask(self) -> np.ndarray:
        return self._class[: self._high] != FREE_CLASS

    def _unleased_mask(self, now: float) -> np.ndarray:
        high = self._high
        leased = (self._lease_count[:high] > 0) & (self._lease_until[:high] > now)
        return self._live_mask() & ~leased

    def live_rows(self) -> np.ndarray:
        """Every row that holds a block, ascending."""
        return np.flatnonzero(self._live_mask())

    def expired_rows(
        self,
        now: float,
        ttl_by_class: np.ndarray | Sequence[float],
        basis: TimeBasis = "last_access",
        limit: int | None = None,
    ) -> np.ndarray:
        """Unleased rows whose age at ``now`` exceeds their class's TTL (strictly), ascending.

        ``ttl_by_class[c]`` is the TTL in seconds of class id ``c`` (``inf`` = never expires;
        a class beyond the array never expires). Age is measured from ``basis``."""
        now = _check_time(now, "now")
        ttl = np.asarray(ttl_by_class, dtype=np.float64)
        if ttl.ndim != 1 or ttl.size > MAX_CLASS + 1:
            raise InvalidArgument("ttl_by_class", f"must be 1-D with <= {MAX_CLASS + 1} entries")
        if np.isnan(ttl).any() or (ttl < 0).any():
            raise InvalidArgument("ttl_by_class", "TTLs must be >= 0 seconds")
        if basis not in ("last_access", "created"):
            raise InvalidArgument("basis", f"must be 'last_access' or 'created', got {basis!r}")
        if limit is not None and limit < 0:
            raise InvalidArgument("limit", f"must be >= 0, got {limit}")
        high = self._high
        # Expired iff time < now - ttl[class]: one gather of a 256-entry threshold table per row
        # (free rows map to -inf and never match).
        threshold = np.full(FREE_CLASS + 1, -np.inf)
        threshold[: ttl.size] = now - ttl
        column = self._last[:high] if basis == "last_access" else self._created[:high]
        expired = column < threshold[self._class[:high]]
        expired &= (self._lease_count[:high] == 0) | (self._lease_until[:high] <= now)
        rows = np.flatnonzero(expired)
        return rows if limit is None else rows[:limit]

    def lru_rows(
        self, now: float, bytes_needed: int, exclude_rows: np.ndarray | None = None
    ) -> np.ndarray:
        """Unleased rows, least recently used first: the shortest such prefix whose sizes sum to
        at least ``bytes_needed`` (every unleased row when they do not reach it). Ties in last
        access are broken by row number. ``exclude_rows`` are skipped (a planner passes the rows
        it already expires)."""
        now = _check_time(now, "now")
        if bytes_needed < 0:
            raise InvalidArgument("bytes_needed", f"must be >= 0, got {bytes_needed}")
        if bytes_needed == 0:
            return np.zeros(0, dtype=np.int64)
        mask = self._unleased_mask(now)
        if exclude_rows is not None and len(exclude_rows):
            mask[self._check_rows(exclude_rows, "exclude_rows")] = False
        count = int(np.count_nonzero(mask))
        if count == 0:
            return np.zeros(0, dtype=np.int64)
        high = self._high
        # Non-candidates get +inf: they never fall under a finite access-time threshold.
        last = np.where(mask, self._last[:high], np.inf)
        mean_size = max(1.0, float(np.sum(self._size[:high], where=mask, dtype=np.int64)) / count)
        want = int(math.ceil(bytes_needed / mean_size * 1.05)) + 64
        # A systematic sample of the column estimates the access time below which ``want``
        # candidates lie; one comparison pass then selects them. Cheaper than partitioning the
        # whole column, and exact all the same: every row at or below the threshold is taken
        # (ties included) and sorted, and a threshold that proves too low is raised.
        stride = max(1, high // 65536)
        sample = np.sort(last[::stride])
        sample = sample[: np.searchsorted(sample, np.inf)]
        while True:
            if want >= count or sample.size < 1024:
                threshold = np.inf if want >= count else np.partition(last, want - 1)[want - 1]
            else:
                # 10 % over the estimate: a 65,536-row sample misjudges a 5 % quantile by ~2 %.
                position = min(sample.size - 1, int(want / count * sample.size * 1.1) + 32)
                threshold = sample[position]
            rows = (
                np.flatnonzero(mask) if threshold == np.inf else np.flatnonzero(last <= threshold)
            )
            if rows.size < min(want, count) and threshold != np.inf:
                want = min(count, want * 2)  # the sample under-estimated: widen
                continue
            # rows ascend, so a stable sort by access time breaks ties by row number.
            order = rows[np.argsort(last[rows], kind="stable")]
            cumulative = np.cumsum(self._size[order], dtype=np.int64)
            if cumulative[-1] >= bytes_needed or order.size >= count:
                cut = int(np.searchsorted(cumulative, bytes_needed, side="left")) + 1
                return order[: min(cut, order.size)]
            want *= 2

    def rows_on_node(self, node_id: int) -> np.ndarray:
        """Rows with at least one shard on ``node_id``, ascending."""
        node = self._check_node(node_id, "node_id")
        high = self._high
        on_node = (self._placement[:high] == node).any(axis=1)
        return np.flatnonzero(on_node & self._live_mask())

    def shard_shortfall(
        self,
        bad_nodes: Sequence[int],
        moving_nodes: Sequence[int] = (),
        rows: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, lost, moving) of the live rows (of ``rows``, or all) that miss a shard or hold
        one on a moving node: ``lost`` counts shards recorded lost (-1) or on ``bad_nodes``,
        ``moving`` those on ``moving_nodes`` (a drain). Vectorised, in chunks (bounded memory)."""
        bad = np.asarray([_NO_NODE, *(self._check_node(n, "bad_nodes") for n in bad_nodes)])
        moving = np.asarray([self._check_node(n, "moving_nodes") for n in moving_nodes])
        if rows is None:
            rows = self.live_rows()
        else:
            rows = np.asarray(rows, dtype=np.int64)
            inside = rows[(rows >= 0) & (rows < self._high)]
            rows = inside[self._class[inside] != FREE_CLASS]
        found, lost_out, moving_out = [], [], []
        for start in range(0, rows.size, 1 << 16):
            chunk = rows[start : start + (1 << 16)]
            placement = self._placement[chunk]
            lost = np.isin(placement, bad).sum(axis=1)
            move = np.isin(placement, moving).sum(axis=1) if moving.size else np.zeros_like(lost)
            keep = (lost > 0) | (move > 0)
            found.append(chunk[keep])
            lost_out.append(lost[keep])
            moving_out.append(move[keep])
        if not found:
            empty = np.zeros(0, np.int64)
            return empty, empty, empty
        return (
            np.concatenate(found).astype(np.int64),
            np.concatenate(lost_out).astype(np.int64),
            np.concatenate(moving_out).astype(np.int64),
        )

    def total_bytes(self) -> int:
        """Sum of block sizes."""
        return int(self._size[: self._high][self._live_mask()].sum(dtype=np.int64))

    def bytes_by_class(self, num_classes: int) -> np.ndarray:
        """int64 array: total block bytes per class id in [0, num_classes)."""
        return self._per_class(num_classes, self._size[: self._high].astype(np.int64))

    def count_by_class(self, num_classes: int) -> np.ndarray:
        """int64 array: number of blocks per class id in [0, num_classes)."""
        return self._per_class(num_classes, np.ones(self._high, dtype=np.int64))

    def _per_class(self, num_classes: int, values: np.ndarray) -> np.ndarray:
        if not 0 < num_classes <= MAX_CLASS + 1:
            raise InvalidArgument("num_classes", f"must be in [1, {MAX_CLASS + 1}]")
        classes = self._class[: self._high]
        result = np.zeros(num_classes, dtype=np.int64)
        for class_id in range(num_classes):
            result[class_id] = values[classes == class_id].sum(dtype=np.int64)
        return result
