"""The in-cluster client of the Block KVCache tier: put, lookup, get, release.

Write rule (all or nothing). A block becomes visible to ``lookup`` only after:

1. its meta shard granted this writer a reservation of the key (``begin_put``);
2. at least ``min_write_shards`` (k+1 by default) of its shards were written and acknowledged
   durable by as many distinct nodes, each shard committed on its node as it is written (one
   ``put`` call per node per batch, ``commit=True``: the SHARD record is its own commit mark;
   what a node guarantees then is documented in ``node.py``);
3. its meta shard inserted it into the index (``commit``) — the visibility point.

Normally all k+m shards are written. With fewer than k+m nodes taking writes (dead, or draining:
a node that refuses a put with ``NodeDraining`` is left out of placement for ``node_retry_s``
but still read from) but at least ``min_write_shards``, each such node gets one shard and the
parity shards past them are not written, so every data shard exists and reads stay on the
systematic path. A block whose write reached at least ``min_write_shards`` but not all of its
shards is stored *under-redundant*: its placement records the missing shards as lost (-1), it
is listed in ``PutResult.under_redundant``, and the repair restores them as it does a dead
node's.

A block with fewer acknowledgements in 2 is reported ``failed`` and never inserted; its
reservation is dropped, and its shards on the nodes are orphans: no placement names them, so
the nodes' orphan scrub reclaims them after ``orphan_grace_s`` (as it does the shards of a
stored block left out of its placement). A writer that dies anywhere before 3 leaves no
visible block.

Why no separate commit round. Nodes used to take a write's shards *pending* and make them
readable only on a second call, after the put had been acknowledged everywhere, so that a meta
shard rebuilt from the nodes' manifests could not bring back a write that failed. That second
round (12 calls, 12 flushes, a mark a shard) cost about a sixth of a put's CPU over all
processes, and it bought little: a rebuild restores a key only when at least k shards that
agree on its payload hash are found (``meta.py``), and readers decode only shards that agree
and check the result, so what a rebuild can bring back of a failed or abandoned write is a
whole block with its own bytes, under-redundant at worst (the repair completes it), or the
orphan scrub reclaims it first. A key is written again only after it left the index, and then
the newest committed shard on a node replaces the older one, as a commit mark did.

Reads are ``reads.py`` (``BlockReads``), the shared state and node health ``core.py``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.blockstore.calls import MetaShardCalls, StorageNodeCalls, meta_target, node_target
from kvstore.blockstore.fanout import Ticket, gathered
from kvstore.blockstore.placement import place
from kvstore.blockstore.reads import BlockReads
from kvstore.blockstore.records import (
    Lease,
    LookupResult,
    MetaReply,
    PutResult,
    PutStatus,
)
from kvstore.ec.buffers import payload_array
from kvstore.errors import (
    InvalidArgument,
    NodeDraining,
    NodeUnavailable,
)
from kvstore.keys import BlockKey, key_words
from kvstore.pending import Pending

log = logging.getLogger(__name__)

#: How long a lookup waits for a suspected node's probe (``lookups``): a node that answers
#: within it counts as up to lookups for the rest of its skip, one that does not as down (the
#: lookup waited that long once).
_PROBE_S = 0.25


class BlockStoreClient(BlockReads):
    """Python client, usable from any process in the Ray cluster (or in-process in tests)."""

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
        # Checked before any key is reserved: a refusal after would leave them reserved.
        arrays = [payload_array(payload) for payload in payloads]
        class_id = self.config.class_id(traffic_class)
        token = secrets.randbits(64)
        existing: list[BlockKey] = []
        busy: list[BlockKey] = []
        failed: list[BlockKey] = []
        granted: list[int] = []
        reserved = self._meta_calls(checked, MetaShardCalls.begin_put, token)
        for shard, (positions, outcome) in reserved.items():
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
        under: list[BlockKey] = []
        if granted:
            done, lost, under = self._write(
                [checked[p] for p in granted], [arrays[p] for p in granted], class_id, token
            )
            stored.extend(done)
            failed.extend(lost)
            if lost:  # drop their reservations so another writer may try at once
                self._meta_calls(lost, MetaShardCalls.abort_put, token)
        self.counters["blocks_stored"] += len(stored)
        self.counters["blocks_put_failed"] += len(failed)
        self.counters["blocks_under_redundant"] += len(under)
        return PutResult(
            stored=stored, existing=existing, busy=busy, failed=failed, under_redundant=under
        )

    def _write(
        self, keys: list[BlockKey], payloads: list[object], class_id: int, token: int
    ) -> tuple[list[BlockKey], list[BlockKey], list[BlockKey]]:
        """Steps 2 and 3 of the write rule for reserved keys; returns (stored, failed, the
        stored ones that are under-redundant)."""
        k, quorum = self.config.data_shards, self.config.write_quorum
        # The first placement is made before the encoding, which ranks the shards by node:
        # each node's shards of the batch are then one slice of its array (``encode_rows``),
        # one item on the wire that the node checks and appends as a whole
        # (``StorageNode.put``), instead of a Python object per shard on both sides.
        nodes = self._write_nodes()
        by_node = {}
        if len(nodes) >= quorum:
            by_node = _by_node(self._placements(keys, nodes), k)
        rank = _rank(by_node, len(keys), self._width)
        encoded = self._codec.encode_rows(payloads, keys, rank)
        stripes = self._codec.encode_many(payloads, keys) if encoded is None else None
        sizes = [int(np.asarray(_flat(payload)).size) for payload in payloads]
        created = self._clock.now()
        todo = np.arange(len(keys))
        # Which node holds which shard of each block, acknowledged: shard index -> node, -1 =
        # none. A node keeps one committed shard per key (a retried put replaces it, maybe with
        # another index), so each put's outcome first clears what the node held.
        held = np.full((len(keys), self._width), -1, dtype=np.int32)
        for attempt in range(2):  # a node failing mid-put: re-place on the others once
            if attempt:
                nodes = self._write_nodes()
            if len(nodes) < quorum or not todo.size:
                break
            if attempt:
                by_node = _by_node(self._placements([keys[i] for i in todo.tolist()], nodes), k)
            tickets = {}
            # An index past the write nodes is -1: not written.
            for node, (slots, indices) in by_node.items():
                positions = todo[slots]
                ticket = self._fanout.submit(
                    node_target(node),
                    StorageNodeCalls.put,
                    token,
                    [keys[p] for p in positions.tolist()],
                    _shards_of(encoded, stripes, rank, positions, indices),
                    # One array each, not a list: one wire item instead of one per shard.
                    np.full(len(positions), class_id, np.uint8),
                    np.full(len(positions), created, np.float64),
                    True,  # committed as written: no second round (the module doc)
                )
                tickets[ticket] = (node, positions, indices, time.monotonic())
            short = np.zeros(len(keys), bool)  # blocks with a put not acknowledged this attempt
            for ticket, outcome in self._gather(tickets, self.config.call_timeout_s).items():
                node, positions, indices, started = tickets[ticket]
                if isinstance(outcome, NodeUnavailable):
                    self._note_unavailable(node, outcome, time.monotonic() - started)
                    acks = np.zeros(len(positions), bool)
                else:
                    # Taken with the others after one wait: a bound, not the node's time (the
                    # node sent to first would look the slowest).
                    self._mark_ok(node, time.monotonic() - started, upper_bound=True)
                    acks = _acks(outcome, len(positions))
                rows = held[positions]
                held[positions] = np.where(rows == node, -1, rows)  # replaced, or in doubt
                held[positions[acks], indices[acks]] = node
                short[positions[~acks]] = True
            todo = todo[short[todo]]
        enough = (held >= 0).sum(axis=1) >= self.config.write_quorum
        committed = {int(p): held[p] for p in np.flatnonzero(enough)}
        stored_positions = self._commit_in_meta(keys, committed, sizes, class_id, token)
        stored = [keys[p] for p in sorted(stored_positions)]
        failed = [keys[p] for p in range(len(keys)) if p not in stored_positions]
        under = [
            keys[p]
            for p in sorted(stored_positions)
            if int((committed[p] >= 0).sum()) < self._width
        ]
        return stored, failed, under

    def _placements(self, keys: list[BlockKey], nodes: list[int]) -> np.ndarray:
        """(n, width) placement on ``nodes`` (at most ``domains.cap`` shards a host where it
        can): shard i on column i; with fewer nodes than the width, the indices past them are
        -1 (not written). Those are parity shards, so every data shard exists and reads decode
        on the systematic path."""
        room = min(len(nodes), self._width)
        placements = np.full((len(keys), self._width), -1, dtype=np.int32)
        placements[:, :room] = place(keys, nodes, room, self._domains)
        return placements

    def _note_unavailable(self, node: int, error: NodeUnavailable, waited_s: float) -> None:
        """A draining node is left out of writes for a while, not marked failed: reads still
        use it. Any other unavailable node is failed (after a call that waited ``waited_s``)."""
        if isinstance(error, NodeDraining):
            self._mark_draining(node)
        else:
            self._mark_failed(node, waited_s)

    def _commit_in_meta(
        self,
        keys: list[BlockKey],
        committed: dict[int, np.ndarray],
        sizes: list[int],
        class_id: int,
        token: int,
    ) -> set[int]:
        """Step 3: the visibility point."""
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
                meta_target(shard),
                MetaShardCalls.commit,
                [subset[m] for m in members],
                token,
                placements[members],
                np.array([sizes[positions[m]] for m in members], np.int64),
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

    def lookup(
        self, keys: Sequence[bytes] | np.ndarray, traffic_class: str | None = None
    ) -> LookupResult:
        """Longest consecutive prefix of ``keys`` whose blocks are committed and readable, with
        a lease on them (release it when read). Unreachable meta shards count as misses."""
        return self.lookups([(keys, traffic_class)]).result()[0]

    def lookups(
        self, requests: Sequence[tuple[Sequence[bytes] | np.ndarray, str | None]]
    ) -> Pending[list[LookupResult]]:
        """``lookup`` of several key lists in one round: one call per meta shard and traffic
        class however many requests there are (a gateway coalesces concurrent QueryHits here,
        so its call rate does not grow with its concurrency). The calls are out when this
        returns; wait for the answer from a thread (``result()``) or a loop (``await``).

        Keys travel as one (n, 4) uint64 array per call and come back as arrays: no Python
        object per key anywhere on this path (at 1,000 keys per request those objects, their
        pickling and the cyclic GC they feed were most of the cost)."""
        # A node down on the word of one failed call alone (a timeout under load, a restart)
        # is not taken for down here: with two nodes really down, one such node more would
        # make every stripe look unreadable and the lookup hit nothing that a read would
        # return (reads ask a skipped node when a block needs it). It is probed in the same
        # round instead (``_PROBE_S`` at the most), and only if it fails that too are the
        # blocks that need it cut from the hit.
        suspects = self.suspects()
        lookups = self._start_lookups(requests)
        outcomes = gathered(self._fanout, lookups.tickets, self._timeout)
        if not suspects:
            return outcomes.then(lambda answered: self._finish_lookups(lookups, answered))
        probes = {
            self._fanout.submit(node_target(node), StorageNodeCalls.holds, []): node
            for node in suspects
        }
        parts: list[Pending[dict[Any, Any]]] = [outcomes, gathered(self._fanout, probes, _PROBE_S)]
        return Pending.all(parts).then(
            lambda both: self._finish_lookups(lookups, both[0], self._probed(probes, both[1]))
        )

    def _probed(self, probes: dict[Any, int], answers: dict[Any, Any]) -> set[int]:
        """The suspects that failed their probe too (confirmed down now)."""
        down = set()
        for ticket, node in probes.items():
            failed = isinstance(answers.get(ticket), NodeUnavailable | None)
            self._vouch(node, not failed)
            if failed:
                down.add(node)
        return down

    @property
    def _timeout(self) -> float:
        return self.config.call_timeout_s

    def _start_lookups(
        self, requests: Sequence[tuple[Sequence[bytes] | np.ndarray, str | None]]
    ) -> _Lookups:
        """Send one ``lookup_wire`` per meta shard and traffic class for ``requests`` (the
        deferred releases riding on them), with the nodes confirmed down."""
        lookups = _Lookups([key_words(keys, "keys") for keys, _ in requests])
        down = self.confirmed_down()
        lookups.down.update(down)
        by_class: dict[str | None, list[int]] = defaultdict(list)
        for index, (_, traffic_class) in enumerate(requests):
            by_class[traffic_class].append(index)
        riders = self._take_deferred()
        for traffic_class, members in by_class.items():
            words = lookups.words
            flat = (
                np.concatenate([words[i] for i in members])
                if len(members) > 1
                else words[members[0]]
            )
            group = len(lookups.groups)
            lookups.groups.append((members, flat))
            for shard, positions in self._by_meta_words(flat).items():
                give_back = riders.pop(shard, (None, None))
                request = (flat[positions], down, traffic_class, None, *give_back)
                ticket = self._fanout.submit(
                    meta_target(shard), MetaShardCalls.lookup_wire, request
                )
                lookups.tickets[ticket] = (group, positions)
        for shard, (words_back, rows_back) in riders.items():  # no lookup to ride on
            self._fanout.submit(meta_target(shard), MetaShardCalls.release, words_back, rows_back)
        return lookups

    def _finish_lookups(
        self,
        lookups: _Lookups,
        outcomes: dict[Ticket[tuple[Any, ...]], Any],
        dead: set[int] | None = None,
    ) -> list[LookupResult]:
        """The leading run of each request and a lease on it, from the shards' answers, cut
        where a block needs one of ``dead`` (suspects that failed their probe: the meta
        shards were not told); what was leased beyond a run is given back (deferred)."""
        results: list[LookupResult | None] = [None] * len(lookups.words)
        extras: list[tuple[np.ndarray, np.ndarray]] = []  # leased beyond a prefix: give back
        for group, (members, flat) in enumerate(lookups.groups):
            n = flat.shape[0]
            readable = np.zeros(n, dtype=bool)
            placements = np.full((n, self._width), -1, dtype=np.int32)
            sizes = np.zeros(n, dtype=np.int64)
            rows = np.full(n, -1, dtype=np.int64)
            until = np.full(n, np.inf)  # lease end of the shard that answered the key
            for ticket, wire in outcomes.items():
                answered, at = lookups.tickets[ticket]
                if answered != group:
                    continue
                if isinstance(wire, NodeUnavailable):
                    self.counters["meta_unavailable"] += 1
                    continue
                reply = MetaReply.from_wire(wire)
                self._learn_down(reply.down)
                lookups.down.update(int(node) for node in reply.down)
                readable[at] = reply.readable
                placements[at] = reply.placements
                sizes[at] = reply.sizes
                if reply.rows is not None:
                    rows[at] = reply.rows
                if reply.lease_until:
                    until[at] = reply.lease_until
            leased = readable.copy()
            if dead:
                gone = np.fromiter(lookups.down | dead, np.int64)
                alive = (placements >= 0) & ~np.isin(placements, gone)
                readable &= alive.sum(axis=1) >= self._k
            start = 0
            for index in members:
                end = start + lookups.words[index].shape[0]
                misses = np.flatnonzero(~readable[start:end])
                hit = int(misses[0]) if misses.size else end - start
                beyond = np.flatnonzero(leased[start + hit : end]) + start + hit
                if beyond.size:
                    extras.append((flat[beyond], rows[beyond]))
                self.counters["lookups"] += 1
                self.counters["lookup_hit_blocks"] += hit
                if hit == 0:
                    results[index] = LookupResult(0, None)
                else:
                    prefix = slice(start, start + hit)
                    lease = Lease(
                        secrets.token_hex(8),
                        float(until[prefix].min()),
                        flat[prefix].copy(),
                        placements[prefix].copy(),
                        sizes[prefix].copy(),
                        rows[prefix].copy(),
                    )
                    results[index] = LookupResult(hit, lease)
                start = end
        if extras:
            self._defer_release(
                np.concatenate([k for k, _ in extras]), np.concatenate([r for _, r in extras])
            )
        return [result for result in results if result is not None]

    def release(self, lease: Lease | None) -> None:
        """Give a lease back (GC may then remove its blocks). Never raises for node failures."""
        self.release_many([lease])

    def release_many(self, leases: Sequence[Lease | None], wait: bool = True) -> None:
        """Give several leases back in one call per meta shard. ``wait=False`` returns at once
        and lets the release ride on the next lookup within ``release_batch_s`` (a release needs
        no answer: an unreleased lease only ends at its expiry)."""
        held = [lease for lease in leases if lease is not None and len(lease)]
        if not held:
            return
        words = np.concatenate([lease.key_words for lease in held])
        rows = np.concatenate(
            [
                lease.rows if lease.rows is not None else np.full(len(lease), -1, np.int64)
                for lease in held
            ]
        )
        if wait:
            self._release_words(words, rows, wait=True)
        else:
            self._defer_release(words, rows)

    def flush_releases(self) -> None:
        """Send every deferred release now (one call per meta shard, not waited for)."""
        for shard, (words, rows) in self._take_deferred().items():
            self._fanout.submit(meta_target(shard), MetaShardCalls.release, words, rows)

    def _defer_release(self, words: np.ndarray, rows: np.ndarray) -> None:
        if self.config.release_batch_s == 0:
            self._release_words(words, rows, wait=False)
            return
        with self._deferred_lock:
            self._deferred.append((words, rows))
            if self._deferred_since is None:
                self._deferred_since = time.monotonic()
            if self._flusher is None:
                self._flusher = threading.Thread(
                    target=self._flush_loop, name="lease-release", daemon=True
                )
                self._flusher.start()
        self._flush_wake.set()

    def _flush_loop(self) -> None:
        """Sends the releases no lookup picked up within ``release_batch_s`` of the oldest one
        (a daemon thread; under load lookups take them all first and it sends nothing)."""
        while True:
            self._flush_wake.wait()
            with self._deferred_lock:
                since = self._deferred_since
                if since is None:  # taken by a lookup meanwhile
                    self._flush_wake.clear()
                    continue
            left = since + self.config.release_batch_s - time.monotonic()
            if left > 0:
                time.sleep(left)
                continue
            try:
                self.flush_releases()
            except Exception:  # never let the flusher die: a lost release only waits for expiry
                log.exception("sending deferred lease releases failed")

    def _take_deferred(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Take the deferred releases, grouped by meta shard: shard -> (words, rows)."""
        with self._deferred_lock:
            pending, self._deferred = self._deferred, []
            self._deferred_since = None
        if not pending:
            return {}
        words = np.concatenate([w for w, _ in pending]) if len(pending) > 1 else pending[0][0]
        rows = np.concatenate([r for _, r in pending]) if len(pending) > 1 else pending[0][1]
        return {
            shard: (words[positions], rows[positions])
            for shard, positions in self._by_meta_words(words).items()
        }

    def _release_words(self, words: np.ndarray, rows: np.ndarray, wait: bool) -> None:
        tickets = {
            self._fanout.submit(
                meta_target(shard), MetaShardCalls.release, words[positions], rows[positions]
            ): shard
            for shard, positions in self._by_meta_words(words).items()
        }
        if wait:
            self._gather(tickets, self.config.call_timeout_s)


def _by_node(placements: np.ndarray, k: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Each node of ``placements`` ((n, width), -1 = no node) -> the rows and shard indices it
    holds: data shards (index < ``k``) first, then parity, rows ascending in each; a few array
    passes a node instead of a Python step a shard. A node appends a put in this order, so the
    data shards an engine reads of a batch lie end to end in its segment file and go out in
    one send (``readserver``), not one per block with parity records between them."""
    out = {}
    for node in np.unique(placements[placements >= 0]).tolist():
        rows, indices = np.nonzero(placements == node)
        order = np.argsort(indices >= k, kind="stable")
        out[int(node)] = (rows[order], indices[order])
    return out


def _rank(by_node: dict[int, tuple[np.ndarray, np.ndarray]], count: int, width: int) -> np.ndarray:
    """The row of each shard of a batch in its ``encode_rows`` array: each node's shards end
    to end in ``_by_node``'s order, node after node, then the shards placed on no node."""
    rank = np.full((count, width), -1, np.int64)
    at = 0
    for slots, indices in by_node.values():
        rank[slots, indices] = np.arange(at, at + slots.size)
        at += slots.size
    rank[rank < 0] = np.arange(at, count * width)
    return rank


def _shards_of(
    rows: np.ndarray | None,
    stripes: list[list[np.ndarray]] | None,
    rank: np.ndarray,
    positions: np.ndarray,
    indices: np.ndarray,
) -> np.ndarray | list[np.ndarray]:
    """A node's shards of a put (shard ``indices[j]`` of block ``positions[j]``): the slice of
    the batch's rows they were ranked into, or a copy of them where a retry placed them anew;
    without one array (blocks of several sizes), the stripes' rows, stacked where they can."""
    if rows is None:
        assert stripes is not None
        shards = [stripes[p][i] for p, i in zip(positions.tolist(), indices.tolist(), strict=True)]
        return np.stack(shards) if len({shard.size for shard in shards}) == 1 else shards
    at = rank[positions, indices]
    if bool((np.diff(at) == 1).all()):  # rows end to end: a view
        return rows[int(at[0]) : int(at[-1]) + 1]
    return rows[at]


def _acks(outcome: Any, count: int) -> np.ndarray:
    """A node's answer to a call about ``count`` shards, one bool each."""
    acks = np.asarray(outcome, bool)
    if acks.shape != (count,):
        raise ValueError(f"a node answered {acks.shape} for {count} shards")
    return acks


def _flat(payload: object) -> memoryview:
    if isinstance(payload, np.ndarray):
        return memoryview(np.ascontiguousarray(payload).reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    return memoryview(payload).cast("B")  # type: ignore[arg-type]


@dataclass
class _Lookups:
    """One round of ``lookups`` in flight: the requests' keys, their groups by traffic class
    (request indices, their keys end to end) and each call's (group, positions in it)."""

    words: list[np.ndarray]
    groups: list[tuple[list[int], np.ndarray]] = field(default_factory=list)
    tickets: dict[Ticket[tuple[Any, ...]], tuple[int, np.ndarray]] = field(default_factory=dict)
    #: The nodes the lookups were told are down, and those the shards answered are.
    down: set[int] = field(default_factory=set)
