"""The in-cluster client of the Block KVCache tier: put, lookup, get, release.

Write rule (all or nothing). A block becomes visible to ``lookup`` only after:

1. its meta shard granted this writer a reservation of the key (``begin_put``);
2. all k+m shards were written *pending* and acknowledged durable by their k+m distinct nodes
   (one ``put`` call per node per batch);
3. all k+m nodes acknowledged the commit mark (pending file renamed into ``shards/``);
4. its meta shard inserted it into the index (``commit``) — the visibility point.

A block missing any acknowledgement in 2 or 3 is reported ``failed`` and never inserted; its
reservation is dropped and its pending/committed shard files are orphans that the nodes'
orphan scrub reclaims after ``orphan_grace_s``. A writer that dies anywhere before 4 leaves no
visible block. Because step 3 only starts after step 2 finished everywhere, a committed shard
file proves its whole stripe was durable; a meta shard rebuilt from manifests restores a block
only with >= k committed shards found (``meta.py``), so an uncommitted write is never
resurrected and a committed one is never lost.

Read rule: ask the k fastest nodes holding shards of each block (data shards first, so the
common case is a plain concatenation), one call per node per batch; shards still missing after
``hedge_after_s`` (slow nodes) or at once (failed nodes) are asked of the remaining nodes. A
block is decoded from any k shards that agree on its payload hash and checked against it; a
block that cannot be is a miss. Node failures never escape as exceptions.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.blockstore.config import BlockStoreConfig
from kvstore.blockstore.fanout import META, NODE, Fanout
from kvstore.blockstore.meta import MetaReply
from kvstore.blockstore.node import split_files
from kvstore.blockstore.placement import meta_shard_of, place
from kvstore.blockstore.records import (
    BlockLocation,
    Lease,
    LookupResult,
    PutResult,
    PutStatus,
)
from kvstore.blockstore.shardfile import (
    NODE_HEADER_BYTES,
    PAYLOAD_HASH,
    parse_node_header,
    payload_hash,
    shard_view,
)
from kvstore.clock import Clock, SystemClock
from kvstore.ec import Codec
from kvstore.ec.shard import HEADER_BYTES as SHARD_HEADER_BYTES
from kvstore.ec.shard import fragment_length
from kvstore.errors import (
    CorruptShard,
    InvalidArgument,
    NodeUnavailable,
    StoreError,
    TooFewShards,
)
from kvstore.keys import BlockKey, check_keys

log = logging.getLogger(__name__)

_EWMA = 0.2
#: A node slower than this multiple of the median is asked only when others cannot serve.
_SLOW_FACTOR = 2.0
#: One read in this many times each node's answer separately (the others wait for all at once).
_LATENCY_SAMPLE_EVERY = 8


@dataclass
class _Call:
    node: int
    items: list[tuple[int, int]]  # (block position, stripe index)
    started: float


class BlockStoreClient:
    """Python client, usable from any process in the Ray cluster (or in-process in tests)."""

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
        self._nodes = list(node_ids if node_ids is not None else range(config.storage_nodes))
        self._retry_at: dict[int, float] = {}
        self._latency: dict[int, float] = {}
        self._fetches = 0
        self.counters: dict[str, int] = defaultdict(int)

    # --- membership and health --------------------------------------------------------------

    @property
    def node_ids(self) -> list[int]:
        return list(self._nodes)

    def set_nodes(self, node_ids: Sequence[int]) -> None:
        self._nodes = sorted({int(node) for node in node_ids})

    def down_nodes(self) -> list[int]:
        now = time.monotonic()
        return sorted(node for node, until in self._retry_at.items() if until > now)

    def _mark_failed(self, node: int) -> None:
        self._retry_at[node] = time.monotonic() + self.config.node_retry_s
        self.counters["node_failures"] += 1

    def _mark_ok(self, node: int, seconds: float) -> None:
        self._retry_at.pop(node, None)
        previous = self._latency.get(node)
        self._latency[node] = (
            seconds if previous is None else (1 - _EWMA) * previous + (_EWMA * seconds)
        )

    def _learn_down(self, nodes: Sequence[int]) -> None:
        """Nodes the cluster declared dead: skip them without trying first."""
        until = time.monotonic() + self.config.node_retry_s
        for node in nodes:
            self._retry_at[int(node)] = max(self._retry_at.get(int(node), 0.0), until)

    def _live_nodes(self) -> list[int]:
        down = set(self.down_nodes())
        return [node for node in self._nodes if node not in down]

    # --- plumbing ---------------------------------------------------------------------------

    def _gather(self, tickets: dict[Any, Any], timeout: float) -> dict[Any, Any]:
        """Wait for every ticket (up to ``timeout``); values are results or NodeUnavailable."""
        outcomes: dict[Any, Any] = {}
        deadline = time.monotonic() + timeout
        pending = set(tickets)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for ticket in self._fanout.wait(list(pending), left):
                pending.discard(ticket)
                try:
                    outcomes[ticket] = self._fanout.result(ticket)
                except NodeUnavailable as error:
                    outcomes[ticket] = error
        for ticket in pending:
            outcomes[ticket] = NodeUnavailable(f"{tickets[ticket]} did not answer in {timeout}s")
        return outcomes

    def _by_meta(self, keys: Sequence[BlockKey]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = defaultdict(list)
        if keys:
            for position, shard in enumerate(meta_shard_of(keys, self.config.meta_shards)):
                groups[int(shard)].append(position)
        return groups

    def _meta_calls(
        self, keys: Sequence[BlockKey], method: str, *args: Any
    ) -> dict[int, tuple[list[int], Any]]:
        """Call ``method(keys_of_shard, *args)`` on every meta shard owning some of ``keys``;
        returns shard -> (positions, result or NodeUnavailable)."""
        groups = self._by_meta(keys)
        tickets = {
            self._fanout.submit((META, shard), method, [keys[p] for p in positions], *args): shard
            for shard, positions in groups.items()
        }
        outcomes = self._gather(tickets, self.config.call_timeout_s)
        return {tickets[t]: (groups[tickets[t]], outcome) for t, outcome in outcomes.items()}

    def _check_keys(self, keys: Sequence[bytes]) -> list[BlockKey]:
        if isinstance(keys, bytes | bytearray):
            raise InvalidArgument("keys", "must be a sequence of keys, got one bytes object")
        return check_keys(keys, "keys")

    # --- put --------------------------------------------------------------------------------

    def put_blocks(
        self, keys: Sequence[bytes], payloads: Sequence[object], traffic_class: str = "default"
    ) -> PutResult:
        """Store blocks (all or nothing per block, see the module doc). Keys already committed
        are not rewritten. Never raises for node failures: failed blocks are listed."""
        checked = self._check_keys(keys)
        if len(payloads) != len(checked):
            raise InvalidArgument(
                "payloads", f"has {len(payloads)} entries for {len(checked)} keys"
            )
        if len(set(checked)) != len(checked):
            raise InvalidArgument("keys", "must not repeat a key within one put")
        class_id = self.config.class_id(traffic_class)
        token = secrets.randbits(64)
        existing: list[BlockKey] = []
        busy: list[BlockKey] = []
        failed: list[BlockKey] = []
        granted: list[int] = []
        for shard, (positions, outcome) in self._meta_calls(checked, "begin_put", token).items():
            if isinstance(outcome, NodeUnavailable):
                log.warning("meta shard %d unavailable for put: %s", shard, outcome)
                failed.extend(checked[p] for p in positions)
                continue
            for position, status in zip(positions, outcome, strict=True):
                if status == PutStatus.GRANTED:
                    granted.append(position)
                elif status == PutStatus.EXISTS:
                    existing.append(checked[position])
                else:
                    busy.append(checked[position])
        granted.sort()
        stored: list[BlockKey] = []
        if granted:
            done, lost = self._write(
                [checked[p] for p in granted], [payloads[p] for p in granted], class_id, token
            )
            stored.extend(done)
            failed.extend(lost)
            if lost:  # drop their reservations so another writer may try at once
                self._meta_calls(lost, "abort_put", token)
        self.counters["blocks_stored"] += len(stored)
        self.counters["blocks_put_failed"] += len(failed)
        return PutResult(stored=stored, existing=existing, busy=busy, failed=failed)

    def _write(
        self, keys: list[BlockKey], payloads: list[object], class_id: int, token: int
    ) -> tuple[list[BlockKey], list[BlockKey]]:
        """Steps 2-4 of the write rule for reserved keys; returns (stored, failed)."""
        stripes = [
            self._codec.encode(payload, key) for payload, key in zip(payloads, keys, strict=True)
        ]
        sizes = [int(np.asarray(_flat(payload)).size) for payload in payloads]
        hashes = [payload_hash(_flat(payload)) for payload in payloads]
        created = self._clock.now()
        todo = list(range(len(keys)))
        written: dict[int, np.ndarray] = {}  # block position -> placement fully acked
        for _attempt in range(2):  # a node failing mid-put: re-place on the others once
            live = self._live_nodes()
            if len(live) < self._width or not todo:
                break
            placements = place([keys[i] for i in todo], live, self._width)
            per_node: dict[int, list[tuple[int, int]]] = defaultdict(list)
            for row, position in enumerate(todo):
                for index, node in enumerate(placements[row]):
                    per_node[int(node)].append((position, index))
            tickets = {}
            for node, items in per_node.items():
                ticket = self._fanout.submit(
                    (NODE, node),
                    "put",
                    token,
                    [keys[p] for p, _ in items],
                    [stripes[p][i] for p, i in items],
                    [hashes[p] for p, _ in items],
                    [class_id] * len(items),
                    [created] * len(items),
                )
                tickets[ticket] = (node, items, time.monotonic())
            acked = np.zeros((len(keys), self._width), dtype=bool)
            for ticket, outcome in self._gather(tickets, self.config.call_timeout_s).items():
                node, items, started = tickets[ticket]
                if isinstance(outcome, NodeUnavailable):
                    self._mark_failed(node)
                    continue
                self._mark_ok(node, time.monotonic() - started)
                for (position, index), ok in zip(items, outcome, strict=True):
                    acked[position, index] = bool(ok)
            retry = []
            for row, position in enumerate(todo):
                if acked[position].all():
                    written[position] = placements[row]
                else:
                    retry.append(position)
            todo = retry
        committed = self._commit_on_nodes(keys, written, token)
        stored_positions = self._commit_in_meta(keys, committed, sizes, class_id, token)
        stored = [keys[p] for p in sorted(stored_positions)]
        failed = [keys[p] for p in range(len(keys)) if p not in stored_positions]
        return stored, failed

    def _commit_on_nodes(
        self, keys: list[BlockKey], written: dict[int, np.ndarray], token: int
    ) -> dict[int, np.ndarray]:
        """Step 3: commit marks; returns the blocks whose every node acknowledged."""
        per_node: dict[int, list[int]] = defaultdict(list)
        for position, placement in written.items():
            for node in placement:
                per_node[int(node)].append(position)
        tickets = {
            self._fanout.submit((NODE, node), "commit", token, [keys[p] for p in positions]): (
                node,
                positions,
            )
            for node, positions in per_node.items()
        }
        marks: dict[int, int] = defaultdict(int)
        for ticket, outcome in self._gather(tickets, self.config.call_timeout_s).items():
            node, positions = tickets[ticket]
            if isinstance(outcome, NodeUnavailable):
                self._mark_failed(node)
                continue
            for position, ok in zip(positions, outcome, strict=True):
                marks[position] += bool(ok)
        return {p: pl for p, pl in written.items() if marks[p] == self._width}

    def _commit_in_meta(
        self,
        keys: list[BlockKey],
        committed: dict[int, np.ndarray],
        sizes: list[int],
        class_id: int,
        token: int,
    ) -> set[int]:
        """Step 4: the visibility point."""
        positions = sorted(committed)
        if not positions:
            return set()
        subset = [keys[p] for p in positions]
        placements = np.stack([committed[p] for p in positions])
        # One call per meta shard, with the placements and sizes of its own keys.
        stored: set[int] = set()
        groups = self._by_meta(subset)
        tickets = {}
        for shard, members in groups.items():
            ticket = self._fanout.submit(
                (META, shard),
                "commit",
                [subset[m] for m in members],
                token,
                placements[members],
                [sizes[positions[m]] for m in members],
                class_id,
            )
            tickets[ticket] = members
        for ticket, outcome in self._gather(tickets, self.config.call_timeout_s).items():
            if isinstance(outcome, NodeUnavailable):
                continue
            for member, ok in zip(tickets[ticket], outcome, strict=True):
                if ok:
                    stored.add(positions[member])
        return stored

    # --- lookup / release -------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], traffic_class: str | None = None) -> LookupResult:
        """Longest consecutive prefix of ``keys`` whose blocks are committed and readable, with
        a lease on them (release it when read). Unreachable meta shards count as misses."""
        return self.lookup_many([(keys, traffic_class)])[0]

    def lookup_many(
        self, requests: Sequence[tuple[Sequence[bytes], str | None]]
    ) -> list[LookupResult]:
        """``lookup`` of several key lists in one round: one call per meta shard and traffic
        class however many requests there are (a gateway coalesces concurrent QueryHits here,
        so its Ray call rate does not grow with its concurrency)."""
        checked = [self._check_keys(keys) for keys, _ in requests]
        down = self.down_nodes()
        by_class: dict[str | None, list[int]] = defaultdict(list)
        for index, (_, traffic_class) in enumerate(requests):
            by_class[traffic_class].append(index)
        # Per class: the requests' keys end to end, and where each request starts.
        flat: dict[str | None, list[BlockKey]] = {}
        starts: dict[int, tuple[str | None, int]] = {}
        for traffic_class, members in by_class.items():
            keys: list[BlockKey] = []
            for index in members:
                starts[index] = (traffic_class, len(keys))
                keys.extend(checked[index])
            flat[traffic_class] = keys
        state = {
            traffic_class: (
                np.zeros(len(keys), dtype=bool),  # readable
                np.full((len(keys), self._width), -1, dtype=np.int32),  # placements
                np.zeros(len(keys), dtype=np.int64),  # sizes
                np.full(len(keys), np.inf),  # lease end of the shard that answered the key
            )
            for traffic_class, keys in flat.items()
        }
        tickets: dict[Any, tuple[str | None, list[int]]] = {}
        for traffic_class, keys in flat.items():
            for shard, positions in self._by_meta(keys).items():
                ticket = self._fanout.submit(
                    (META, shard), "lookup", [keys[p] for p in positions], down, traffic_class, None
                )
                tickets[ticket] = (traffic_class, positions)
        outcomes = self._gather(tickets, self.config.call_timeout_s)
        for ticket, reply in outcomes.items():
            traffic_class, positions = tickets[ticket]
            if isinstance(reply, NodeUnavailable):
                self.counters["meta_unavailable"] += 1
                continue
            assert isinstance(reply, MetaReply)
            self._learn_down(reply.down)
            readable, placements, sizes, until = state[traffic_class]
            at = np.asarray(positions)
            readable[at] = reply.readable
            placements[at] = reply.placements
            sizes[at] = reply.sizes
            if reply.lease_until:
                until[at] = reply.lease_until
        results: list[LookupResult] = []
        extras: list[BlockKey] = []
        for index, keys in enumerate(checked):
            traffic_class, start = starts[index]
            readable, placements, sizes, until = state[traffic_class]
            end = start + len(keys)
            misses = np.flatnonzero(~readable[start:end])
            hit = int(misses[0]) if misses.size else len(keys)
            # Leased but beyond the prefix: give them back (below, without waiting).
            extras.extend(keys[p] for p in np.flatnonzero(readable[start + hit : end]) + hit)
            self.counters["lookups"] += 1
            self.counters["lookup_hit_blocks"] += hit
            if hit == 0:
                results.append(LookupResult(0, None))
                continue
            lease_end = float(until[start : start + hit].min())
            lease = Lease(
                secrets.token_hex(8),
                lease_end,
                tuple(keys[:hit]),
                placements[start : start + hit].copy(),
                sizes[start : start + hit].copy(),
            )
            results.append(LookupResult(hit, lease))
        if extras:
            self._release_keys(extras, wait=False)
        return results

    def release(self, lease: Lease | None) -> None:
        """Give a lease back (GC may then remove its blocks). Never raises for node failures."""
        self.release_many([lease])

    def release_many(self, leases: Sequence[Lease | None], wait: bool = True) -> None:
        """Give several leases back in one call per meta shard. ``wait=False`` returns at once
        (a release needs no answer: an unreleased lease only ends at its expiry)."""
        keys = [key for lease in leases if lease is not None for key in lease.keys]
        if keys:
            self._release_keys(keys, wait)

    def _release_keys(self, keys: list[BlockKey], wait: bool) -> None:
        if wait:
            self._meta_calls(keys, "release")
            return
        for shard, positions in self._by_meta(keys).items():
            self._fanout.submit((META, shard), "release", [keys[p] for p in positions])

    # --- get --------------------------------------------------------------------------------

    def get_blocks(
        self, keys: Sequence[bytes], lease: Lease | None = None
    ) -> list[np.ndarray | None]:
        """Payloads of ``keys`` as read-only uint8 arrays, bit-exact, or None (a miss).

        With ``lease`` (from ``lookup``) the shard locations it carries save a meta round trip.
        """
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
        unknown = [p for p, loc in enumerate(locations) if loc is None]
        if unknown:
            located = self._locate([checked[p] for p in unknown], lease)
            for p, loc in zip(unknown, located, strict=True):
                locations[p] = loc
        out = self._fetch(locations)
        if known:  # a lease's placement may predate a repair: re-locate and retry misses
            stale = [p for p, payload in enumerate(out) if payload is None and checked[p] in known]
            if stale:
                fresh = self._locate([checked[p] for p in stale], lease)
                retry = self._fetch(fresh)
                for p, payload in zip(stale, retry, strict=True):
                    out[p] = payload
        self.counters["get_blocks"] += len(checked)
        self.counters["get_misses"] += sum(1 for payload in out if payload is None)
        return out

    def _locate(self, keys: list[BlockKey], lease: Lease | None) -> list[BlockLocation | None]:
        out: list[BlockLocation | None] = [None] * len(keys)
        until = lease.until if lease is not None else None
        for _shard, (positions, reply) in self._meta_calls(
            keys, "locate", self.down_nodes(), None, until
        ).items():
            if isinstance(reply, NodeUnavailable):
                self.counters["meta_unavailable"] += 1
                continue
            self._learn_down(reply.down)
            for j, p in enumerate(positions):
                if reply.found[j]:
                    out[p] = BlockLocation(
                        keys[p], tuple(int(x) for x in reply.placements[j]), int(reply.sizes[j])
                    )
        return out

    def _hedge_delay(self) -> float:
        """Wait this long for the first k before asking the others: ``hedge_after_s`` or twice
        the typical call latency, whichever is longer (a loaded machine is slow everywhere;
        hedging then only adds load)."""
        known = list(self._latency.values())
        typical = float(np.median(known)) if known else 0.0
        return max(self.config.hedge_after_s, 2.0 * typical)

    def _slow_nodes(self) -> set[int]:
        """Nodes much slower than the median: asked only when the others cannot serve."""
        known = list(self._latency.values())
        if len(known) < 2:
            return set()
        median = float(np.median(known))
        return {node for node, v in self._latency.items() if v > _SLOW_FACTOR * median}

    @staticmethod
    def _rank(
        placement: Sequence[int], asked: set[int], down: set[int], slow: set[int]
    ) -> list[int]:
        """Stripe indices worth asking, best first: healthy data shards (then the block is a
        plain concatenation), then parity; slow nodes last."""
        candidates = [
            index
            for index, node in enumerate(placement)
            if node >= 0 and index not in asked and node not in down
        ]
        if slow:
            candidates.sort(key=lambda index: placement[index] in slow)
        return candidates

    def _fetch(self, locations: Sequence[BlockLocation | None]) -> list[np.ndarray | None]:
        n = len(locations)
        files: list[list[np.ndarray | None]] = [[None] * self._width for _ in range(n)]
        asked: list[set[int]] = [set() for _ in range(n)]
        have = np.zeros(n, dtype=np.int64)
        outstanding = np.zeros(n, dtype=np.int64)
        down = set(self.down_nodes())
        slow = self._slow_nodes()
        calls: dict[Any, _Call] = {}

        def ask(wanted: dict[int, int]) -> None:
            """Ask for ``wanted[position]`` more shards of each block, one call per node."""
            per_node: dict[int, list[tuple[int, int]]] = defaultdict(list)
            for position, count in wanted.items():
                location = locations[position]
                if location is None or count <= 0:
                    continue
                for index in self._rank(location.placement, asked[position], down, slow)[:count]:
                    per_node[location.placement[index]].append((position, index))
                    asked[position].add(index)
                    outstanding[position] += 1
            for node, items in per_node.items():
                keys = [locations[p].key for p, _ in items]  # type: ignore[union-attr]
                ticket = self._fanout.submit((NODE, node), "get", keys)
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
        hedge_at = start + self._hedge_delay()
        deadline = start + self.config.call_timeout_s
        hedged = False
        self._fetches += 1
        sample = self._fetches % _LATENCY_SAMPLE_EVERY == 1
        while calls and (have < self._k)[[loc is not None for loc in locations]].any():
            now = time.monotonic()
            if not hedged and now >= hedge_at:
                hedged = True
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
            for ticket in self._fanout.wait(list(calls), limit, all_of=not (hedged or sample)):
                call = calls.pop(ticket)
                try:
                    answer = _files(self._fanout.result(ticket), len(call.items))
                except NodeUnavailable:
                    self._mark_failed(call.node)
                    down.add(call.node)
                    answer = [None] * len(call.items)
                else:
                    self._mark_ok(call.node, time.monotonic() - call.started)
                for (position, index), file in zip(call.items, answer, strict=True):
                    outstanding[position] -= 1
                    if file is not None:
                        files[position][index] = file
                        have[position] += 1
            top_up = short(include_outstanding=True)
            if top_up:  # failed nodes or missing shards: ask others right away
                ask(top_up)
        out: list[np.ndarray | None] = []
        retry: list[int] = []
        for position, location in enumerate(locations):
            payload = None if location is None else self._decode(location, files[position])
            if payload is None and location is not None and have[position] >= self._k:
                retry.append(position)  # corrupt or mixed shards: other nodes may do better
            out.append(payload)
        if any(len(asked[p]) < self._width for p in retry):
            second = self._fetch_remaining(locations, retry, asked, files, down)
            for position, payload in second.items():
                out[position] = payload
        # Degraded: served although a data shard's node was down, so parity had to stand in.
        # (Hedged reads of a healthy stripe may decode from parity too; that is not degraded.)
        degraded = sum(
            1
            for p, location in enumerate(locations)
            if out[p] is not None
            and location is not None
            and any(node < 0 or node in down for node in location.placement[: self._k])
        )
        self.counters["degraded_blocks"] += degraded
        return out

    def _fetch_remaining(
        self,
        locations: Sequence[BlockLocation | None],
        positions: list[int],
        asked: list[set[int]],
        files: list[list[np.ndarray | None]],
        down: set[int],
    ) -> dict[int, np.ndarray | None]:
        """Second chance for blocks whose first k shards did not decode: ask everyone else."""
        per_node: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for position in positions:
            location = locations[position]
            assert location is not None
            for index in self._rank(location.placement, asked[position], down, set()):
                per_node[location.placement[index]].append((position, index))
        tickets = {
            self._fanout.submit(
                (NODE, node),
                "get",
                [locations[p].key for p, _ in items],  # type: ignore[union-attr]
            ): items
            for node, items in per_node.items()
        }
        for ticket, outcome in self._gather(tickets, self.config.call_timeout_s).items():
            if isinstance(outcome, NodeUnavailable):
                continue
            try:
                got = _files(outcome, len(tickets[ticket]))
            except NodeUnavailable:
                continue
            for (position, index), file in zip(tickets[ticket], got, strict=True):
                if file is not None:
                    files[position][index] = file
        self.counters["second_chance_reads"] += len(positions)
        return {
            position: self._decode(locations[position], files[position])  # type: ignore[arg-type]
            for position in positions
        }

    def _decode(self, location: BlockLocation, files: list[np.ndarray | None]) -> np.ndarray | None:
        """Decode from shards agreeing on one payload hash; verify the block against it."""
        fast = self._concatenate(location, files)
        if fast is not None:
            return fast
        groups: dict[bytes, list[int]] = defaultdict(list)
        for index, file in enumerate(files):
            if file is None:
                continue
            try:
                groups[parse_node_header(file).payload_hash].append(index)
            except CorruptShard:
                self.counters["corrupt_shards"] += 1
        for digest, members in sorted(groups.items(), key=lambda item: -len(item[1])):
            if len(members) < self._k:
                break
            chosen = set(members)
            shards = [
                shard_view(file) if index in chosen and file is not None else None
                for index, file in enumerate(files)
            ]
            try:
                data = self._codec.decode(shards, size=location.size, key=location.key)
            except TooFewShards:
                self.counters["undecodable_blocks"] += 1
                continue
            if payload_hash(data) != digest:
                self.counters["hash_mismatches"] += 1
                continue
            return np.frombuffer(data, dtype=np.uint8)
        return None

    def _concatenate(
        self, location: BlockLocation, files: list[np.ndarray | None]
    ) -> np.ndarray | None:
        """Fast path of a systematic code: with all k data shards at hand the block is their
        fragments end to end. The 128-bit payload hash of the result, which every shard's node
        header carries, verifies it whole (stronger than per-shard checksums), so the Python
        cost of checking k shards one by one is skipped. Anything unusual returns None and the
        full decoder (per-shard checks, grouping, Reed-Solomon) takes over."""
        k = self._k
        data = files[:k]
        first = data[0]
        if first is None or any(file is None for file in data):
            return None
        size = location.size
        fragment = fragment_length(size, k)
        expected = NODE_HEADER_BYTES + SHARD_HEADER_BYTES + fragment
        digest = first[PAYLOAD_HASH].tobytes()
        out = np.empty(size, dtype=np.uint8)
        start = NODE_HEADER_BYTES + SHARD_HEADER_BYTES
        for index, file in enumerate(data):
            assert file is not None
            if file.size != expected or file[PAYLOAD_HASH].tobytes() != digest:
                return None
            begin = index * fragment
            if begin >= size:
                break
            length = min(fragment, size - begin)
            out[begin : begin + length] = file[start : start + length]
        if payload_hash(out) != digest:
            return None
        self.counters["fast_decodes"] += 1
        out.flags.writeable = False
        return out

    def stats(self) -> dict[str, object]:
        return {
            **self.counters,
            "down_nodes": self.down_nodes(),
            "latency_ms": {node: round(v * 1e3, 3) for node, v in sorted(self._latency.items())},
        }


def _files(reply: Any, count: int) -> list[np.ndarray | None]:
    """A node's ``get`` reply as one view per asked key; a malformed reply counts as a failed
    node (never as data)."""
    try:
        files = split_files(reply)
    except (StoreError, TypeError, ValueError) as error:
        raise NodeUnavailable(f"malformed shard batch: {error}") from None
    if len(files) != count:
        raise NodeUnavailable(f"node answered {len(files)} shards for {count} keys")
    return files


def _flat(payload: object) -> memoryview:
    if isinstance(payload, np.ndarray):
        return memoryview(np.ascontiguousarray(payload).reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    return memoryview(payload).cast("B")  # type: ignore[arg-type]
