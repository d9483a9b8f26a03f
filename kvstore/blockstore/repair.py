"""Repair: declare nodes dead, then re-create the shards a stripe is missing, or move the ones on
a draining node, onto healthy nodes.

``HealthTracker`` is a pure state machine stepped with observations and a clock: a node is dead
when the cluster says so, or when its health checks have failed for ``dead_after_s`` without a
success in between; one success brings it back.

``Repairer.round`` does one round: ask every meta shard for its most urgent stripes
(``repairqueue``: most shards lost first, then by class; a few hundred stripes, a bounded
number of bytes), read k shards of each over the data plane (one call per source node, data
shards first), decode and check the block against its payload hash (the remaining shards are
read only for stripes that did not decode), re-encode, write each missing or moving shard to
the best writable node outside the stripe (rendezvous order, so never a second shard of a
stripe in one failure domain) with the same pending -> commit protocol as a put, then move the
placement in the meta shard with a compare-and-set. A moved shard is deleted from its draining
node only after that, so a stripe never has fewer shards than it had. Stripes that cannot be
decoded (more than m shards lost) are counted and offered again later by their queue.
``RepairLoop`` (``repairloop.py``) schedules rounds, paces them to the byte cap and tracks drains.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

from kvstore.blockstore.calls import MetaShardCalls, StorageNodeCalls, meta_target, node_target
from kvstore.blockstore.config import BlockStoreConfig
from kvstore.blockstore.fanout import Fanout, Ticket, gather
from kvstore.blockstore.placement import FailureDomains, meta_shard_of, replacements
from kvstore.blockstore.records import StripeRecord, split_shards
from kvstore.clock import Clock, SystemClock
from kvstore.ec import Codec
from kvstore.ec.shard import check_shard
from kvstore.errors import (
    CorruptShard,
    NodeDead,
    NodeUnavailable,
    ShardSizeMismatch,
    StoreError,
    TooFewShards,
)

log = logging.getLogger(__name__)

R = TypeVar("R")

#: Largest batch of shard bytes one data call carries: well under a fastcall frame, and small
#: enough that a node serving repair holds its lock only briefly between foreground calls.
CALL_BYTES = 4 << 20
#: Summary fields of a meta shard's repair queue that add up across shards.
_SUMMED = ("stripes_left", "bytes_left", "lost_2", "lost_1", "moving")


class HealthTracker:
    """Thread-safe: health checks may run in a thread of their own (a check waiting on an
    unreachable node must not hold up the repair of what it held)."""

    def __init__(self, dead_after_s: float, clock: Clock | None = None) -> None:
        self._dead_after = dead_after_s
        self._clock = clock or SystemClock()
        self._failing_since: dict[int, float] = {}
        self._dead: set[int] = set()
        self._lock = threading.Lock()

    def observe(self, node: int, ok: bool, definitely_dead: bool = False) -> None:
        now = self._clock.now()
        with self._lock:
            if ok:
                self._failing_since.pop(node, None)
                self._dead.discard(node)
                return
            since = self._failing_since.setdefault(node, now)
            if definitely_dead or now - since >= self._dead_after:
                self._dead.add(node)

    def declare_dead(self, node: int) -> None:
        with self._lock:
            self._failing_since.setdefault(node, self._clock.now())
            self._dead.add(node)

    @property
    def dead(self) -> set[int]:
        with self._lock:
            return set(self._dead)

    def failing(self) -> dict[int, float]:
        with self._lock:
            return dict(self._failing_since)


class Repairer:
    """The steps of repair against a fanout (see the module doc); ``RepairLoop`` drives it."""

    def __init__(
        self,
        config: BlockStoreConfig,
        fanout: Fanout,
        node_ids: Sequence[int] | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.config = config
        self._fanout = fanout
        self._clock = clock or SystemClock()
        self._codec = Codec(config.data_shards, config.parity_shards)
        self._k = config.data_shards
        self._width = config.stripe_width
        self._domains = FailureDomains.of_config(config.failure_domains, config.stripe_width)
        self._rank = config.repair_rank()
        self._nodes = list(node_ids if node_ids is not None else range(config.storage_nodes))
        self.counters: dict[str, float] = defaultdict(float)
        for name in ("stripes", "shards", "bytes", "read_bytes", "unrecoverable", "seconds"):
            self.counters[name] = 0.0
        for name in ("scrub_shards", "scrub_bytes", "corrupt_shards", "moved_shards"):
            self.counters[name] = 0.0
        #: The meta shards' queue figures from the latest round (summed; per draining node).
        self.queue: dict[str, Any] = {}
        #: Seconds spent per phase of the rounds that had work (where a slow repair waits).
        self.phase_s: dict[str, float] = defaultdict(float)

    @property
    def nodes(self) -> list[int]:
        return list(self._nodes)

    def set_nodes(self, node_ids: Iterable[int]) -> None:
        self._nodes = sorted({int(node) for node in node_ids})

    def _gather(self, tickets: Iterable[Ticket[R]]) -> dict[Ticket[R], R | NodeUnavailable]:
        return gather(self._fanout, tickets, self.config.call_timeout_s)

    # --- health ----------------------------------------------------------------------------

    def probe(self, health: HealthTracker) -> set[int]:
        """One round of health checks of every node; returns the nodes that say they drain."""
        tickets = {
            self._fanout.submit(node_target(node), StorageNodeCalls.status): node
            for node in self._nodes
        }
        draining: set[int] = set()
        for ticket, outcome in self._gather(tickets).items():
            node = tickets[ticket]
            if isinstance(outcome, NodeUnavailable):
                health.observe(node, False, definitely_dead=isinstance(outcome, NodeDead))
                continue
            health.observe(node, True)
            if outcome.get("draining"):
                draining.add(node)
        return draining

    def publish_down(self, dead: set[int]) -> None:
        """Tell every meta shard which nodes are dead (their shards stop counting as
        readable) and which are not."""
        up = [node for node in self._nodes if node not in dead]
        tickets = {
            self._fanout.submit(
                meta_target(shard), MetaShardCalls.mark_nodes, sorted(dead), up
            ): shard
            for shard in range(self.config.meta_shards)
        }
        self._gather(tickets)

    def set_draining(self, node: int, flag: bool) -> bool:
        """Set a node's drain flag (kept on the node); raises ``NodeUnavailable`` when the node
        does not answer."""
        ticket = self._fanout.submit(node_target(node), StorageNodeCalls.set_draining, flag)
        outcome = self._gather([ticket])[ticket]
        if isinstance(outcome, NodeUnavailable):
            raise outcome
        return bool(outcome)

    # --- scrub -----------------------------------------------------------------------------

    def scrub(self, dead: set[int], budget_bytes: int, limit: int = 1 << 20) -> int:
        """Have every live node verify about ``budget_bytes`` of its shards (round robin); a
        corrupt shard (dropped from its node's index) is recorded lost in its meta shard, so
        the repair re-creates it. Returns the number of corrupt shards found."""
        live = [node for node in self._nodes if node not in dead]
        tickets = {
            self._fanout.submit(
                node_target(node), StorageNodeCalls.scrub, limit, max(1, budget_bytes)
            ): node
            for node in live
        }
        moves: dict[int, list[tuple[bytes, int, int, int]]] = defaultdict(list)
        for ticket, outcome in self._gather(tickets).items():
            if isinstance(outcome, NodeUnavailable):
                continue
            node = tickets[ticket]
            self.counters["scrub_shards"] += float(outcome.get("checked", 0))  # type: ignore[arg-type]
            self.counters["scrub_bytes"] += float(outcome.get("bytes", 0))  # type: ignore[arg-type]
            corrupt = outcome.get("corrupt")
            if not isinstance(corrupt, list) or not corrupt:
                continue
            owners = meta_shard_of([key for key, _ in corrupt], self.config.meta_shards)
            for (key, index), owner in zip(corrupt, owners, strict=True):
                moves[int(owner)].append((bytes(key), int(index), -1, node))
        found = sum(len(batch) for batch in moves.values())
        self._gather(
            {
                self._fanout.submit(meta_target(shard), MetaShardCalls.set_placements, batch): shard
                for shard, batch in moves.items()
            }
        )
        self.counters["corrupt_shards"] += found
        return found

    # --- one round -------------------------------------------------------------------------

    def round(self, dead: set[int], draining: set[int], refresh: bool = False) -> dict[str, float]:
        """Repair the most urgent stripes of every meta shard (one bounded batch); returns this
        round's counts (``self.queue`` holds the queues' figures from before it)."""
        started = time.monotonic()
        draining = draining - dead
        shards = self.config.meta_shards
        limit = max(1, -(-self.config.repair_stripes_per_round // shards))
        budget = max(1, self.config.repair_round_bytes // shards)
        tickets = {
            self._fanout.submit(
                meta_target(shard),
                MetaShardCalls.repair_queue,
                sorted(dead),
                sorted(draining),
                limit,
                budget,
                self._rank,
                refresh,
            ): shard
            for shard in range(shards)
        }
        stripes: list[tuple[int, StripeRecord]] = []
        summaries: list[dict[str, Any]] = []
        for ticket, outcome in self._gather(tickets).items():
            if isinstance(outcome, NodeUnavailable):
                continue
            found, summary = outcome
            summaries.append(summary)
            stripes.extend((tickets[ticket], stripe) for stripe in found)
        self.queue = _merge(summaries, len(summaries) == shards)
        result = {"stripes": 0.0, "shards": 0.0, "bytes": 0.0, "unrecoverable": 0.0}
        if not stripes:
            return result
        clock = _PhaseClock(self.phase_s, started)
        clock.lap("queue")
        plan = self._plan(stripes, dead, draining)
        clock.lap("plan")
        built = self._shards_for(stripes, plan, dead, draining)
        clock.lap("read_rebuild")
        writes: dict[int, list[tuple[int, int, np.ndarray]]] = defaultdict(list)
        for position, made in enumerate(built):
            if made is None:
                result["unrecoverable"] += 1
                continue
            for index, target in plan[position]:
                writes[target].append((position, index, made[index]))
        moves = self._write_shards(stripes, writes)
        clock.lap("write")
        landed = self._move(moves, draining)
        clock.lap("move")
        result["shards"] = float(sum(len(done) for done in landed.values()))
        result["stripes"] = float(len({key for done in landed.values() for key, _ in done}))
        result["bytes"] = float(
            sum(shard.size for items in writes.values() for _, _, shard in items)
        )
        result["seconds"] = time.monotonic() - started
        for name, value in result.items():
            self.counters[name] += value
        return result

    def _plan(
        self, stripes: list[tuple[int, StripeRecord]], dead: set[int], draining: set[int]
    ) -> list[list[tuple[int, int]]]:
        """Per stripe, (shard index, target node) for every shard it misses or must move (a
        shard with no writable node outside its stripe waits for one)."""
        writable = [node for node in self._nodes if node not in dead and node not in draining]
        placements = np.stack([stripe.placement for _, stripe in stripes]).astype(np.int64)
        away = np.fromiter(dead | draining, dtype=np.int64, count=len(dead | draining))
        wanted = (placements < 0) | np.isin(placements, away)
        targets = replacements(
            [stripe.key for _, stripe in stripes], writable, placements, wanted, self._domains
        )
        rows, indices = np.nonzero(targets >= 0)
        plan: list[list[tuple[int, int]]] = [[] for _ in stripes]
        for row, index, target in zip(
            rows.tolist(), indices.tolist(), targets[rows, indices].tolist(), strict=True
        ):
            plan[row].append((index, target))
        return plan

    def _shards_for(
        self,
        stripes: list[tuple[int, StripeRecord]],
        plan: list[list[tuple[int, int]]],
        dead: set[int],
        draining: set[int],
    ) -> list[dict[int, np.ndarray] | None]:
        """The shards each stripe's plan writes (index -> shard), or None when they cannot be
        made. A shard moving off a draining node is copied as it is when it passes its own
        checks (one shard read, not k); every other one is rebuilt (``Codec.reconstruct``)
        from k shards that pass theirs, the data shards first; the remaining shards are read
        only for the stripes that did not rebuild."""
        records = [stripe for _, stripe in stripes]
        fetched: list[list[np.ndarray | None]] = [[None] * self._width for _ in records]
        made: list[dict[int, np.ndarray] | None] = [{} for _ in records]
        moving = [
            [i for i, _ in plan[p] if int(records[p].placement[i]) in draining]
            for p in range(len(records))
        ]
        copies = [chosen if len(chosen) == len(plan[p]) else [] for p, chosen in enumerate(moving)]
        self._fetch(records, copies, fetched)
        first: list[list[int]] = []
        rest: list[list[int]] = []
        for position, stripe in enumerate(records):
            done = made[position]
            assert done is not None
            for index in copies[position]:
                shard = fetched[position][index]
                if shard is not None and self._intact(stripe, index, shard):
                    done[index] = shard
            wanted = {i for i, _ in plan[position]} - set(done)
            usable = [
                index
                for index, node in enumerate(stripe.placement.tolist())
                if node >= 0 and node not in dead and fetched[position][index] is None
            ]
            sources = [i for i in usable if i not in wanted] if wanted else []
            first.append(sources[: self._k] if wanted else [])
            rest.append([i for i in usable if i not in first[-1]] if wanted else [])
        self._fetch(records, first, fetched)
        retry = [False] * len(records)
        for position, stripe in enumerate(records):
            retry[position] = not self._rebuild(
                stripe, plan[position], fetched[position], made, position
            )
        if any(retry):
            self._fetch(
                records, [r if again else [] for r, again in zip(rest, retry, strict=True)], fetched
            )
            for position, stripe in enumerate(records):
                if retry[position] and not self._rebuild(
                    stripe, plan[position], fetched[position], made, position
                ):
                    made[position] = None
        return made

    def _intact(self, stripe: StripeRecord, index: int, shard: np.ndarray) -> bool:
        try:
            check_shard(
                shard,
                key=stripe.key,
                index=index,
                k=self._k,
                m=self._width - self._k,
                payload_len=stripe.size,
            )
        except (CorruptShard, ShardSizeMismatch):
            return False
        return True

    def _rebuild(
        self,
        stripe: StripeRecord,
        plan: list[tuple[int, int]],
        shards: list[np.ndarray | None],
        made: list[dict[int, np.ndarray] | None],
        position: int,
    ) -> bool:
        """Fill ``made[position]`` with the planned shards still missing, rebuilt from
        ``shards``; False when they cannot be (yet)."""
        done = made[position]
        assert done is not None
        wanted = [index for index, _ in plan if index not in done]
        if not wanted:
            return True
        try:
            done.update(self._codec.reconstruct(shards, wanted, key=stripe.key))
        except (TooFewShards, CorruptShard, ShardSizeMismatch):
            return False
        return True

    def _fetch(
        self,
        stripes: list[StripeRecord],
        indices: list[list[int]],
        into: list[list[np.ndarray | None]],
    ) -> None:
        """Read shard ``indices[p]`` of each stripe ``p`` into ``into[p]``: one call per source
        node and ``CALL_BYTES`` of shards."""
        per_node: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for position, chosen in enumerate(indices):
            for index in chosen:
                per_node[int(stripes[position].placement[index])].append((position, index))
        tickets = {}
        for node, items in per_node.items():
            for batch in _batches(items, [stripes[p].size // self._k + 1 for p, _ in items]):
                ticket = self._fanout.submit(
                    node_target(node), StorageNodeCalls.get, [stripes[p].key for p, _ in batch]
                )
                tickets[ticket] = batch
        for ticket, outcome in self._gather(tickets).items():
            if isinstance(outcome, NodeUnavailable):
                continue
            try:
                got = split_shards(outcome)
            except (StoreError, TypeError, ValueError):
                continue
            if len(got) != len(tickets[ticket]):
                continue
            for (position, index), shard in zip(tickets[ticket], got, strict=True):
                into[position][index] = shard
                if shard is not None:
                    self.counters["read_bytes"] += shard.size

    def _write_shards(
        self,
        stripes: list[tuple[int, StripeRecord]],
        writes: dict[int, list[tuple[int, int, np.ndarray]]],
    ) -> list[tuple[int, tuple[bytes, int, int, int]]]:
        """Write new shards, each committed as it is written (as a client's put: ``client.py``);
        returns (meta shard, placement move) per shard landed. A shard whose move does not take
        is an orphan the node's scrub reclaims."""
        token = secrets.randbits(64)
        put_tickets = {}
        for node, items in writes.items():
            for batch in _batches(items, [shard.size for _, _, shard in items]):
                ticket = self._fanout.submit(
                    node_target(node),
                    StorageNodeCalls.put,
                    token,
                    [stripes[p][1].key for p, _, _ in batch],
                    [shard for _, _, shard in batch],
                    [stripes[p][1].class_id for p, _, _ in batch],
                    [stripes[p][1].created for p, _, _ in batch],
                    True,  # committed as written, as a client's put
                )
                put_tickets[ticket] = (node, batch)
        moves: list[tuple[int, tuple[bytes, int, int, int]]] = []
        for ticket, outcome in self._gather(put_tickets).items():
            node, batch = put_tickets[ticket]
            if isinstance(outcome, NodeUnavailable):
                self.counters["write_failures"] += 1
                continue
            for (position, index, _), ok in zip(batch, outcome, strict=True):
                if ok:
                    shard, stripe = stripes[position]
                    old = int(stripe.placement[index])
                    moves.append((shard, (bytes(stripe.key), index, node, old)))
        return moves

    def _move(
        self, moves: list[tuple[int, tuple[bytes, int, int, int]]], draining: set[int]
    ) -> dict[int, list[tuple[bytes, int]]]:
        """Move the placements (compare-and-set), then delete moved shards from their draining
        nodes; returns, per meta shard, the (key, index) moves that took."""
        by_shard: dict[int, list[tuple[bytes, int, int, int]]] = defaultdict(list)
        for shard, move in moves:
            by_shard[shard].append(move)
        tickets = {
            self._fanout.submit(meta_target(shard), MetaShardCalls.set_placements, batch): shard
            for shard, batch in by_shard.items()
        }
        landed: dict[int, list[tuple[bytes, int]]] = defaultdict(list)
        moved_off: dict[int, list[bytes]] = defaultdict(list)
        for ticket, acks in self._gather(tickets).items():
            if isinstance(acks, NodeUnavailable):
                continue
            shard = tickets[ticket]
            for (key, index, _node, old), ok in zip(by_shard[shard], acks, strict=True):
                if ok:
                    landed[shard].append((key, index))
                    if old in draining:
                        moved_off[old].append(key)
        now = self._clock.now()
        self._gather(
            {
                self._fanout.submit(node_target(node), StorageNodeCalls.delete, keys, now): node
                for node, keys in moved_off.items()
            }
        )
        self.counters["moved_shards"] += sum(len(keys) for keys in moved_off.values())
        return landed


class _PhaseClock:
    """Adds the time since the previous lap to ``totals[phase]``."""

    def __init__(self, totals: dict[str, float], started: float) -> None:
        self._totals = totals
        self._last = started

    def lap(self, phase: str) -> None:
        now = time.monotonic()
        self._totals[phase] += now - self._last
        self._last = now


def _batches(items: list[R], sizes: list[int]) -> list[list[R]]:
    """``items`` cut into runs of at most ``CALL_BYTES`` (by ``sizes``; one item at least)."""
    batches: list[list[R]] = []
    current: list[R] = []
    total = 0
    for item, size in zip(items, sizes, strict=True):
        if current and total + size > CALL_BYTES:
            batches.append(current)
            current, total = [], 0
        current.append(item)
        total += size
    if current:
        batches.append(current)
    return batches


def _merge(summaries: list[dict[str, Any]], complete: bool) -> dict[str, Any]:
    """The meta shards' queue figures added up (``complete``: every shard answered)."""
    merged: dict[str, Any] = dict.fromkeys(_SUMMED, 0)
    draining: dict[str, int] = defaultdict(int)
    draining_bytes: dict[str, int] = defaultdict(int)
    rebuilding = 0
    for summary in summaries:
        rebuilding += int(summary.get("rebuilding", 0))
        for name in _SUMMED:
            merged[name] += int(summary.get(name, 0))
        for node, left in summary.get("draining", {}).items():
            draining[str(node)] += int(left)
        for node, left in summary.get("draining_bytes", {}).items():
            draining_bytes[str(node)] += int(left)
    merged["draining"] = dict(draining)
    merged["draining_bytes"] = dict(draining_bytes)
    merged["complete"] = complete and not rebuilding
    return merged
