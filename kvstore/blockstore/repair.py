"""Repair: declare nodes dead, then re-encode their stripes' shards onto healthy nodes.

``HealthTracker`` is a pure state machine stepped with observations and a clock: a node is dead
when the cluster says so, or when its health checks have failed for ``dead_after_s`` without a
success in between; one success brings it back.

``Repairer.step`` does one bounded batch (``repair_batch`` stripes): list stripes with a shard
on a dead node (or a shard recorded lost) from every meta shard, read k shards of each (one
call per source node), decode and check the block against its payload hash, re-encode, write
each lost shard to the best healthy node outside the stripe (rendezvous order, so never a
second shard of a stripe in one failure domain) with the same pending -> commit protocol as a
put, then move the placement in the meta shard with a compare-and-set. Stripes that cannot be
decoded (more than m shards lost) are counted and skipped.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import TypeVar

import numpy as np

from kvstore.blockstore.calls import MetaShardCalls, StorageNodeCalls, meta_target, node_target
from kvstore.blockstore.config import BlockStoreConfig
from kvstore.blockstore.fanout import Fanout, Ticket, gather
from kvstore.blockstore.node import split_shards
from kvstore.blockstore.placement import meta_shard_of, replacement
from kvstore.blockstore.records import StripeRecord
from kvstore.clock import Clock, SystemClock
from kvstore.ec import Codec
from kvstore.ec.shard import payload_hash, writes_by_payload
from kvstore.errors import NodeDead, NodeUnavailable, StoreError, TooFewShards

log = logging.getLogger(__name__)

R = TypeVar("R")


class HealthTracker:
    def __init__(self, dead_after_s: float, clock: Clock | None = None) -> None:
        self._dead_after = dead_after_s
        self._clock = clock or SystemClock()
        self._failing_since: dict[int, float] = {}
        self._dead: set[int] = set()

    def observe(self, node: int, ok: bool, definitely_dead: bool = False) -> None:
        now = self._clock.now()
        if ok:
            self._failing_since.pop(node, None)
            self._dead.discard(node)
            return
        since = self._failing_since.setdefault(node, now)
        if definitely_dead or now - since >= self._dead_after:
            self._dead.add(node)

    def declare_dead(self, node: int) -> None:
        self._failing_since.setdefault(node, self._clock.now())
        self._dead.add(node)

    @property
    def dead(self) -> set[int]:
        return set(self._dead)

    def failing(self) -> dict[int, float]:
        return dict(self._failing_since)


class Repairer:
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
        self._nodes = list(node_ids if node_ids is not None else range(config.storage_nodes))
        self._cursor = dict.fromkeys(range(config.meta_shards), 0)
        self.counters: dict[str, float] = defaultdict(float)
        for name in ("stripes", "shards", "bytes", "unrecoverable", "seconds"):
            self.counters[name] = 0.0

    def set_nodes(self, node_ids: Iterable[int]) -> None:
        self._nodes = sorted({int(node) for node in node_ids})

    def _gather(self, tickets: Iterable[Ticket[R]]) -> dict[Ticket[R], R | NodeUnavailable]:
        return gather(self._fanout, tickets, self.config.call_timeout_s)

    def probe(self, health: HealthTracker) -> None:
        """One round of health checks of every node."""
        tickets = {
            self._fanout.submit(node_target(node), StorageNodeCalls.ping): node
            for node in self._nodes
        }
        for ticket, outcome in self._gather(tickets).items():
            node = tickets[ticket]
            if isinstance(outcome, NodeUnavailable):
                health.observe(node, False, definitely_dead=isinstance(outcome, NodeDead))
            else:
                health.observe(node, True)

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

    def scrub(self, dead: set[int], limit: int) -> int:
        """Have every live node verify up to ``limit`` shards; a corrupt shard (dropped from its
        node's index) is recorded lost in its meta shard, so ``step`` re-creates it. Returns the
        number of corrupt shards found."""
        live = [node for node in self._nodes if node not in dead]
        tickets = {
            self._fanout.submit(node_target(node), StorageNodeCalls.scrub, limit): node
            for node in live
        }
        moves: dict[int, list[tuple[bytes, int, int, int]]] = defaultdict(list)
        for ticket, outcome in self._gather(tickets).items():
            if isinstance(outcome, NodeUnavailable):
                continue
            node = tickets[ticket]
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

    def step(self, dead: set[int]) -> dict[str, float]:
        """Repair up to ``repair_batch`` stripes; returns this step's counts."""
        started = time.monotonic()
        live = [node for node in self._nodes if node not in dead]
        per_shard = max(1, self.config.repair_batch // self.config.meta_shards)
        tickets = {
            self._fanout.submit(
                meta_target(shard),
                MetaShardCalls.stripes_to_repair,
                sorted(dead),
                per_shard,
                self._cursor[shard],
            ): shard
            for shard in range(self.config.meta_shards)
        }
        stripes: list[tuple[int, StripeRecord]] = []
        for ticket, outcome in self._gather(tickets).items():
            shard = tickets[ticket]
            if isinstance(outcome, NodeUnavailable):
                continue
            found, next_row = outcome
            self._cursor[shard] = next_row
            stripes.extend((shard, stripe) for stripe in found)
        result = {"stripes": 0.0, "shards": 0.0, "bytes": 0.0, "unrecoverable": 0.0}
        if not stripes:
            return result
        blocks = self._read_blocks([stripe for _, stripe in stripes], dead)
        writes: dict[int, list[tuple[int, int, np.ndarray]]] = defaultdict(list)
        for position, (_, stripe) in enumerate(stripes):
            data = blocks[position]
            if data is None:
                result["unrecoverable"] += 1
                continue
            encoded = self._codec.encode(data, stripe.key)
            taken = {int(n) for n in stripe.placement if n >= 0 and int(n) not in dead}
            for index, node in enumerate(stripe.placement):
                if node >= 0 and int(node) not in dead:
                    continue
                target = replacement(stripe.key, live, sorted(taken))
                if target is None:
                    continue
                taken.add(target)
                writes[target].append((position, index, encoded[index]))
        moves = self._write_shards(stripes, writes)
        by_shard: dict[int, list[tuple[bytes, int, int, int]]] = defaultdict(list)
        for shard, move in moves:
            by_shard[shard].append(move)
        moved_tickets = {
            self._fanout.submit(meta_target(shard), MetaShardCalls.set_placements, batch): batch
            for shard, batch in by_shard.items()
        }
        repaired_stripes: set[bytes] = set()
        for moved, acks in self._gather(moved_tickets).items():
            if isinstance(acks, NodeUnavailable):
                continue
            for (key, _index, _node, _old), ok in zip(moved_tickets[moved], acks, strict=True):
                if ok:
                    result["shards"] += 1
                    repaired_stripes.add(bytes(key))
        result["stripes"] = float(len(repaired_stripes))
        result["bytes"] = float(
            sum(shard.size for items in writes.values() for _, _, shard in items)
        )
        result["seconds"] = time.monotonic() - started
        for name, value in result.items():
            self.counters[name] += value
        return result

    def _read_blocks(self, stripes: list[StripeRecord], dead: set[int]) -> list[np.ndarray | None]:
        """Decode each stripe's block from its healthy shards (verified by payload hash)."""
        per_node: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for position, stripe in enumerate(stripes):
            for index, node in enumerate(stripe.placement):
                if node >= 0 and int(node) not in dead:
                    per_node[int(node)].append((position, index))
        shards: list[list[np.ndarray | None]] = [[None] * self.config.stripe_width for _ in stripes]
        tickets = {
            self._fanout.submit(
                node_target(node), StorageNodeCalls.get, [stripes[p].key for p, _ in items]
            ): items
            for node, items in per_node.items()
        }
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
                shards[position][index] = shard
        return [self._decode(stripe, shards[p]) for p, stripe in enumerate(stripes)]

    def _decode(self, stripe: StripeRecord, shards: list[np.ndarray | None]) -> np.ndarray | None:
        """The block of ``stripe`` from the shards of one write (grouped by payload hash, the
        largest group first), checked against that hash; None when no group decodes."""
        groups, _corrupt = writes_by_payload(shards)
        for digest, members in groups:
            chosen = set(members)
            group = [shard if i in chosen else None for i, shard in enumerate(shards)]
            try:
                data = self._codec.decode(group, size=stripe.size, key=stripe.key)
            except TooFewShards:
                continue
            if payload_hash(data) == digest:
                return np.frombuffer(data, dtype=np.uint8)
        return None

    def _write_shards(
        self,
        stripes: list[tuple[int, StripeRecord]],
        writes: dict[int, list[tuple[int, int, np.ndarray]]],
    ) -> list[tuple[int, tuple[bytes, int, int, int]]]:
        """Write and commit new shards; returns (meta shard, placement move) per shard landed."""
        token = secrets.randbits(64)
        put_tickets = {}
        for node, items in writes.items():
            ticket = self._fanout.submit(
                node_target(node),
                StorageNodeCalls.put,
                token,
                [stripes[p][1].key for p, _, _ in items],
                [shard for _, _, shard in items],
                [stripes[p][1].class_id for p, _, _ in items],
                [stripes[p][1].created for p, _, _ in items],
            )
            put_tickets[ticket] = (node, items)
        written: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for ticket, outcome in self._gather(put_tickets).items():
            node, items = put_tickets[ticket]
            if isinstance(outcome, NodeUnavailable):
                self.counters["write_failures"] += 1
                continue
            for (position, index, _), ok in zip(items, outcome, strict=True):
                if ok:
                    written[node].append((position, index))
        commit_tickets = {
            self._fanout.submit(
                node_target(node),
                StorageNodeCalls.commit,
                token,
                [stripes[p][1].key for p, _ in landed],
            ): (node, landed)
            for node, landed in written.items()
        }
        moves: list[tuple[int, tuple[bytes, int, int, int]]] = []
        for ticket, outcome in self._gather(commit_tickets).items():
            node, landed = commit_tickets[ticket]
            if isinstance(outcome, NodeUnavailable):
                continue
            for (position, index), ok in zip(landed, outcome, strict=True):
                if ok:
                    shard, stripe = stripes[position]
                    old = int(stripe.placement[index])
                    moves.append((shard, (bytes(stripe.key), index, node, old)))
        return moves

    def stats(self) -> dict[str, float]:
        stats = dict(self.counters)
        seconds = stats.get("seconds", 0.0)
        stats["throughput_bytes_per_s"] = stats.get("bytes", 0.0) / seconds if seconds else 0.0
        return stats


class RepairLoop:
    """One control loop: probe health, publish the dead set, repair a bounded batch.

    ``tick`` never raises: a failing step is logged and counted, the next tick tries again.
    """

    def __init__(
        self,
        repairer: Repairer,
        health: HealthTracker,
        scrub_every: int = 60,
        scrub_limit: int = 256,
    ) -> None:
        """``scrub_every``: ticks between scrub passes (0 = never); each pass verifies up to
        ``scrub_limit`` shards per node, round robin, so the whole disk is covered over time."""
        self.repairer = repairer
        self.health = health
        self._scrub_every = scrub_every
        self._scrub_limit = scrub_limit
        self._published: set[int] | None = None
        self.ticks = 0
        self.errors = 0
        self.last_step: dict[str, float] = {}

    def tick(self) -> dict[str, float]:
        self.ticks += 1
        try:
            self.repairer.probe(self.health)
            dead = self.health.dead
            if dead != self._published:
                self.repairer.publish_down(dead)
                self._published = dead
            if self._scrub_every and self.ticks % self._scrub_every == 0:
                self.repairer.scrub(dead, self._scrub_limit)
            self.last_step = self.repairer.step(dead)
        except Exception:  # a control loop survives a failing step
            self.errors += 1
            log.exception("repair tick failed")
            self.last_step = {}
        return self.last_step

    def stats(self) -> dict[str, object]:
        return {
            **self.repairer.stats(),
            "dead_nodes": sorted(self.health.dead),
            "failing_nodes": sorted(self.health.failing()),
            "ticks": self.ticks,
            "errors": self.errors,
            "last_step": dict(self.last_step),
        }
