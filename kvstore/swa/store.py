"""One machine's SWA state pool: fixed-size blobs in host memory, bounded, LRU + TTL.

A state is the stored region of one sequence's state block (docs/rules.md §4), snapshotted at an
aligned position p (docs/rules.md §6: p > 0, p % 128 == 0) and keyed by the block key of the block
that ends at p. Its exact size belongs to the layout it was made under
(``kvstore.tier.records.Layout``): the callers check it, the pool only takes any state of at most
``max_state_bytes`` (by default the tier's own state size). Anything else is rejected before it
touches the pool, with an error naming both the size and the position and what was expected.

Eviction: by LRU when a put would exceed the byte bound, and by TTL measured from the last access
(a put or a hit), so a state an agent loop keeps reusing stays while an abandoned one goes.
Every state has an owner (the tenant that put it, "" for the tier's own callers) and the LRU
runs within owners: a full pool takes room from the owner holding most beyond its fair share
(capacity over the owners it holds states of), and an owner already beyond its own share makes
room from its own states first — so one tenant's flood evicts its own states, never another's
within their share. Free room is anyone's (a lone owner may fill the pool, as before owners).
Every removal is queued for ``drain_removed`` so the owner can unregister it from the directory.
Time comes from an injected ``Clock``: tests move it by hand.

Where the bytes are kept is injected too (``keep``): by default an owned, read-only copy in this
process's heap; the Ray shell keeps them in its machine's object store instead, so a reader on
the same machine maps them without a copy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.clock import Clock
from kvstore.errors import ConfigError, StateRejected
from kvstore.keys import BLOCK_TOKENS, BlockKey, check_key


def check_state(
    position: object,
    blob: object,
    *,
    state_bytes: int,
    block_tokens: int = BLOCK_TOKENS,
    at_most: bool = False,
) -> np.ndarray:
    """Validate a state put: exactly ``state_bytes`` (``at_most``: 1 to ``state_bytes``) at a
    store position; returns the blob as a flat uint8 array (no copy when possible).

    The message always names both the size and the position, with the expected values, so the
    producer sees at once which side of its geometry is off.
    """
    if isinstance(blob, np.ndarray):
        array = blob
    elif isinstance(blob, bytes | bytearray | memoryview):
        array = np.frombuffer(blob, dtype=np.uint8)
    else:
        raise StateRejected(
            "blob", f"must be a uint8 numpy array or bytes, got {type(blob).__name__}"
        )
    if array.dtype != np.uint8 or array.ndim != 1:
        raise StateRejected(
            "blob", f"must be a one-dimensional uint8 array, got {array.dtype} {array.shape}"
        )
    position_ok = (
        isinstance(position, int | np.integer)
        and not isinstance(position, bool)
        and int(position) > 0
        and int(position) % block_tokens == 0
    )
    size_ok = 0 < array.size <= state_bytes if at_most else array.size == state_bytes
    if not (position_ok and size_ok):
        wrong = [name for name, ok in (("blob", size_ok), ("position", position_ok)) if not ok]
        size = f"at most {state_bytes} B" if at_most else f"exactly {state_bytes} B"
        raise StateRejected(
            ", ".join(wrong),
            f"state of {array.size} B at position {position!r} rejected: a state is {size} "
            f"(its layout's state size) and is stored only at a position p > 0 with "
            f"p % {block_tokens} == 0 (docs/rules.md §6)",
        )
    return array


#: The largest state a pool takes when its tier's own state is smaller: another model's layout
#: may keep a longer window or more sliding layers (a pool never takes more than its capacity).
MAX_STATE_BYTES = 64 * 1024 * 1024


def pool_max_state_bytes(state_bytes: int, capacity_bytes: int) -> int:
    """The largest state a pool of ``capacity_bytes`` on a tier whose own states are
    ``state_bytes`` takes."""
    return min(capacity_bytes, max(state_bytes, MAX_STATE_BYTES))


def owned_copy(array: np.ndarray) -> np.ndarray:
    """The default way to keep a state: a read-only copy the pool owns (a view into a caller's
    buffer must not pin foreign memory or change under us)."""
    owned = np.array(array, dtype=np.uint8, copy=True)
    owned.flags.writeable = False
    return owned


@dataclass
class _Entry:
    position: int
    payload: Any  # what ``keep`` made of the validated bytes
    last_access: float
    nbytes: int
    owner: str = ""


@dataclass(frozen=True)
class StoreStats:
    states: int
    used_bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evicted_lru: int
    expired_ttl: int
    #: Bytes held per owner (a tenant's share counts toward its ``max_bytes`` quota).
    bytes_by_owner: dict[str, int] = field(default_factory=dict)


class SWAStore:
    """The pool of one machine. Not thread-safe: one owner (an actor shell) drives it."""

    def __init__(
        self,
        *,
        max_state_bytes: int,
        capacity_bytes: int,
        ttl_s: float,
        clock: Clock,
        block_tokens: int = BLOCK_TOKENS,
        keep: Callable[[np.ndarray], Any] = owned_copy,
    ) -> None:
        if (
            isinstance(max_state_bytes, bool)
            or not isinstance(max_state_bytes, int)
            or max_state_bytes <= 0
        ):
            raise ConfigError(
                "max_state_bytes", f"must be a positive integer, got {max_state_bytes!r}"
            )
        if capacity_bytes < max_state_bytes:
            raise ConfigError(
                "capacity_bytes",
                f"{capacity_bytes} B cannot hold one state of {max_state_bytes} B",
            )
        if ttl_s <= 0:
            raise ConfigError("ttl_s", f"must be positive, got {ttl_s}")
        self._max_state_bytes = max_state_bytes
        self._used = 0
        self._capacity = capacity_bytes
        self._ttl = float(ttl_s)
        self._clock = clock
        self._block_tokens = block_tokens
        self._keep = keep
        # Oldest access first: TTL expiries come off the front. Each owner's keys in the same
        # order, so its LRU victim is found without a scan; and the bytes it holds.
        self._entries: OrderedDict[BlockKey, _Entry] = OrderedDict()
        self._by_owner: dict[str, OrderedDict[BlockKey, None]] = {}
        self._owner_bytes: dict[str, int] = {}
        self._removed: list[BlockKey] = []
        self._hits = self._misses = self._evicted = self._expired = 0

    @property
    def max_state_bytes(self) -> int:
        return self._max_state_bytes

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[BlockKey]:
        """Keys held, least recently used first."""
        return list(self._entries)

    def put(self, key: BlockKey, position: int, blob: object, *, owner: str = "") -> list[BlockKey]:
        """Store (or refresh) the state ``key`` snapshotted at ``position`` for ``owner``.

        Returns the keys evicted by LRU to make room (also queued for ``drain_removed``).
        The validated bytes are handed to ``keep`` (by default: copied into an owned array).
        """
        key = check_key(key, "key")
        array = check_state(
            position,
            blob,
            state_bytes=self._max_state_bytes,
            block_tokens=self._block_tokens,
            at_most=True,
        )
        now = self._clock.now()
        self.expire()
        payload = self._keep(array)
        if key in self._entries:
            self._forget(key)
        size = int(array.size)
        evicted: list[BlockKey] = []
        while self._entries and self._used + size > self._capacity:
            victim = self._victim(owner, size)
            self._forget(victim)
            evicted.append(victim)
            self._evicted += 1
        self._entries[key] = _Entry(int(position), payload, now, size, owner)
        self._by_owner.setdefault(owner, OrderedDict())[key] = None
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + size
        self._used += size
        self._removed.extend(evicted)
        return evicted

    def _victim(self, owner: str, incoming: int) -> BlockKey:
        """The state to evict for ``incoming`` bytes of ``owner``: its own least recently used
        while it would hold more than its fair share, else that of the owner holding most
        beyond its share (one exists: the pool is full and the putter is within its share)."""
        holders = set(self._by_owner) | {owner}
        share = self._capacity / len(holders)
        mine = self._by_owner.get(owner)
        if mine and self._owner_bytes[owner] + incoming > share:
            return next(iter(mine))
        others = [name for name in self._by_owner if name != owner] or [owner]
        heaviest = max(others, key=lambda name: self._owner_bytes[name])
        return next(iter(self._by_owner[heaviest]))

    def _forget(self, key: BlockKey) -> _Entry:
        """Take ``key`` out of the pool and its owner's books (not queued as removed)."""
        entry = self._entries.pop(key)
        self._used -= entry.nbytes
        keys = self._by_owner[entry.owner]
        del keys[key]
        self._owner_bytes[entry.owner] -= entry.nbytes
        if not keys:  # an owner holding nothing has no share to count
            del self._by_owner[entry.owner], self._owner_bytes[entry.owner]
        return entry

    def get(self, key: BlockKey) -> Any | None:
        """The kept state (by default its read-only bytes) with a refreshed access time, or
        None on a miss."""
        entry = self._entries.get(key)
        now = self._clock.now()
        if entry is not None and now - entry.last_access > self._ttl:
            self._drop(key, expired=True)
            entry = None
        if entry is None:
            self._misses += 1
            return None
        entry.last_access = now
        self._entries.move_to_end(key)
        self._by_owner[entry.owner].move_to_end(key)
        self._hits += 1
        return entry.payload

    def position(self, key: BlockKey) -> int | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.position

    def expire(self) -> list[BlockKey]:
        """Drop every state idle for longer than the TTL; returns their keys."""
        now = self._clock.now()
        expired: list[BlockKey] = []
        # Access order equals last_access order, so expired entries form a prefix.
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if now - entry.last_access <= self._ttl:
                break
            self._drop(key, expired=True)
            expired.append(key)
        return expired

    def delete(self, key: BlockKey) -> bool:
        if key not in self._entries:
            return False
        self._drop(key, expired=False)
        return True

    def drain_removed(self) -> list[BlockKey]:
        """Keys removed (evicted, expired, deleted) since the last drain, oldest first."""
        removed, self._removed = self._removed, []
        return removed

    def stats(self) -> StoreStats:
        return StoreStats(
            states=len(self._entries),
            used_bytes=self.used_bytes,
            capacity_bytes=self._capacity,
            hits=self._hits,
            misses=self._misses,
            evicted_lru=self._evicted,
            expired_ttl=self._expired,
            bytes_by_owner=dict(self._owner_bytes),
        )

    def _drop(self, key: BlockKey, *, expired: bool) -> None:
        self._forget(key)
        self._removed.append(key)
        if expired:
            self._expired += 1
