"""``DirectReader``: an engine reads its lease's blocks straight from the storage nodes, into
its own buffer.

The gateway path relays every byte (node → gateway → gRPC → engine, ~7 copies). Here the
engine's fetcher asks each node's engine read socket (``readserver``) for the shards the lease's
read capability names there (``capability``), and the shard bytes land where the block goes:
the reply of a node is received with ``recvmsg_into`` straight into the caller's buffer, each
data shard's fragment at its place in its block (or cut at the layer boundaries it crosses, for
a layer-major staging region: ``Spread``), its 64-byte header into a small table beside (no
``bytes`` per block or shard). Importable without Ray or any server module.

**Order.** Every request goes out at once (a node answers its requests in order, serving the
next while the reader takes the last). A reader that hands bytes on as they arrive
(``on_prefix``) asks for the data shards stripe position by position: position 0 of every
block first, then 1, ...; so each block's first bytes (a layer-major load's first layers) are
in place and checked while the rest is still on the wire.

**Checks.** The common case needs no decode: with every data shard of a block served at the
length its size implies, the block is the fragments end to end. A shard counts once its header
names this block, its stripe position, this geometry, this size and the write of the block's
shard 0 (one payload hash), and its checksum (xxh3-64 over header and fragment, ``ec.shard``)
holds: each byte is hashed once, as it would be by one hash of the block, and a block's first
shards are known good before its last ones arrive. Anything else (a node down or refusing, a
shard missing, short, damaged or of another write) sends the block to the careful path: every
shard of it is read into an array of its own, each checked whole (``check_shard``: checksum,
key, position, geometry, size), the shards grouped by write, and the block decoded from parity
through the codec (ISA-L) into its place, then hashed against its write's payload hash. A block
that cannot be assembled that way is a miss (False): its bytes in the buffer are undefined,
never handed out as a block. Once the caller has handed bytes on, a block that fails is a miss
at once: decoding it into place would rewrite bytes that may be in use.

Failures never escape: a node that cannot be reached, times out or answers what is not a reply
loses its connection and counts as holding nothing this read. Not thread-safe: one reader per
thread (each keeps one connection per node).
"""

from __future__ import annotations

import bisect
import itertools
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from kvstore.blockstore import readproto as proto
from kvstore.blockstore.capability import ReadCapability
from kvstore.blockstore.records import BlockLocation
from kvstore.ec.codec import Codec
from kvstore.ec.shard import (
    CHECKED_FROM,
    FRAGMENT_ALIGN,
    HEADER_BYTES,
    MAGIC,
    VERSION,
    check_shard,
    payload_hash,
    writes_by_payload,
)
from kvstore.errors import ECError
from kvstore.fastcall.tls import ClientTLS, client_context, tls_handshake

#: Buffers one ``recvmsg_into`` fills at the most (IOV_MAX is 1024 on Linux).
_MAX_PIECES = 512
_LENGTH_BYTES = 4

#: (host, port) of a node's engine read socket.
ReadEndpoint = tuple[str, int]


@dataclass(frozen=True)
class Spread:
    """Where a read's blocks land when not end to end: each block is cut into ``segments``
    ``(offset in the block, bytes, where row 0's piece goes)``, which tile the block from byte
    0, and block i's piece of a segment goes ``rows[i]`` pieces further on. A load's staging
    region is one segment per layer (that layer's slice of every block, block after block:
    ``kvstore.engine.staging``), so the shards land layer-major with no copy after them."""

    segments: tuple[tuple[int, int, int], ...]
    rows: tuple[int, ...]

    @property
    def block_bytes(self) -> int:
        return sum(length for _, length, _ in self.segments)

    def check(self, sizes: np.ndarray, room: int) -> None:
        """Raise ``ValueError`` unless every block fits the segments and no two pieces of the
        read overlap or leave ``room`` bytes."""
        if len(self.rows) != len(sizes):
            raise ValueError(f"spread: {len(self.rows)} rows for {len(sizes)} blocks")
        at = 0
        for offset, length, base in self.segments:
            if offset != at or length <= 0 or base < 0:
                raise ValueError("spread: segments must tile the block from byte 0, in order")
            at += length
        if (sizes != at).any():
            raise ValueError(f"spread: every block must be {at} bytes")
        rows = np.asarray(self.rows, np.int64)
        if rows.size and (rows.min() < 0 or np.unique(rows).size != rows.size):
            raise ValueError("spread: rows must be distinct and >= 0")
        top = int(rows.max(initial=-1)) + 1
        spans = sorted((base, base + top * length) for _, length, base in self.segments)
        if spans and spans[-1][1] > room:
            raise ValueError(f"out: {room} bytes do not hold the blocks where they go")
        if any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False)):
            raise ValueError("spread: two segments overlap (one would overwrite the other)")

    def pieces(self, view: memoryview, row: int, begin: int, nbytes: int) -> list[memoryview]:
        """Where bytes ``begin`` .. ``begin + nbytes`` of the block at ``row`` go, in order."""
        out = []
        end = begin + nbytes
        for offset, length, base in self.segments:
            lo, hi = max(begin, offset), min(end, offset + length)
            if lo < hi:
                at = base + row * length + lo - offset
                out.append(view[at : at + hi - lo])
        return out


class _ProtocolError(Exception):
    """A node answered what is not a reply to the request: drop its connection."""


class _Connection:
    """One socket to a node's engine read socket (TLS where set); every operation bounded by
    the read's deadline."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._scatter = not isinstance(sock, ssl.SSLSocket)  # TLS has no recvmsg_into

    @classmethod
    def dial(cls, endpoint: ReadEndpoint, tls: ClientTLS | None, deadline: float) -> _Connection:
        host, port = endpoint
        sock = socket.create_connection(
            (host, port), timeout=max(0.001, deadline - time.monotonic())
        )
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                sock = client_context(tls).wrap_socket(
                    sock, server_hostname=tls.server_name, do_handshake_on_connect=False
                )
                tls_handshake(sock, deadline)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    def _until(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("engine reads: the node took too long")
        self._sock.settimeout(left)

    def send(self, data: bytes, deadline: float) -> None:
        self._until(deadline)
        self._sock.sendall(data)

    def recv_into(self, view: memoryview, deadline: float) -> None:
        while view:
            self._until(deadline)
            got = self._sock.recv_into(view)
            if not got:
                raise EOFError("engine reads: the node closed the connection")
            view = view[got:]

    def recv_pieces(self, pieces: list[memoryview], deadline: float) -> None:
        """Fill ``pieces`` in order from the stream: scatter-gather, a batch per call (each
        call fills what the socket holds; where it stopped is found by bisection, not by
        walking the pieces)."""
        if not self._scatter:
            for piece in pieces:
                self.recv_into(piece, deadline)
            return
        ends = list(itertools.accumulate(map(len, pieces)))
        total = ends[-1] if ends else 0
        done = 0
        at = 0  # the first piece not yet full
        while done < total:
            self._until(deadline)
            got = self._sock.recvmsg_into(pieces[at : at + _MAX_PIECES])[0]
            if not got:
                raise EOFError("engine reads: the node closed the connection")
            done += got
            at = bisect.bisect_right(ends, done, at)
            if at < len(pieces) and done > ends[at] - len(pieces[at]):
                pieces[at] = pieces[at][len(pieces[at]) - (ends[at] - done) :]

    def close(self) -> None:
        self._sock.close()


@dataclass
class _Read:
    """One ``read_into``: its blocks as arrays, where each goes, and what it sends each node."""

    capability: ReadCapability
    view: memoryview
    sizes: np.ndarray  # (n,) int64
    starts: np.ndarray  # (n,) int64: where each block goes in ``view``
    placements: np.ndarray  # (n, width) int64: node per stripe index, -1: none to ask
    keys: np.ndarray  # (n, 32) uint8
    deadline: float
    spread: Spread | None = None  # else block i is end to end at ``starts[i]``
    parts: dict[int, bytes] = field(default_factory=dict)  # node -> its capability part

    def pieces(self, block: int, begin: int, nbytes: int) -> list[memoryview]:
        """Where bytes ``begin`` .. ``begin + nbytes`` of ``block`` go in ``view``."""
        if self.spread is None:
            at = int(self.starts[block]) + begin
            return [self.view[at : at + nbytes]]
        return self.spread.pieces(self.view, self.spread.rows[block], begin, nbytes)

    def part(self, node: int) -> bytes:
        encoded = self.parts.get(node)
        if encoded is None:
            encoded = self.parts[node] = self.capability.for_node(node).encode()
        return encoded


#: (block positions, stripe indices) of the shards asked of one node, in request order.
_Items = tuple[np.ndarray, np.ndarray]

#: ``on_prefix(nbytes, whole) -> handed on``: see ``DirectReader.read_into``.
OnPrefix = Callable[[int, np.ndarray], bool]


class DirectReader:
    """Reads leased blocks from the nodes at ``endpoints`` (node id → engine read socket)
    with their read capability; ``k`` + ``m``: the tier's stripe geometry. ``timeout_s``
    bounds one ``read_into`` (a node slower than that counts as down for it)."""

    def __init__(
        self,
        endpoints: Mapping[int, ReadEndpoint],
        k: int,
        m: int,
        tls: ClientTLS | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self.endpoints = dict(endpoints)
        self.k, self.m = k, m
        self._tls = tls
        self._timeout = timeout_s
        self._codec = Codec(k, m)
        self._conns: dict[int, _Connection] = {}
        self.counters: Counter[str] = Counter()

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

    def reachable(self, timeout_s: float = 1.0) -> set[int]:
        """The nodes whose engine read socket this process can open (TLS included) within
        ``timeout_s``, all dialed at once: what a fetcher asks once to choose between reading
        directly and through the gateway (a client outside the cluster's network reaches
        none, and would otherwise wait out every read's timeout)."""
        found: set[int] = set()
        deadline = time.monotonic() + timeout_s

        def dial(node: int, endpoint: ReadEndpoint) -> None:
            try:
                _Connection.dial(endpoint, self._tls, deadline).close()
            except (OSError, ValueError):
                return
            found.add(node)

        threads = [
            threading.Thread(target=dial, args=item, daemon=True) for item in self.endpoints.items()
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()) + 0.1)
        return set(found)

    def read_into(
        self,
        capability: ReadCapability,
        blocks: Sequence[BlockLocation],
        out: Any,
        offsets: Sequence[int] | None = None,
        spread: Spread | None = None,
        on_prefix: OnPrefix | None = None,
    ) -> list[bool]:
        """Read ``blocks`` (their keys, shard placements and sizes, as the lease has them)
        into the writable buffer ``out``, block i at ``offsets[i]`` (default: end to end) or
        cut up as ``spread`` says; True per block whose bytes there are the block's, False
        for a miss.

        ``on_prefix(nbytes, whole)``, with ``spread`` only: told as the read goes which
        blocks have their first ``nbytes`` bytes in place and checked (``whole``: a mask over
        ``blocks``), so a caller can hand those bytes on before the rest arrives. Once it
        answers True (it did hand some on), a block that is not whole by the end is a miss:
        its bytes may be in use, so it is never decoded into place from parity."""
        view = memoryview(out).cast("B")
        if view.readonly:
            raise ValueError("out: must be a writable buffer")
        n = len(blocks)
        sizes = np.fromiter((block.size for block in blocks), np.int64, n)
        if on_prefix is not None and spread is None:
            raise ValueError("on_prefix: needs a spread (blocks of one size)")
        if spread is not None:
            if offsets is not None:
                raise ValueError("offsets and spread: give one of them")
            spread.check(sizes, len(view))
            starts = np.zeros(n, np.int64)
        elif offsets is None:
            starts = np.zeros(n, np.int64)
            np.cumsum(sizes[:-1], out=starts[1:])
        else:
            starts = np.asarray(offsets, np.int64)
            if starts.shape != (n,):
                raise ValueError(f"offsets: {len(offsets)} for {n} blocks")
        if spread is None:
            if n and ((starts < 0).any() or int((starts + sizes).max()) > len(view)):
                raise ValueError(f"out: {len(view)} bytes do not hold the blocks at their offsets")
            order = np.argsort(starts, kind="stable")
            if n > 1 and (starts[order][1:] < (starts + sizes)[order][:-1]).any():
                raise ValueError("offsets: two blocks overlap (one would overwrite the other)")
        keys = b"".join(block.key for block in blocks)
        if len(keys) != 32 * n:
            raise ValueError("blocks: every key must be 32 bytes")
        width = self.k + self.m
        placements = np.full((n, width), -1, np.int64)
        for b, block in enumerate(blocks):
            row = block.placement[:width]
            placements[b, : len(row)] = row
        placements[~np.isin(placements, list(self.endpoints))] = -1  # no socket: none to ask
        read = _Read(
            capability,
            view,
            sizes,
            starts,
            placements,
            np.frombuffer(keys, np.uint8).reshape(n, 32),
            time.monotonic() + self._timeout,
            spread,
        )
        ok, in_use = self._fast(read, on_prefix)
        careful = np.flatnonzero(~ok)
        if careful.size and not in_use:
            ok[careful] = self._careful(read, careful.tolist(), blocks)
        self.counters["blocks"] += n
        self.counters["misses"] += int(n - ok.sum())
        return ok.tolist()

    # --- the common case: data shards into place ------------------------------------------------

    def _fast(self, read: _Read, on_prefix: OnPrefix | None) -> tuple[np.ndarray, bool]:
        """Each block whose k data shards land in place and check out (see the module doc),
        and whether ``on_prefix`` put blocks' bytes to use before the read ended."""
        k = self.k
        n = len(read.sizes)
        sizes = read.sizes
        per_shard = -(-sizes // k)  # as ``fragment_length``, for every block at once
        fragments = np.maximum(FRAGMENT_ALIGN, -(per_shard // -FRAGMENT_ALIGN) * FRAGMENT_ALIGN)
        heads = np.zeros((n, k, HEADER_BYTES), np.uint8)
        head_view = memoryview(heads).cast("B")  # type: ignore[arg-type]
        scratch = [memoryview(bytearray(int(fragments.max(initial=0))))]
        zeros = memoryview(bytes(int(fragments.max(initial=0))))  # padding is zeros (``ec.shard``)
        checked = np.zeros((n, k), bool)
        in_use = False

        def place(
            bs: np.ndarray, indices: np.ndarray, lengths: np.ndarray
        ) -> tuple[list[memoryview], np.ndarray]:
            fragment = fragments[bs]
            fits = lengths == HEADER_BYTES + fragment
            begin = indices * fragment
            take = np.clip(sizes[bs] - begin, 0, fragment)
            most = int(lengths.max(initial=0))
            if most > len(scratch[0]):
                scratch[0] = memoryview(bytearray(most))
            junk = scratch[0]
            pieces: list[memoryview] = []
            add = pieces.append
            for fit, b, head, at, taken, pad, length in zip(
                fits.tolist(),
                bs.tolist(),
                ((bs * k + indices) * HEADER_BYTES).tolist(),
                begin.tolist(),
                take.tolist(),
                (fragment - take).tolist(),
                lengths.tolist(),
                strict=True,
            ):
                if not fit:  # not this block's shard: read into nothing
                    add(junk[:length])
                    continue
                add(head_view[head : head + HEADER_BYTES])
                if taken:
                    pieces += read.pieces(b, at, taken)
                if pad:  # the last fragment's padding
                    add(junk[:pad])
            return pieces, fits

        def check(bs: np.ndarray, indices: np.ndarray) -> None:
            """The shards (bs, indices) landed whole: check their headers against the block
            and the stripe, the write against the block's shard 0, and their checksums."""
            head = heads[bs, indices]
            good = (head[:, 8:12] == np.frombuffer(MAGIC, np.uint8)).all(axis=1)
            good &= (head[:, 12] == indices) & (head[:, 13] == VERSION)
            good &= (head[:, 14] == k) & (head[:, 15] == self.m)
            claimed = np.ascontiguousarray(head[:, 16:24]).view("<u8")[:, 0]
            good &= claimed == sizes[bs].astype(np.uint64)
            good &= (head[:, 32:64] == read.keys[bs]).all(axis=1)
            good &= (head[:, 24:32] == heads[bs, 0, 24:32]).all(axis=1)  # one write
            fragment = fragments[bs]
            begin = indices * fragment
            take = np.clip(sizes[bs] - begin, 0, fragment)
            for row, b, index, at, taken, pad in zip(
                np.flatnonzero(good).tolist(),
                bs[good].tolist(),
                indices[good].tolist(),
                begin[good].tolist(),
                take[good].tolist(),
                (fragment - take)[good].tolist(),
                strict=True,
            ):
                digest = xxhash.xxh3_64(heads[b, index, CHECKED_FROM:].tobytes())
                for piece in read.pieces(b, at, taken):
                    digest.update(piece)
                if pad:
                    digest.update(zeros[:pad])
                good[row] = digest.digest() == heads[b, index, :CHECKED_FROM].tobytes()
            checked[bs[good], indices[good]] = True

        def landed(index: int | None, taken: list[_Items]) -> None:
            nonlocal in_use
            for bs, indices in taken:
                check(bs, indices)
            if index is None or on_prefix is None:
                return
            whole = np.asarray(checked[:, : index + 1].all(axis=1))
            prefix = min(int(sizes.max(initial=0)), (index + 1) * int(fragments.max(initial=0)))
            in_use = bool(on_prefix(prefix, whole)) or in_use

        # With ``on_prefix`` the data shards are asked for stripe position by position (all
        # sent at once, received in order), so that every block's first bytes are in place and
        # checked before its later ones arrive; else all of them in one round.
        placements = read.placements[:, :k]
        if on_prefix is None:
            rounds = [_asks(placements)]
        else:
            rounds = [_asks(np.where(np.arange(k) == i, placements, -1)) for i in range(k)]
        self._exchange(read, rounds, place, landed if on_prefix else lambda _, t: landed(None, t))
        good = np.asarray(checked.all(axis=1))
        self.counters["fast_blocks"] += int(good.sum())
        return good, in_use

    # --- the careful path: every shard, checked, decoded ----------------------------------------

    def _careful(
        self, read: _Read, chosen: list[int], blocks: Sequence[BlockLocation]
    ) -> list[bool]:
        width = self.k + self.m
        landing: dict[tuple[int, int], np.ndarray] = {}

        def place(
            bs: np.ndarray, indices: np.ndarray, lengths: np.ndarray
        ) -> tuple[list[memoryview], np.ndarray]:
            pieces = []
            for b, index, length in zip(
                bs.tolist(), indices.tolist(), lengths.tolist(), strict=True
            ):
                shard = landing[b, index] = np.empty(length, np.uint8)
                pieces.append(memoryview(shard))  # type: ignore[arg-type]
            return pieces, np.ones(len(bs), bool)

        rows = np.array(chosen, np.int64)
        stripes: dict[int, list[np.ndarray | None]] = {b: [None] * width for b in chosen}
        for bs, indices in self._exchange(read, [_asks(read.placements[rows], rows)], place):
            for b, index in zip(bs.tolist(), indices.tolist(), strict=True):
                stripes[b][index] = landing[b, index]
        out = []
        for b in chosen:
            size = int(read.sizes[b])
            places = read.pieces(b, 0, size)
            if len(places) == 1:
                out.append(self._decode(blocks[b], stripes[b], places[0]))
                continue
            whole = np.empty(size, np.uint8)  # decoded whole, then cut up as the read says
            decoded = self._decode(blocks[b], stripes[b], memoryview(whole))  # type: ignore[arg-type]
            if decoded:
                at = 0
                for spot in places:
                    spot[:] = memoryview(whole)[at : at + len(spot)]  # type: ignore[arg-type]
                    at += len(spot)
            out.append(decoded)
        self.counters["decoded_blocks"] += sum(out)
        return out

    def _decode(
        self, block: BlockLocation, stripe: list[np.ndarray | None], target: memoryview
    ) -> bool:
        """Decode ``block`` into ``target`` from the shards of ``stripe`` that pass their own
        checks, one write at a time; True once a decode hashes to its write's hash."""
        checked: list[np.ndarray | None] = []
        for index, shard in enumerate(stripe):
            if shard is None:
                checked.append(None)
                continue
            try:
                check_shard(
                    shard, key=block.key, index=index, k=self.k, m=self.m, payload_len=block.size
                )
            except ECError:
                self.counters["corrupt_shards"] += 1
                checked.append(None)
                continue
            checked.append(shard)
        groups, _ = writes_by_payload(checked)
        for digest, members in groups:
            if len(members) < self.k:
                break
            shards = [shard if i in members else None for i, shard in enumerate(checked)]
            try:
                self._codec.decode_into(shards, target, size=block.size, key=block.key)
            except ECError:
                continue
            if payload_hash(target) == digest:
                return True
        return False

    # --- one round of requests to the nodes -----------------------------------------------------

    def _exchange(
        self,
        read: _Read,
        rounds: list[dict[int, _Items]],
        place: Any,
        after_round: Callable[[int, list[_Items]], object] | None = None,
    ) -> list[_Items]:
        """Ask each node for its shards of every round, at most ``MAX_SHARDS_PER_REQUEST`` a
        request, all requests sent at once (the node answers them in order, so it serves the
        next while this reader takes the last), then take the replies round by round,
        calling ``after_round(round, what it took)`` after each. The shards a reply serves are
        received into the buffers ``place(blocks, indices, lengths)`` answers for them, with
        which of them it takes; returns the (blocks, indices) taken from replies received
        whole: a reply cut short counts for nothing, whatever part of it landed, and a node
        that fails is asked nothing more in this exchange."""
        size = proto.MAX_SHARDS_PER_REQUEST
        queues: dict[int, list[tuple[int, _Items, bytes]]] = {}
        for number, asks in enumerate(rounds):
            for node, (bs, ix) in asks.items():
                for i in range(0, len(bs), size):
                    items = (bs[i : i + size], ix[i : i + size])
                    request = _request(
                        read.part(node), read.keys[items[0]].tobytes(), len(items[0])
                    )
                    queues.setdefault(node, []).append((number, items, request))
        fresh: dict[int, bool] = {}  # node -> nothing received yet on a pooled connection
        for node, queue in list(queues.items()):
            reused = self._send(node, b"".join(request for *_, request in queue), read.deadline)
            if reused is None:
                del queues[node]
            else:
                fresh[node] = reused
        taken: list[_Items] = []
        for number in range(len(rounds)):
            this_round: list[_Items] = []
            for node in list(queues):
                queue = queues[node]
                while queue and queue[0][0] == number:
                    got = self._take(node, queue, place, read.deadline, fresh)
                    if got is None:
                        del queues[node]
                        break
                    queue.pop(0)
                    this_round.append(got)
            taken += this_round
            if after_round is not None:
                after_round(number, this_round)
        return taken

    def _take(
        self,
        node: int,
        queue: list[tuple[int, _Items, bytes]],
        place: Any,
        deadline: float,
        fresh: dict[int, bool],
    ) -> _Items | None:
        """The reply to the first request of ``queue``; None: the node failed (its
        connection is dropped). A pooled connection that fails before its first reply had
        gone stale (the node's idle bound): it is redialed once and sent the queue again."""
        items = queue[0][1]
        try:
            got = self._receive(node, items, place, deadline)
        except (OSError, EOFError, _ProtocolError):
            self._lost(node)
            if not fresh.get(node):
                return None
            fresh[node] = False
            requests = b"".join(request for *_, request in queue)
            if self._send(node, requests, deadline, redial=True) is None:
                return None
            try:
                got = self._receive(node, items, place, deadline)
            except (OSError, EOFError, _ProtocolError):
                self._lost(node)
                return None
        fresh[node] = False
        return got

    def _send(
        self, node: int, request: bytes, deadline: float, redial: bool = False
    ) -> bool | None:
        """Send ``request`` to ``node``: True on a pooled connection (it may have gone stale:
        a failure is worth one retry on a fresh one), False on a fresh one, None: failed."""
        conn = self._conns.get(node)
        reused = conn is not None and not redial
        try:
            if conn is None or redial:
                conn = self._conns[node] = _Connection.dial(
                    self.endpoints[node], self._tls, deadline
                )
            conn.send(request, deadline)
            return reused
        except (OSError, EOFError):
            self._lost(node)
            if reused:
                return self._send(node, request, deadline, redial=True)
            return None

    def _receive(self, node: int, items: _Items, place: Any, deadline: float) -> _Items:
        conn = self._conns[node]
        bs, indices = items
        head = bytearray(_LENGTH_BYTES + proto.REPLY.size)
        conn.recv_into(memoryview(head), deadline)
        frame = int.from_bytes(head[:_LENGTH_BYTES], "big")
        magic, refusal, count, data_bytes = proto.REPLY.unpack_from(head, _LENGTH_BYTES)
        table_size = proto.table_bytes(count)
        if magic != proto.REPLY_MAGIC or count != len(bs):
            raise _ProtocolError(f"node {node}: not a reply to {len(bs)} keys")
        if frame != proto.REPLY.size + table_size + data_bytes:
            raise _ProtocolError(f"node {node}: a reply frame of {frame} bytes is inconsistent")
        table = bytearray(table_size)
        conn.recv_into(memoryview(table), deadline)
        statuses = np.frombuffer(table, np.uint8, count)
        lengths = np.frombuffer(table, "<u4", count, proto.padded(count)).astype(np.int64)
        served = statuses == proto.OK
        if int(lengths[served].sum()) != data_bytes or lengths[~served].any():
            raise _ProtocolError(f"node {node}: reply lengths do not add up")
        if refusal:
            self.counters[f"refused_{proto.NAMES.get(refusal, refusal)}"] += count
        elif not served.all():
            for status, times in Counter(statuses[~served].tolist()).items():
                self.counters[f"shards_{proto.NAMES.get(status, status)}"] += times
        bs, indices = bs[served], indices[served]
        pieces, takes = place(bs, indices, lengths[served])
        conn.recv_pieces([piece for piece in pieces if len(piece)], deadline)
        self.counters["shards_served"] += len(bs)
        self.counters["bytes_received"] += data_bytes
        return bs[takes], indices[takes]

    def _lost(self, node: int) -> None:
        """A node that failed this read: its connection is dropped (a late reply must not
        reach the next request), the next read dials it again."""
        self.counters["node_failures"] += 1
        conn = self._conns.pop(node, None)
        if conn is not None:
            conn.close()


def _asks(placements: np.ndarray, rows: np.ndarray | None = None) -> dict[int, _Items]:
    """Node -> the (block, stripe index) it holds of ``placements`` (its rows are the blocks
    ``rows``, default 0..), block by block."""
    n, width = placements.shape
    blocks = np.repeat(np.arange(n) if rows is None else rows, width)
    indices = np.tile(np.arange(width), n)
    nodes = placements.ravel()
    held = nodes >= 0
    nodes, blocks, indices = nodes[held], blocks[held], indices[held]
    order = np.argsort(nodes, kind="stable")
    nodes, blocks, indices = nodes[order], blocks[order], indices[order]
    found, first = np.unique(nodes, return_index=True)
    ends = [*first[1:].tolist(), len(nodes)]
    return {
        int(node): (blocks[a:b], indices[a:b])
        for node, a, b in zip(found.tolist(), first.tolist(), ends, strict=True)
    }


def _request(part: bytes, keys: bytes, count: int) -> bytes:
    """One read request frame: this node's part of the capability and the ``count`` keys
    asked (32 bytes each, end to end)."""
    head = proto.REQUEST.pack(
        proto.REQUEST_MAGIC, proto.OP_READ, proto.VERSION, 0, len(part), count
    )
    body = b"".join([head, part, keys])
    return len(body).to_bytes(_LENGTH_BYTES, "big") + body
