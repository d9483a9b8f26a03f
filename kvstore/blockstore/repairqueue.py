"""A meta shard's repair queue: its stripes that miss a shard or must move one, most urgent first.

Order (the rule the repair follows, one meta shard at a time):

1. stripes that lost the most shards first: a stripe down to k shards is one failure from
   loss, one down to k + 1 is two away, and one that only has a shard on a draining node
   (planned maintenance: it still has all k + m) comes last;
2. among equals, by traffic class rank (``BlockStoreConfig.repair_rank``: by default the class
   with the longer TTL first, since a block kept longer is expected to serve more hits before
   it goes, so losing it costs more recomputation);
3. then the most recently used first (a hot block is the likeliest to be read again soon).

The queue is built by one vectorised scan of the index (``BlockIndex.shard_shortfall``) and
handed out in order, each batch re-checked against the index first (a stripe repaired or
removed since the scan is skipped). It is rebuilt when the dead or draining set changes, when it
is ``REFRESH_S`` old (so stripes that became urgent since move up), ``STALE_S`` after a shard
was recorded lost (a scrub finding, an under-redundant write), and when it runs out (at most
every ``REQUEUE_S``: a stripe that could not be repaired, like one with fewer than k shards
left, is offered again then, not in a tight loop). A full scan of a shard with no dead or
draining node and no shard recorded lost is skipped altogether.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.blockstore.index import BlockIndex

#: Oldest a queue gets before it is rebuilt (seconds).
REFRESH_S = 5.0
#: Soonest an exhausted queue is rebuilt (seconds): stripes left over are offered again then.
REQUEUE_S = 2.0
#: Soonest a queue is rebuilt after a shard was recorded lost (a scrub finding, an
#: under-redundant write): soon, but not a full scan per write.
STALE_S = 0.5


def shard_bytes(sizes: np.ndarray, data_shards: int) -> np.ndarray:
    """Approximate bytes of one shard of blocks of ``sizes`` (the codec's header left out)."""
    return -(-np.asarray(sizes, dtype=np.int64) // data_shards)


class RepairQueue:
    """See the module doc. Plain state of one meta shard (not thread-safe)."""

    def __init__(self, index: BlockIndex, data_shards: int) -> None:
        self._index = index
        self._k = data_shards
        self._state: tuple[Any, ...] | None = None
        self._built = -np.inf
        self._rows = np.zeros(0, np.int64)
        self._lost = np.zeros(0, np.int64)
        self._moving = np.zeros(0, np.int64)
        self._bytes = np.zeros(0, np.int64)  # shard bytes to write per row
        self._on_node: dict[int, np.ndarray] = {}
        self._next = 0
        self._lost_shards = False
        self._stale = False  # a shard was recorded lost since the last scan

    @property
    def lost_shards(self) -> bool:
        """Whether a shard may be recorded lost (-1): the owner sets it, a scan clears it."""
        return self._lost_shards

    @lost_shards.setter
    def lost_shards(self, value: bool) -> None:
        self._stale |= value
        self._lost_shards = value

    def _build(
        self, dead: Sequence[int], draining: Sequence[int], rank: Sequence[int], now: float
    ) -> None:
        self._built = now
        self._next = 0
        self._stale = False
        if not dead and not draining and not self.lost_shards:
            self._rows = self._lost = self._moving = self._bytes = np.zeros(0, np.int64)
            self._on_node = {}
            return
        rows, lost, moving = self._index.shard_shortfall(dead, draining)
        records = self._index.get(rows)
        self._lost_shards = bool((records.placements < 0).any())
        class_rank = np.asarray(rank, dtype=np.int64)
        classes = records.classes.astype(np.int64)
        if class_rank.size:
            known = classes < class_rank.size
            ranked = np.full(classes.shape, class_rank.size, dtype=np.int64)
            ranked[known] = class_rank[classes[known]]
        else:
            ranked = classes
        # np.lexsort sorts by the last key first.
        order = np.lexsort((-records.last_access, ranked, -lost))
        self._rows = rows[order]
        self._lost = lost[order]
        self._moving = moving[order]
        self._bytes = (self._lost + self._moving) * shard_bytes(records.sizes[order], self._k)
        placements = records.placements[order]
        self._on_node = {int(node): (placements == int(node)).any(axis=1) for node in draining}

    def take(
        self,
        dead: Sequence[int],
        draining: Sequence[int],
        limit: int,
        max_bytes: int,
        rank: Sequence[int],
        now: float,
        refresh: bool = False,
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Up to ``limit`` rows to repair next (at least one if any is due, and no more than
        ``max_bytes`` of shards to read, k per stripe), and the queue's figures before them."""
        state = (tuple(sorted(dead)), tuple(sorted(draining)), tuple(rank))
        age = now - self._built
        exhausted = self._next >= self._rows.size
        stale = self._stale and age >= STALE_S
        if refresh or stale or state != self._state or age >= REFRESH_S:
            rebuild = True
        else:
            rebuild = exhausted and age >= REQUEUE_S
        if rebuild:
            self._state = state
            self._build(dead, draining, rank, now)
        summary = self._summary()
        chosen: list[np.ndarray] = []
        taken = 0
        budget = max_bytes
        while self._next < self._rows.size and taken < limit:
            end = min(self._rows.size, self._next + (limit - taken))
            window = self._rows[self._next : end]
            # Read cost: k shards per stripe, each about the size of the one written.
            per_shard = self._bytes[self._next : end] // np.maximum(
                1, self._lost[self._next : end] + self._moving[self._next : end]
            )
            cost = np.cumsum(per_shard * self._k)
            fits = int(np.searchsorted(cost, budget, side="right"))
            if fits == 0 and not chosen:
                fits = 1  # one stripe larger than the budget still goes, alone
            if fits == 0:
                break
            window = window[:fits]
            still, _lost, _moving = self._index.shard_shortfall(dead, draining, rows=window)
            keep = np.isin(window, still)
            chosen.append(window[keep])
            taken += int(keep.sum())
            budget -= int(cost[fits - 1])
            self._next += fits
            if budget <= 0:
                break
        rows = np.concatenate(chosen) if chosen else np.zeros(0, np.int64)
        return rows, summary

    def _summary(self) -> dict[str, Any]:
        """Stripes and shard bytes still queued (those handed out but not yet repaired count
        until the next rebuild), by urgency, and per draining node."""
        start = self._next
        lost = self._lost[start:]
        return {
            "stripes_left": int(lost.size),
            "bytes_left": int(self._bytes[start:].sum()),
            "lost_2": int((lost >= 2).sum()),
            "lost_1": int((lost == 1).sum()),
            "moving": int(((lost == 0) & (self._moving[start:] > 0)).sum()),
            "draining": {
                str(node): int(mask[start:].sum()) for node, mask in self._on_node.items()
            },
            # shard bytes of the stripes with a shard there (their lost shards included)
            "draining_bytes": {
                str(node): int(self._bytes[start:][mask[start:]].sum())
                for node, mask in self._on_node.items()
            },
            "built_at": float(self._built),
        }
