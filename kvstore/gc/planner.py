"""What a GC pass removes, decided without touching anything: pure, vectorised functions.

Two uses:
- the GC worker merges the LRU candidates every meta shard proposes into ONE global order
  (``merge_lru``): each shard only knows its own blocks, and evicting each shard's oldest share
  would evict a recently used block on one shard while an older one survives on another;
- ``kvstore gc --dry-run`` plans a whole pass over an index snapshot (``plan_index``).

A plan is reported per traffic class, with bytes: what an operator asks before letting a GC
loose ("how much agent traffic goes if I lower the high watermark?").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore.blockstore.index import BlockIndex
from kvstore.errors import InvalidArgument
from kvstore.gc.config import GCConfig
from kvstore.keys import BlockKey


@dataclass(frozen=True)
class LRUCandidates:
    """One meta shard's oldest unleased blocks, oldest first (its share of a global LRU)."""

    shard: int
    keys: list[BlockKey]
    last_access: np.ndarray  # float64
    sizes: np.ndarray  # int64, block bytes
    classes: np.ndarray  # class ids

    def __post_init__(self) -> None:
        n = len(self.keys)
        for name in ("last_access", "sizes", "classes"):
            if len(getattr(self, name)) != n:
                raise InvalidArgument(name, f"has {len(getattr(self, name))} entries, keys {n}")


@dataclass(frozen=True)
class Eviction:
    """Blocks to evict from one shard, in global LRU order."""

    shard: int
    keys: list[BlockKey]
    sizes: np.ndarray
    classes: np.ndarray


def merge_lru(candidates: Sequence[LRUCandidates], bytes_needed: int) -> list[Eviction]:
    """The exact global LRU prefix over every shard's candidates: the fewest least recently used
    blocks whose sizes sum to at least ``bytes_needed`` (all of them if they do not reach it).

    Correct as long as each shard proposed its own minimal prefix for the same ``bytes_needed``:
    the global prefix takes from each shard a prefix of that shard's order, and no shard's
    prefix needs more than ``bytes_needed`` bytes. Ties in last access go to the lower shard,
    then the earlier position.
    """
    if bytes_needed < 0:
        raise InvalidArgument("bytes_needed", f"must be >= 0, got {bytes_needed}")
    nonempty = [c for c in candidates if len(c.keys)]
    if bytes_needed == 0 or not nonempty:
        return []
    last = np.concatenate([c.last_access for c in nonempty]).astype(np.float64)
    sizes = np.concatenate([c.sizes for c in nonempty]).astype(np.int64)
    shard = np.concatenate([np.full(len(c.keys), c.shard, dtype=np.int64) for c in nonempty])
    position = np.concatenate([np.arange(len(c.keys), dtype=np.int64) for c in nonempty])
    order = np.lexsort((position, shard, last))
    cumulative = np.cumsum(sizes[order])
    cut = min(order.size, int(np.searchsorted(cumulative, bytes_needed, side="left")) + 1)
    chosen = order[:cut]
    offsets = np.cumsum([0] + [len(c.keys) for c in nonempty])
    evictions = []
    for index, source in enumerate(nonempty):
        mine = chosen[(chosen >= offsets[index]) & (chosen < offsets[index + 1])]
        if mine.size == 0:
            continue
        local = mine - offsets[index]  # already in global (= this shard's) LRU order
        evictions.append(
            Eviction(
                shard=source.shard,
                keys=[source.keys[i] for i in local.tolist()],
                sizes=np.asarray(source.sizes)[local].astype(np.int64),
                classes=np.asarray(source.classes)[local],
            )
        )
    return evictions


@dataclass
class ClassTally:
    """Blocks and bytes per traffic class for one action (expire or evict)."""

    class_names: tuple[str, ...]
    blocks: np.ndarray = field(init=False)
    bytes: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.blocks = np.zeros(len(self.class_names), dtype=np.int64)
        self.bytes = np.zeros(len(self.class_names), dtype=np.int64)

    def add(self, classes: np.ndarray, sizes: np.ndarray) -> None:
        classes = np.asarray(classes, dtype=np.int64)
        sizes = np.asarray(sizes, dtype=np.int64)
        if classes.size and (classes.min() < 0 or classes.max() >= len(self.class_names)):
            raise InvalidArgument("classes", f"class id outside {list(self.class_names)}")
        self.blocks += np.bincount(classes, minlength=len(self.class_names))
        for class_id in np.unique(classes).tolist():
            self.bytes[class_id] += int(sizes[classes == class_id].sum())

    @property
    def total_blocks(self) -> int:
        return int(self.blocks.sum())

    @property
    def total_bytes(self) -> int:
        return int(self.bytes.sum())

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {
            name: {"blocks": int(self.blocks[i]), "bytes": int(self.bytes[i])}
            for i, name in enumerate(self.class_names)
        }


@dataclass
class GCPlan:
    """What one GC pass expires and evicts, by class."""

    class_names: tuple[str, ...]
    now: float
    used_bytes: int
    capacity_bytes: int
    bytes_to_free: int
    expired: ClassTally = field(init=False)
    evicted: ClassTally = field(init=False)

    def __post_init__(self) -> None:
        self.expired = ClassTally(self.class_names)
        self.evicted = ClassTally(self.class_names)

    @property
    def used_after(self) -> int:
        return self.used_bytes - self.expired.total_bytes - self.evicted.total_bytes

    def as_dict(self) -> dict[str, object]:
        return {
            "now": self.now,
            "used_bytes": self.used_bytes,
            "capacity_bytes": self.capacity_bytes,
            "bytes_to_free": self.bytes_to_free,
            "used_bytes_after": self.used_after,
            "expired": self.expired.as_dict(),
            "evicted": self.evicted.as_dict(),
        }

    def format_table(self) -> str:
        rows = [("class", "expired blocks", "expired bytes", "evicted blocks", "evicted bytes")]
        for i, name in enumerate(self.class_names):
            rows.append(
                (
                    name,
                    str(int(self.expired.blocks[i])),
                    str(int(self.expired.bytes[i])),
                    str(int(self.evicted.blocks[i])),
                    str(int(self.evicted.bytes[i])),
                )
            )
        rows.append(
            (
                "total",
                str(self.expired.total_blocks),
                str(self.expired.total_bytes),
                str(self.evicted.total_blocks),
                str(self.evicted.total_bytes),
            )
        )
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        lines = [
            "  ".join(
                cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i])
                for i, cell in enumerate(row)
            )
            for row in rows
        ]
        usage = (
            f"used {self.used_bytes} of {self.capacity_bytes} bytes"
            if self.capacity_bytes
            else f"used {self.used_bytes} bytes (no capacity given: no eviction planned)"
        )
        return "\n".join([usage, *lines, f"used after: {self.used_after} bytes"])


def plan_index(
    index: BlockIndex,
    now: float,
    config: GCConfig,
    class_names: Sequence[str],
    capacity_bytes: int = 0,
    used_bytes: int | None = None,
) -> GCPlan:
    """Plan one pass over ``index`` exactly as a worker runs it: expire first, then evict by
    LRU (among the blocks that survive expiry) if usage after expiry is above the high watermark.

    Usage defaults to the sum of block sizes; ``capacity_bytes=0`` plans no eviction.
    """
    if capacity_bytes < 0:
        raise InvalidArgument("capacity_bytes", f"must be >= 0, got {capacity_bytes}")
    names = tuple(class_names)
    used = index.total_bytes() if used_bytes is None else int(used_bytes)
    expired = index.expired_rows(now, config.ttl_seconds_by_class(names), config.ttl_basis)
    expired_records = index.get(expired)
    after_expiry = used - int(expired_records.sizes.sum())
    to_free = config.bytes_to_free(after_expiry, capacity_bytes)
    plan = GCPlan(names, now, used, capacity_bytes, to_free)
    plan.expired.add(expired_records.classes, expired_records.sizes)
    if to_free:
        evicted = index.get(index.lru_rows(now, to_free, exclude_rows=expired))
        plan.evicted.add(evicted.classes, evicted.sizes)
    return plan
