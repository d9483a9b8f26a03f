"""The read path of the block client: ``get_blocks``.

Read rule: ask the k fastest nodes holding shards of each block (data shards first, so the
common case is a plain concatenation), one call per node per batch; shards still missing after
``hedge_after_s`` (slow nodes) or at once (failed nodes) are asked of the remaining nodes. A
block is decoded from any k shards that agree on its payload hash and checked against it; a
block that cannot be is a miss. Node failures never escape as exceptions. Shards of nodes on
this machine are read from their files directly (``localread.py``) while the node holds its
liveness lock.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.blockstore.calls import MetaShardCalls, StorageNodeCalls, node_target
from kvstore.blockstore.core import ClientCore
from kvstore.blockstore.fanout import Ticket
from kvstore.blockstore.localread import LocalReadGrant, LocalShardReader
from kvstore.blockstore.node import split_files
from kvstore.blockstore.records import (
    BlockLocation,
    BlockReadOutcome,
    Lease,
)
from kvstore.blockstore.shardfile import (
    PAYLOAD_HASH,
    SHARD_FILE_HEAD_BYTES,
    data_heads_match,
    payload_hash,
    shard_view,
    writes_by_payload,
)
from kvstore.ec.shard import fragment_length
from kvstore.errors import (
    NodeUnavailable,
    StoreError,
    TooFewShards,
)
from kvstore.keys import BlockKey

#: A node slower than this multiple of the median is asked only when others cannot serve.
_SLOW_FACTOR = 2.0
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
        unknown = [p for p, loc in enumerate(locations) if loc is None]
        if unknown:
            located = self._locate([checked[p] for p in unknown], lease)
            for p, loc in zip(unknown, located, strict=True):
                locations[p] = loc
        out, degraded = self._fetch(locations)
        if known:  # a lease's placement may predate a repair: re-locate and retry misses
            stale = [p for p, payload in enumerate(out) if payload is None and checked[p] in known]
            if stale:
                fresh = self._locate([checked[p] for p in stale], lease)
                retry, retry_degraded = self._fetch(fresh)
                for p, payload, was in zip(stale, retry, retry_degraded, strict=True):
                    out[p], degraded[p] = payload, was
        self.counters["get_blocks"] += len(checked)
        self.counters["get_misses"] += sum(1 for payload in out if payload is None)
        self.counters["degraded_blocks"] += sum(degraded)
        return BlockReadOutcome(out, degraded)

    def _locate(self, keys: list[BlockKey], lease: Lease | None) -> list[BlockLocation | None]:
        out: list[BlockLocation | None] = [None] * len(keys)
        until = lease.until if lease is not None else None
        for _shard, (positions, reply) in self._meta_calls(
            keys, MetaShardCalls.locate, self.down_nodes(), None, until
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

    def _fetch(
        self, locations: Sequence[BlockLocation | None]
    ) -> tuple[list[np.ndarray | None], list[bool]]:
        """The blocks at ``locations`` (None: a miss) and whether each was degraded."""
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
        local = self._local_reader()
        out: list[np.ndarray | None] = [None] * len(locations)
        rest = list(locations)
        if local is not None:
            for position, block in self._read_local_blocks(locations, slots, local, down).items():
                out[position] = block
                rest[position] = None
        if any(location is not None for location in rest):
            for position, read in enumerate(self._gather_shards(rest, slots, local, down)):
                if rest[position] is not None:
                    out[position] = read
        arena.flags.writeable = False  # so no view of it can be made writeable again
        # ``down`` now holds every node seen down during this read, too.
        degraded = [
            payload is not None
            and location is not None
            and any(node < 0 or node in down for node in location.placement[: self._k])
            for payload, location in zip(out, locations, strict=True)
        ]
        return out, degraded

    def _read_local_blocks(
        self,
        locations: Sequence[BlockLocation | None],
        slots: list[np.ndarray | None],
        local: LocalShardReader,
        down: set[int],
    ) -> dict[int, np.ndarray]:
        """Fast path of the fast path: blocks with k shards on live co-located nodes are read
        from disk with one ``preadv`` per shard, data fragments straight into their place in
        the block's slot (no copy, no per-shard objects), parity fragments (when a data shard's
        node is gone) into a staging row for ISA-L to rebuild the lost rows in place. Then
        checked: every shard's headers name this block, its stripe position and size, and one
        payload hash (vectorised), and the block hashes to that one. Blocks failing anything
        are left to the general path."""
        serving = set()
        for node in local.nodes:
            if node in down:
                continue
            if local.serving(node):
                serving.add(node)
            else:
                # Its process let go of its lock: that incarnation is gone, the node may be
                # restarting. Ask it over Ray below (which says whether it is down) and for a
                # new grant on the next read.
                self._grant_asked.pop(node, None)
        if not serving:
            return {}
        k = self._k
        by_size: dict[int, list[tuple[int, tuple[int, ...]]]] = defaultdict(list)
        for position, location in enumerate(locations):
            if location is None:
                continue
            placement = location.placement
            # Parity stands in only for data shards whose node is known down (or lost): any
            # other data node (remote, not granted yet, just restarted) is asked by the
            # general path, so node failures are seen and counted as they always were.
            if not all(node in serving or node in down or node < 0 for node in placement[:k]):
                continue
            sources = tuple(index for index, node in enumerate(placement) if node in serving)
            if len(sources) >= k or sources[:1] == (0,):
                by_size[location.size].append((position, sources[:k]))
        done: dict[int, np.ndarray] = {}
        for size, members in by_size.items():
            fragment = fragment_length(size, k)
            used = min(k, -(-size // fragment))  # data rows holding payload bytes
            data_rows = tuple(range(used))
            plain = [(p, data_rows) for p, sources in members if sources[:used] == data_rows]
            # Parity standing in for lost data rows: ISA-L rebuilds whole rows in place.
            rebuilt = [
                (p, sources)
                for p, sources in members
                if len(sources) == k and sources[:used] != data_rows and size == k * fragment
            ]
            for batch in (plain, rebuilt):
                if batch and used:
                    done.update(self._read_local_batch(locations, slots, local, batch, size))
        self.counters["local_fast_blocks"] += len(done)
        return done

    def _read_local_batch(
        self,
        locations: Sequence[BlockLocation | None],
        slots: list[np.ndarray | None],
        local: LocalShardReader,
        batch: list[tuple[int, tuple[int, ...]]],
        size: int,
    ) -> dict[int, np.ndarray]:
        """``_read_local_blocks`` for blocks of one size reading as many shards each."""
        k, m = self._k, self._width - self._k
        fragment = fragment_length(size, k)
        width = len(batch[0][1])
        heads = np.empty((len(batch), width, SHARD_FILE_HEAD_BYTES), dtype=np.uint8)
        # Each block's parity fragments (standing in for lost data rows) get staging rows.
        first_row: list[int] = []
        parity_rows = 0
        for _, sources in batch:
            first_row.append(parity_rows)
            parity_rows += sum(1 for index in sources if index >= k)
        staging = np.empty((parity_rows, fragment), dtype=np.uint8)
        read = np.zeros(len(batch), dtype=bool)
        pad = np.empty(fragment, dtype=np.uint8)  # a partial last row's padding lands here
        # (Two threads splitting the rows, the reads being system calls that let the GIL go,
        # measured no faster on a 2-core machine.)
        for row, (position, sources) in enumerate(batch):
            location, slot = locations[position], slots[position]
            assert location is not None and slot is not None
            vectors: list[list[Any]] = []
            staged = first_row[row]
            for column, index in enumerate(sources):
                if index >= k:
                    vectors.append([heads[row, column], staging[staged]])
                    staged += 1
                    continue
                begin = index * fragment
                end = min(begin + fragment, size)
                vectors.append([heads[row, column], slot[begin:end]])
                if end - begin < fragment:
                    vectors[-1].append(pad[: fragment - (end - begin)])
            nodes = [location.placement[index] for index in sources]
            read[row] = local.read_shards(
                location.key, nodes, vectors, SHARD_FILE_HEAD_BYTES + fragment
            )
        parity = [
            [staging[first_row[row] + j] for j in range(sum(1 for i in sources if i >= k))]
            for row, (_, sources) in enumerate(batch)
        ]
        keys = [locations[position].key for position, _ in batch]  # type: ignore[union-attr]
        indices = np.array([sources for _, sources in batch], dtype=np.uint8)
        good = read & data_heads_match(heads, keys, size, k, m, indices)
        done: dict[int, np.ndarray] = {}
        for row, (position, sources) in enumerate(batch):
            slot = slots[position]
            assert slot is not None
            if not good[row]:
                continue
            if parity[row] and not self._codec.rebuild_in_place(slot, sources, parity[row]):
                continue
            if payload_hash(slot) == heads[row, 0, PAYLOAD_HASH].tobytes():
                slot.flags.writeable = False
                done[position] = slot
        return done

    def _gather_shards(
        self,
        locations: Sequence[BlockLocation | None],
        slots: list[np.ndarray | None],
        local: LocalShardReader | None,
        down: set[int],
    ) -> list[np.ndarray | None]:
        """The general read: ask nodes for shards (co-located ones answer from disk), hedge,
        top up around failures, decode (into ``slots`` where the fast path applies)."""
        n = len(locations)
        files: list[list[np.ndarray | None]] = [[None] * self._width for _ in range(n)]
        asked: list[set[int]] = [set() for _ in range(n)]
        have = np.zeros(n, dtype=np.int64)
        outstanding = np.zeros(n, dtype=np.int64)
        slow = self._slow_nodes()
        calls: dict[Ticket[tuple[np.ndarray, np.ndarray]], _Call] = {}
        file_bytes = [
            0 if loc is None else SHARD_FILE_HEAD_BYTES + fragment_length(loc.size, self._k)
            for loc in locations
        ]

        # Shard files read from co-located disks go end to end into one buffer per read (one
        # per node would be a fresh mmap each, page faults and all); the blocks are copied or
        # decoded out of it before it goes.
        staging = np.empty(0, dtype=np.uint8)
        staged = 0

        def read_locally(node: int, items: list[tuple[int, int]]) -> list[tuple[int, int]]:
            """Read ``items`` of a co-located live node from its disk; returns those still to
            ask of the node itself (all of them when it cannot be read directly)."""
            nonlocal staging, staged
            assert local is not None
            keys = [locations[p].key for p, _ in items]  # type: ignore[union-attr]
            lengths = [file_bytes[p] for p, _ in items]
            if staging.size - staged < sum(lengths):  # room for every shard of every block
                staged = 0
                staging = np.empty(self._width * sum(file_bytes), dtype=np.uint8)
            reply = local.read(node, keys, lengths, staging[staged:])
            if reply is None:
                return items
            staged += reply[0].size
            missed = []
            for item, file in zip(items, _files(reply, len(items)), strict=True):
                if file is None:
                    missed.append(item)  # the node answers for it: its cache, its scrub
                    continue
                position, index = item
                outstanding[position] -= 1
                files[position][index] = file
                have[position] += 1
            self.counters["local_shard_reads"] += len(items) - len(missed)
            return missed

        def ask(wanted: dict[int, int]) -> None:
            """Ask for ``wanted[position]`` more shards of each block, one call per node
            (co-located nodes answer at once from their disk)."""
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
                if local is not None:
                    items = read_locally(node, items)
                    if not items:
                        continue
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
            payload = None
            if location is not None:
                payload = self._decode(location, files[position], slots[position])
            if payload is None and location is not None and have[position] >= self._k:
                retry.append(position)  # corrupt or mixed shards: other nodes may do better
            out.append(payload)
        if any(len(asked[p]) < self._width for p in retry):
            second = self._fetch_remaining(locations, retry, asked, files, down)
            for position, payload in second.items():
                out[position] = payload
        return out

    def _local_reader(self) -> LocalShardReader | None:
        """The direct reader of co-located nodes, after adopting the grants that arrived and
        asking one of every node without one (at most once per ``node_retry_s`` each; a reply
        is picked up by a later read, never waited for)."""
        local = self._local
        if local is None:
            return None
        with self._grant_lock:
            self._adopt_grants(local)
        return local

    def _adopt_grants(self, local: LocalShardReader) -> None:
        if self._grant_calls:
            for ticket in self._fanout.wait(list(self._grant_calls), 0.0):
                node = self._grant_calls.pop(ticket)
                try:
                    grant = self._fanout.result(ticket)
                except NodeUnavailable:
                    continue
                if isinstance(grant, LocalReadGrant) and grant.node_id == node:
                    self.counters["local_nodes_adopted"] += local.adopt(grant)
        now = time.monotonic()
        granted = set(local.nodes)
        waiting = set(self._grant_calls.values())
        for node in self._nodes:
            if node in granted or node in waiting:
                continue
            if now - self._grant_asked.get(node, -np.inf) < self.config.node_retry_s:
                continue
            self._grant_asked[node] = now
            ticket = self._fanout.submit(node_target(node), StorageNodeCalls.local_read_grant)
            self._grant_calls[ticket] = node

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

    def _decode(
        self,
        location: BlockLocation,
        files: list[np.ndarray | None],
        out: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """Decode from shards agreeing on one payload hash; verify the block against it.
        ``out``: where the fast path may build the block (``location.size`` bytes)."""
        fast = self._concatenate(location, files, out)
        if fast is not None:
            return fast
        present = [file for file in files if file is not None]
        digests = {file[PAYLOAD_HASH].tobytes() for file in present if file.size >= 32}
        if len(digests) == 1 and len(present) >= self._k:
            # The usual degraded read: one write's shards. Decode them as one group without
            # parsing k node headers; the block's hash against that digest checks it all the
            # same. Anything else (or a failure here) goes through the grouping below.
            block = self._decode_group(location, files, range(self._width), digests.pop(), out)
            if block is not None:
                return block
        groups, corrupt = writes_by_payload(files)
        self.counters["corrupt_shards"] += corrupt
        for digest, members in groups:
            if len(members) < self._k:
                break
            block = self._decode_group(location, files, members, digest, out)
            if block is not None:
                return block
        return None

    def _decode_group(
        self,
        location: BlockLocation,
        files: list[np.ndarray | None],
        members: Iterable[int],
        digest: bytes,
        out: np.ndarray | None,
    ) -> np.ndarray | None:
        """The block from the shards ``members`` of ``files`` (any k that pass the codec's
        checks), or None unless it hashes to ``digest``."""
        chosen = set(members)
        shards = [
            shard_view(file) if index in chosen and file is not None else None
            for index, file in enumerate(files)
        ]
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
        files: list[np.ndarray | None],
        out: np.ndarray | None = None,
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
        expected = SHARD_FILE_HEAD_BYTES + fragment
        digest = first[PAYLOAD_HASH].tobytes()
        if out is None:
            out = np.empty(size, dtype=np.uint8)
        start = SHARD_FILE_HEAD_BYTES
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
