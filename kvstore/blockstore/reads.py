"""The read path of the block client: ``get_blocks``.

Read rule: ask the k fastest nodes holding shards of each block (data shards first, so the
common case is a plain concatenation), one call per node per batch; shards still missing after
the hedge delay (``ClientCore._hedge_delay``: slow nodes) or at once (failed nodes) are asked
of the remaining nodes. Nodes thought down (a failed call lately, or declared dead) are skipped,
unless a block cannot be read without them: then they are asked as well. A block is decoded
from any k shards that agree on its payload hash and checked against it; a block that cannot be
is a miss, and the read says why (``BlockReadOutcome.why``). Node failures never escape as
exceptions. Every shard comes from its storage node's answer, so a node's death or slowness is
seen by every read.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.blockstore.calls import MetaShardCalls, StorageNodeCalls, node_target
from kvstore.blockstore.core import ClientCore
from kvstore.blockstore.fanout import Ticket
from kvstore.blockstore.records import (
    BlockLocation,
    BlockReadOutcome,
    Lease,
    split_shards,
)
from kvstore.ec.shard import (
    HEADER_BYTES,
    PAYLOAD_HASH,
    fragment_length,
    payload_hash,
    writes_by_payload,
)
from kvstore.errors import (
    NodeUnavailable,
    StoreError,
    TooFewShards,
)
from kvstore.keys import BlockKey

#: One read in this many times each node's answer separately (the others wait for all at once).
_LATENCY_SAMPLE_EVERY = 8


@dataclass
class _Call:
    node: int
    items: list[tuple[int, int]]  # (block position, stripe index)
    started: float


class BlockReads(ClientCore):
    """``get_blocks`` and everything under it."""

    # --- get --------------------------------------------------------------------------------

    def get_blocks(
        self, keys: Sequence[bytes], lease: Lease | None = None
    ) -> list[np.ndarray | None]:
        """Payloads of ``keys`` as read-only uint8 arrays, bit-exact, or None (a miss).

        With ``lease`` (from ``lookup``) the shard locations it carries save a meta round trip.
        """
        return self.read(keys, lease).payloads

    def read(self, keys: Sequence[bytes], lease: Lease | None = None) -> BlockReadOutcome:
        """``get_blocks`` plus, for each block, whether it was degraded: served although a data
        shard's node was down, so parity stood in (a hedged read of a healthy stripe may decode
        from parity too; that is not degraded). Per call, so concurrent readers each learn about
        their own blocks."""
        checked = self._check_keys(keys)
        known = {key: row for row, key in enumerate(lease.block_keys)} if lease else {}
        locations: list[BlockLocation | None] = [None] * len(checked)
        if known:
            assert lease is not None
            for p, key in enumerate(checked):
                row = known.get(key)
                if row is not None:  # only the asked blocks become Python objects
                    placement = tuple(lease.placements[row].tolist())
                    locations[p] = BlockLocation(key, placement, int(lease.sizes[row]))
        why: dict[int, str] = {}
        unknown = [p for p, loc in enumerate(locations) if loc is None]
        if unknown:
            located = self._locate([checked[p] for p in unknown], lease, why)
            for p, loc in zip(unknown, located, strict=True):
                locations[p] = loc
            why = {unknown[j]: reason for j, reason in why.items()}
        out, degraded, unread = self._fetch(locations)
        why.update(unread)
        if known:  # a lease's placement may predate a repair: re-locate and retry misses
            stale = [p for p, payload in enumerate(out) if payload is None and checked[p] in known]
            if stale:
                again: dict[int, str] = {}
                fresh = self._locate([checked[p] for p in stale], lease, again)
                retry, retry_degraded, unread = self._fetch(fresh)
                again.update(unread)
                for j, (p, payload, was) in enumerate(
                    zip(stale, retry, retry_degraded, strict=True)
                ):
                    out[p], degraded[p] = payload, was
                    why.pop(p, None)
                    if j in again:
                        why[p] = again[j]
        self.counters["get_blocks"] += len(checked)
        self.counters["get_misses"] += sum(1 for payload in out if payload is None)
        self.counters["degraded_blocks"] += sum(degraded)
        return BlockReadOutcome(out, degraded, why)

    def _locate(
        self, keys: list[BlockKey], lease: Lease | None, why: dict[int, str]
    ) -> list[BlockLocation | None]:
        """Each key's location from its meta shard (None: a miss, its reason put in ``why``
        by position)."""
        out: list[BlockLocation | None] = [None] * len(keys)
        until = lease.until if lease is not None else None
        for _shard, (positions, reply) in self._meta_calls(
            keys, MetaShardCalls.locate, self.down_nodes(), None, until
        ).items():
            if isinstance(reply, NodeUnavailable):
                self.counters["meta_unavailable"] += 1
                why.update((p, f"its meta shard did not answer ({reply})") for p in positions)
                continue
            self._learn_down(reply.down)
            for j, p in enumerate(positions):
                if reply.found[j]:
                    out[p] = BlockLocation(
                        keys[p], tuple(int(x) for x in reply.placements[j]), int(reply.sizes[j])
                    )
                else:
                    why[p] = "not in the index"
        return out

    @staticmethod
    def _rank(
        placement: Sequence[int], asked: set[int], down: set[int], slow: Mapping[int, float]
    ) -> list[int]:
        """Stripe indices worth asking, best first: healthy data shards (then the block is a
        plain concatenation), then parity; slow nodes (``slow``: their latency estimates)
        last, the slowest of them last of all. When more nodes are slow than the block has
        parity some must be asked, and asking them in placement order asked a node that never
        answers before ones a few milliseconds slow: a hedge every read."""
        candidates = [
            index
            for index, node in enumerate(placement)
            if node >= 0 and index not in asked and node not in down
        ]
        if slow:
            candidates.sort(key=lambda index: slow.get(placement[index], 0.0))
        return candidates

    def _fetch(
        self, locations: Sequence[BlockLocation | None]
    ) -> tuple[list[np.ndarray | None], list[bool], dict[int, str]]:
        """The blocks at ``locations`` (None: a miss), whether each was degraded, and why each
        located block that missed did (by position)."""
        # One allocation for every block of the batch, each block a view of it. An array per
        # block is fresh memory each read (glibc hands small ones back to the kernel when freed
        # in bulk; large ones are mmaps), and fresh pages fault on first touch, which cost
        # several times the copy itself (~6 ms per 64 x 111 KiB). One large array faults too,
        # but numpy backs it with huge pages (measured: 64 x 1.35 MiB took ~400 faults per
        # read this way, ~11,000 with an array per block, ~3,700 with 8 MiB arenas).
        arena = np.empty(sum(loc.size for loc in locations if loc is not None), dtype=np.uint8)
        slots: list[np.ndarray | None] = []
        offset = 0
        for location in locations:
            if location is None:
                slots.append(None)
                continue
            slots.append(arena[offset : offset + location.size])
            offset += location.size
        down = set(self.down_nodes())
        out, why = self._gather_shards(locations, slots, down)
        arena.flags.writeable = False  # so no view of it can be made writeable again
        # ``down`` now holds every node seen down during this read, too.
        degraded = [
            payload is not None
            and location is not None
            and any(node < 0 or node in down for node in location.placement[: self._k])
            for payload, location in zip(out, locations, strict=True)
        ]
        return out, degraded, why

    def _gather_shards(
        self,
        locations: Sequence[BlockLocation | None],
        slots: list[np.ndarray | None],
        down: set[int],
    ) -> tuple[list[np.ndarray | None], dict[int, str]]:
        """Ask nodes for shards, hedge, top up around failures, decode (into ``slots`` where
        the fast path applies); why each located block that missed did."""
        n = len(locations)
        shards: list[list[np.ndarray | None]] = [[None] * self._width for _ in range(n)]
        asked: list[set[int]] = [set() for _ in range(n)]
        answered: list[set[int]] = [set() for _ in range(n)]  # calls that came back (or failed)
        have = np.zeros(n, dtype=np.int64)
        outstanding = np.zeros(n, dtype=np.int64)
        slow = self.slow_estimates()
        calls: dict[Ticket[tuple[np.ndarray, np.ndarray]], _Call] = {}

        def ask(wanted: dict[int, int]) -> None:
            """Ask for ``wanted[position]`` more shards of each block, one call per node."""
            per_node: dict[int, list[tuple[int, int]]] = defaultdict(list)
            for position, count in wanted.items():
                location = locations[position]
                if location is None or count <= 0:
                    continue
                ranked = self._rank(location.placement, asked[position], down, slow)
                if have[position] + outstanding[position] + len(ranked) < self._k:
                    # The nodes thought up cannot make the block: those thought down are
                    # asked too, all of them (one that failed a call a moment ago may well
                    # answer now: a guess must not turn a readable block into a miss).
                    ranked = self._rank(location.placement, asked[position], set(), slow)
                    count = len(ranked)
                for index in ranked[:count]:
                    per_node[location.placement[index]].append((position, index))
                    asked[position].add(index)
                    outstanding[position] += 1
            for node, items in per_node.items():
                keys = [locations[p].key for p, _ in items]  # type: ignore[union-attr]
                ticket = self._fanout.submit(node_target(node), StorageNodeCalls.get, keys)
                calls[ticket] = _Call(node, items, time.monotonic())

        def short(include_outstanding: bool) -> dict[int, int]:
            counted = have + (outstanding if include_outstanding else 0)
            return {
                p: int(self._k - counted[p])
                for p in range(n)
                if locations[p] is not None and counted[p] < self._k
            }

        ask({p: self._k for p in range(n)})
        start = time.monotonic()  # after submitting: an in-process fanout answers while asked
        located = sum(1 for location in locations if location is not None)
        hedge_at = start + self._hedge_delay(located)
        deadline = start + self.config.call_timeout_s
        hedged = False
        self._fetches += 1
        sample = self._fetches % _LATENCY_SAMPLE_EVERY == 1
        if sample and slow:
            # Slow nodes are asked last, so nothing would ever measure them again: a sampled
            # read also asks each for one shard it need not wait for (a node that recovered
            # answers within the read and stops counting as slow).
            probe: dict[int, tuple[int, int]] = {}
            for position, location in enumerate(locations):
                for index, node in enumerate(location.placement if location is not None else ()):
                    if node in slow and node not in probe and index not in asked[position]:
                        probe[node] = (position, index)
            for node, (position, index) in probe.items():
                asked[position].add(index)
                outstanding[position] += 1
                key = locations[position].key  # type: ignore[union-attr]
                ticket = self._fanout.submit(node_target(node), StorageNodeCalls.get, [key])
                calls[ticket] = _Call(node, [(position, index)], time.monotonic())

        def take(ready: list[Ticket[tuple[np.ndarray, np.ndarray]]], together: bool) -> None:
            """Fold the answers of ``ready`` calls in (a failed node counts as down); taken
            ``together`` (after a wait for all, or a look at what came in), each node's time is
            only a bound on its latency (``_note_latency``)."""
            for ticket in ready:
                call = calls.pop(ticket)
                try:
                    answer = _shards(self._fanout.result(ticket), len(call.items))
                except NodeUnavailable:
                    self._mark_failed(call.node, time.monotonic() - call.started)
                    down.add(call.node)
                    answer = [None] * len(call.items)
                else:
                    self._mark_ok(call.node, time.monotonic() - call.started, together)
                for (position, index), shard in zip(call.items, answer, strict=True):
                    outstanding[position] -= 1
                    answered[position].add(index)
                    if shard is not None:
                        shards[position][index] = shard
                        have[position] += 1

        while calls and (have < self._k)[[loc is not None for loc in locations]].any():
            now = time.monotonic()
            if not hedged and now >= hedge_at:
                hedged = True
                # Answers that came in count first: a reader descheduled past ``hedge_at`` (a
                # busy host) must not hedge a read whose shards are only waiting to be taken.
                take(self._fanout.wait(list(calls), 0.0), together=True)
                late = short(include_outstanding=False)
                if late:
                    self.counters["hedged_reads"] += 1
                    ask({p: self._width for p in late})  # every node not asked yet
                continue
            if now >= deadline:
                break
            limit = (deadline if hedged else hedge_at) - now
            # Before the hedge, sleep until every call answered (waking per answer costs the CPU
            # the nodes need on a small machine; a failed node is topped up right after). After
            # it, wake per answer: a hung node must not hold up blocks that are complete.
            # (Every few reads wake per answer anyway, to keep per-node latencies measured.)
            together = not (hedged or sample)
            take(self._fanout.wait(list(calls), limit, all_of=together), together)
            top_up = short(include_outstanding=True)
            if top_up:  # failed nodes or missing shards: ask others right away
                ask(top_up)
        if located and not short(include_outstanding=False):
            self._note_read_time(located, time.monotonic() - start)
        seconds = time.monotonic() - start
        if calls:
            # Answers nobody waits for any more: their nodes took at least this long (a node
            # that never answers in time must count as slow, or every read waits for its
            # hedge), and their connections must not carry a late reply into another call.
            now = time.monotonic()
            for call in calls.values():
                self._note_latency(call.node, now - call.started, lower_bound=True)
            self._fanout.cancel(list(calls))
        out: list[np.ndarray | None] = []
        retry: list[int] = []
        for position, location in enumerate(locations):
            payload = None
            if location is not None:
                payload = self._decode(location, shards[position], slots[position])
            if payload is None and location is not None and have[position] >= self._k:
                retry.append(position)  # corrupt or mixed shards: other nodes may do better
            out.append(payload)
        # Not ``asked``: after a hedge every node was asked, and the calls still out when the
        # first k came were given up; their shards are what a stripe that did not decode needs.
        if any(len(answered[p]) < self._width for p in retry):
            second = self._fetch_remaining(locations, retry, answered, shards, down)
            for position, payload in second.items():
                out[position] = payload
        why = {
            position: self._why_missed(
                location, shards[position], asked[position], answered[position], down, seconds
            )
            for position, (location, payload) in enumerate(zip(locations, out, strict=True))
            if payload is None and location is not None
        }
        return out, why

    def _why_missed(
        self,
        location: BlockLocation,
        stripe: list[np.ndarray | None],
        asked: set[int],
        answered: set[int],
        down: set[int],
        seconds: float,
    ) -> str:
        """Why a located block missed, in words: which of its shards came and what became of
        the others (a dead host's two nodes and a third that failed read differently from a
        block whose shards came but did not decode)."""
        placement = location.placement
        came = sum(shard is not None for shard in stripe)
        if came >= self._k:
            return f"{came} shards came but no {self._k} of them decode to its payload hash"
        fates: dict[str, list[int]] = defaultdict(list)
        for index, node in enumerate(placement):
            if node < 0:
                fates["lost (stripe positions)"].append(index)
            elif stripe[index] is not None:
                continue
            elif index not in asked:
                fates["not asked (thought down)"].append(node)
            elif index not in answered:
                fates[f"no answer in {seconds:.1f} s"].append(node)
            elif node in down:
                fates["failed"].append(node)
            else:
                fates["did not hold it"].append(node)
        said = "; ".join(f"{fate}: {sorted(nodes)}" for fate, nodes in fates.items())
        return f"{came} of {len(placement)} shards came ({self._k} needed); {said}"

    def _fetch_remaining(
        self,
        locations: Sequence[BlockLocation | None],
        positions: list[int],
        answered: list[set[int]],
        shards: list[list[np.ndarray | None]],
        down: set[int],
    ) -> dict[int, np.ndarray | None]:
        """Second chance for blocks whose first k shards did not decode: ask every live node
        whose answer the first pass does not have."""
        per_node: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for position in positions:
            location = locations[position]
            assert location is not None
            for index in self._rank(location.placement, answered[position], down, {}):
                per_node[location.placement[index]].append((position, index))
        tickets = {
            self._fanout.submit(
                node_target(node),
                StorageNodeCalls.get,
                [locations[p].key for p, _ in items],  # type: ignore[union-attr]
            ): items
            for node, items in per_node.items()
        }
        for ticket, outcome in self._gather(tickets, self.config.call_timeout_s).items():
            if isinstance(outcome, NodeUnavailable):
                continue
            try:
                got = _shards(outcome, len(tickets[ticket]))
            except NodeUnavailable:
                continue
            for (position, index), shard in zip(tickets[ticket], got, strict=True):
                if shard is not None:
                    shards[position][index] = shard
        self.counters["second_chance_reads"] += len(positions)
        return {
            position: self._decode(locations[position], shards[position])  # type: ignore[arg-type]
            for position in positions
        }

    def _decode(
        self,
        location: BlockLocation,
        stripe: list[np.ndarray | None],
        out: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """Decode from shards of ``stripe`` (by stripe position, None: missing) agreeing on one
        payload hash; verify the block against it. ``out``: where the fast path may build the
        block (``location.size`` bytes)."""
        fast = self._concatenate(location, stripe, out)
        if fast is not None:
            return fast
        present = [shard for shard in stripe if shard is not None]
        digests = {shard[PAYLOAD_HASH].tobytes() for shard in present if shard.size >= HEADER_BYTES}
        if len(digests) == 1 and len(present) >= self._k:
            # The usual degraded read: one write's shards. Decode them as one group without
            # grouping them first; the block's hash against that digest checks it all the
            # same. Anything else (or a failure here) goes through the grouping below.
            block = self._decode_group(location, stripe, range(self._width), digests.pop(), out)
            if block is not None:
                return block
        groups, corrupt = writes_by_payload(stripe)
        self.counters["corrupt_shards"] += corrupt
        for digest, members in groups:
            if len(members) < self._k:
                break
            block = self._decode_group(location, stripe, members, digest, out)
            if block is not None:
                return block
        return None

    def _decode_group(
        self,
        location: BlockLocation,
        stripe: list[np.ndarray | None],
        members: Iterable[int],
        digest: bytes,
        out: np.ndarray | None,
    ) -> np.ndarray | None:
        """The block from the shards ``members`` of ``stripe`` (any k that pass the codec's
        checks), or None unless it hashes to ``digest``."""
        chosen = set(members)
        shards = [shard if index in chosen else None for index, shard in enumerate(stripe)]
        data: object
        try:
            if out is not None:  # straight into the batch's buffer: no block-sized malloc
                self._codec.decode_into(shards, out, size=location.size, key=location.key)
                data = out
            else:
                data = self._codec.decode(shards, size=location.size, key=location.key)
        except TooFewShards:
            self.counters["undecodable_blocks"] += 1
            return None
        if payload_hash(data) != digest:
            self.counters["hash_mismatches"] += 1
            return None
        if out is None:
            return np.frombuffer(data, dtype=np.uint8)  # read-only: it views ``bytes``
        out.flags.writeable = False
        return out

    def _concatenate(
        self,
        location: BlockLocation,
        stripe: list[np.ndarray | None],
        out: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """Fast path of a systematic code: with all k data shards at hand the block is their
        fragments end to end. The payload hash of the result, which every shard's header
        carries, verifies it whole (one hash of the block instead of k shard checksums), so
        the Python cost of checking k shards one by one is skipped. Anything unusual returns
        None and the full decoder (per-shard checks, grouping, Reed-Solomon) takes over."""
        k = self._k
        data = stripe[:k]
        first = data[0]
        if first is None or any(shard is None for shard in data):
            return None
        size = location.size
        fragment = fragment_length(size, k)
        expected = HEADER_BYTES + fragment
        digest = first[PAYLOAD_HASH].tobytes()
        if out is None:
            out = np.empty(size, dtype=np.uint8)
        for index, shard in enumerate(data):
            assert shard is not None
            if shard.size != expected or shard[PAYLOAD_HASH].tobytes() != digest:
                return None
            begin = index * fragment
            if begin >= size:
                break
            length = min(fragment, size - begin)
            out[begin : begin + length] = shard[HEADER_BYTES : HEADER_BYTES + length]
        if payload_hash(out) != digest:
            return None
        self.counters["fast_decodes"] += 1
        out.flags.writeable = False
        return out


def _shards(reply: Any, count: int) -> list[np.ndarray | None]:
    """A node's ``get`` reply as one shard view per asked key; a malformed reply counts as a
    failed node (never as data)."""
    try:
        shards = split_shards(reply)
    except (StoreError, TypeError, ValueError) as error:
        raise NodeUnavailable(f"malformed shard batch: {error}") from None
    if len(shards) != count:
        raise NodeUnavailable(f"node answered {len(shards)} shards for {count} keys")
    return shards
