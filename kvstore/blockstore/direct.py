"""``DirectReader``: an engine reads its lease's blocks straight from the storage nodes, into
its own buffer.

The gateway path relays every byte (node → gateway → gRPC → engine, ~7 copies). Here the
engine's fetcher asks each node's engine read socket (``readserver``) for the shards the lease's
read capability names there (``capability``), and the shard bytes land where the block goes:
the reply of a node is received with ``recvmsg_into`` straight into the caller's buffer, each
data shard's fragment at its place in its block, its 64-byte header into a small table beside
(no ``bytes`` per block or shard). Importable without Ray or any server module.

**Checks.** The common case needs no decode: with every data shard of a block served at the
length its size implies, the block is the fragments end to end. It counts only once every one
of its k headers names this block, its stripe position, this geometry and this size, all carry
one payload hash, and the block hashes to it (xxh3-64, the tier's one payload hash: as
``reads.BlockReads._concatenate``, one hash of the block instead of k shard checksums). Anything
else (a node down or refusing, a shard missing, short, damaged or of another write) sends the
block to the careful path: every shard of it is read into an array of its own, each checked
whole (``check_shard``: checksum, key, position, geometry, size), the shards grouped by write,
and the block decoded from parity through the codec (ISA-L) into its place, then hashed against
its write's payload hash. A block that cannot be assembled that way is a miss (False): its
bytes in the buffer are undefined, never handed out as a block.

Failures never escape: a node that cannot be reached, times out or answers what is not a reply
loses its connection and counts as holding nothing this read. Not thread-safe: one reader per
thread (each keeps one connection per node).
"""

from __future__ import annotations

import socket
import ssl
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xxhash

from kvstore.blockstore import readproto as proto
from kvstore.blockstore.capability import ReadCapability
from kvstore.blockstore.records import BlockLocation
from kvstore.ec.codec import Codec
from kvstore.ec.shard import (
    HEADER_BYTES,
    MAGIC,
    VERSION,
    check_shard,
    fragment_length,
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


class _ProtocolError(Exception):
    """A node answered what is not a reply to the request: drop its connection."""


class _Connection:
    """One socket to a node's engine read socket (TLS where set); every operation bounded by
    the read's deadline."""

    def __init__(self, endpoint: ReadEndpoint, tls: ClientTLS | None, deadline: float) -> None:
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
        self._sock = sock
        self._scatter = not isinstance(sock, ssl.SSLSocket)  # TLS has no recvmsg_into

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
        """Fill ``pieces`` in order from the stream: scatter-gather, a batch per call."""
        if not self._scatter:
            for piece in pieces:
                self.recv_into(piece, deadline)
            return
        at = 0
        while at < len(pieces):
            self._until(deadline)
            got = self._sock.recvmsg_into(pieces[at : at + _MAX_PIECES])[0]
            if not got:
                raise EOFError("engine reads: the node closed the connection")
            while at < len(pieces) and got >= len(pieces[at]):
                got -= len(pieces[at])
                at += 1
            if got:
                pieces[at] = pieces[at][got:]

    def close(self) -> None:
        self._sock.close()


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

    def read_into(
        self,
        capability: ReadCapability,
        blocks: Sequence[BlockLocation],
        out: Any,
        offsets: Sequence[int] | None = None,
    ) -> list[bool]:
        """Read ``blocks`` (their keys, shard placements and sizes, as the lease has them)
        into the writable buffer ``out``, block i at ``offsets[i]`` (default: end to end);
        True per block whose bytes there are the block's, False for a miss."""
        view = memoryview(out).cast("B")
        if view.readonly:
            raise ValueError("out: must be a writable buffer")
        sizes = [block.size for block in blocks]
        if offsets is None:
            offsets = np.concatenate(([0], np.cumsum(sizes[:-1], dtype=np.int64))).tolist()
        if len(offsets) != len(blocks):
            raise ValueError(f"offsets: {len(offsets)} for {len(blocks)} blocks")
        if blocks and max(o + s for o, s in zip(offsets, sizes, strict=True)) > len(view):
            raise ValueError(f"out: {len(view)} bytes do not hold the blocks at their offsets")
        deadline = time.monotonic() + self._timeout
        parts: dict[int, bytes] = {}
        ok = self._fast(capability, blocks, view, offsets, deadline, parts)
        careful = [b for b, good in enumerate(ok) if not good]
        if careful:
            for b, good in self._careful(
                capability, blocks, careful, view, offsets, deadline, parts
            ).items():
                ok[b] = good
        self.counters["blocks"] += len(blocks)
        self.counters["misses"] += ok.count(False)
        return ok

    # --- the common case: data shards into place ------------------------------------------------

    def _fast(
        self,
        capability: ReadCapability,
        blocks: Sequence[BlockLocation],
        view: memoryview,
        offsets: Sequence[int],
        deadline: float,
        parts: dict[int, bytes],
    ) -> list[bool]:
        k = self.k
        n = len(blocks)
        heads = np.zeros((n, k, HEADER_BYTES), np.uint8)
        head_view = memoryview(heads).cast("B")  # type: ignore[arg-type]
        have = np.zeros((n, k), bool)
        asks: dict[int, list[tuple[int, int]]] = {}
        for b, block in enumerate(blocks):
            for index in range(k):
                node = block.placement[index] if index < len(block.placement) else -1
                if node >= 0 and node in self.endpoints:
                    asks.setdefault(node, []).append((b, index))
        scratch = memoryview(bytearray(1))

        def sink(b: int, index: int, length: int) -> tuple[list[memoryview], bool]:
            nonlocal scratch
            size = blocks[b].size
            fragment = fragment_length(size, k)
            if length != HEADER_BYTES + fragment:
                if len(scratch) < length:
                    scratch = memoryview(bytearray(length))
                return [scratch[:length]], False  # not this block's shard: into nothing
            at = (b * k + index) * HEADER_BYTES
            begin = index * fragment
            take = max(0, min(fragment, size - begin))
            pieces = [head_view[at : at + HEADER_BYTES]]
            if take:
                start = offsets[b] + begin
                pieces.append(view[start : start + take])
            if fragment - take:
                if len(scratch) < fragment - take:
                    scratch = memoryview(bytearray(fragment))
                pieces.append(scratch[: fragment - take])  # the last fragment's padding
            return pieces, True

        keys = [bytes(block.key) for block in blocks]
        for b, index in self._exchange(capability, asks, keys, sink, deadline, parts):
            have[b, index] = True
        good = have.all(axis=1)
        if not good.any():
            return [False] * n
        key_table = np.frombuffer(b"".join(keys), np.uint8).reshape(n, 32)
        sizes = np.array([block.size for block in blocks], np.uint64)
        good &= (heads[:, :, 8:12] == np.frombuffer(MAGIC, np.uint8)).all(axis=2).all(axis=1)
        good &= (heads[:, :, 12] == np.arange(k, dtype=np.uint8)).all(axis=1)
        good &= (heads[:, :, 13] == VERSION).all(axis=1)
        good &= (heads[:, :, 14] == k).all(axis=1) & (heads[:, :, 15] == self.m).all(axis=1)
        lengths = np.ascontiguousarray(heads[:, :, 16:24]).view("<u8")[:, :, 0]
        good &= (lengths == sizes[:, None]).all(axis=1)
        good &= (heads[:, :, 32:64] == key_table[:, None, :]).all(axis=2).all(axis=1)
        good &= (heads[:, :, 24:32] == heads[:, :1, 24:32]).all(axis=2).all(axis=1)
        ok = [False] * n
        for b in np.flatnonzero(good).tolist():
            start = offsets[b]
            placed = view[start : start + blocks[b].size]
            if xxhash.xxh3_64_digest(placed) == heads[b, 0, 24:32].tobytes():
                ok[b] = True
        self.counters["fast_blocks"] += ok.count(True)
        return ok

    # --- the careful path: every shard, checked, decoded ----------------------------------------

    def _careful(
        self,
        capability: ReadCapability,
        blocks: Sequence[BlockLocation],
        chosen: list[int],
        view: memoryview,
        offsets: Sequence[int],
        deadline: float,
        parts: dict[int, bytes],
    ) -> dict[int, bool]:
        width = self.k + self.m
        stripes: dict[int, list[np.ndarray | None]] = {b: [None] * width for b in chosen}
        asks: dict[int, list[tuple[int, int]]] = {}
        for b in chosen:
            for index, node in enumerate(blocks[b].placement[:width]):
                if node >= 0 and node in self.endpoints:
                    asks.setdefault(node, []).append((b, index))

        landing: dict[tuple[int, int], np.ndarray] = {}

        def sink(b: int, index: int, length: int) -> tuple[list[memoryview], bool]:
            shard = landing[b, index] = np.empty(length, np.uint8)
            return [memoryview(shard)], True  # type: ignore[arg-type]

        keys = [bytes(block.key) for block in blocks]
        for b, index in self._exchange(capability, asks, keys, sink, deadline, parts):
            stripes[b][index] = landing[b, index]
        out: dict[int, bool] = {}
        for b in chosen:
            block = blocks[b]
            target = view[offsets[b] : offsets[b] + block.size]
            out[b] = self._decode(block, stripes[b], target)
        self.counters["decoded_blocks"] += sum(out.values())
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
        capability: ReadCapability,
        asks: dict[int, list[tuple[int, int]]],
        block_keys: list[bytes],
        sink: Any,
        deadline: float,
        parts: dict[int, bytes],
    ) -> list[tuple[int, int]]:
        """Ask each node of ``asks`` for its shards (block position, stripe index; the block's
        key is ``block_keys[position]``), at most ``MAX_SHARDS_PER_REQUEST`` a request and one
        request in flight per connection. Each served shard is received into the buffers
        ``sink(block, index, length)`` answers (with whether it takes the shard); returns the
        (block, index) taken from replies received whole: a reply cut short counts for
        nothing, whatever part of it landed."""
        size = proto.MAX_SHARDS_PER_REQUEST
        chunks = {
            node: [items[i : i + size] for i in range(0, len(items), size)]
            for node, items in asks.items()
        }
        taken: list[tuple[int, int]] = []
        while chunks:
            sent: dict[int, tuple[list[tuple[int, int]], bytes, bool]] = {}
            for node in list(chunks):
                items = chunks[node].pop(0)
                if not chunks[node]:
                    del chunks[node]
                part = parts.get(node)
                if part is None:
                    part = parts[node] = capability.for_node(node).encode()
                request = _request(part, [block_keys[b] for b, _ in items])
                reused = self._send(node, request, deadline)
                if reused is None:
                    chunks.pop(node, None)
                    continue
                sent[node] = (items, request, reused)
            for node, (items, request, reused) in sent.items():
                try:
                    taken += self._receive(node, items, sink, deadline)
                    continue
                except (OSError, EOFError, _ProtocolError):
                    self._lost(node)
                if reused and self._send(node, request, deadline, redial=True) is not None:
                    try:  # the pooled connection had gone stale (the node's idle bound)
                        taken += self._receive(node, items, sink, deadline)
                        continue
                    except (OSError, EOFError, _ProtocolError):
                        self._lost(node)
                chunks.pop(node, None)
        return taken

    def _send(
        self, node: int, request: bytes, deadline: float, redial: bool = False
    ) -> bool | None:
        """Send ``request`` to ``node``: True on a pooled connection (it may have gone stale:
        a failure is worth one retry on a fresh one), False on a fresh one, None: failed."""
        conn = self._conns.get(node)
        reused = conn is not None and not redial
        try:
            if conn is None or redial:
                conn = self._conns[node] = _Connection(self.endpoints[node], self._tls, deadline)
            conn.send(request, deadline)
            return reused
        except (OSError, EOFError):
            self._lost(node)
            if reused:
                return self._send(node, request, deadline, redial=True)
            return None

    def _receive(
        self, node: int, items: list[tuple[int, int]], sink: Any, deadline: float
    ) -> list[tuple[int, int]]:
        conn = self._conns[node]
        head = bytearray(_LENGTH_BYTES + proto.REPLY.size)
        conn.recv_into(memoryview(head), deadline)
        frame = int.from_bytes(head[:_LENGTH_BYTES], "big")
        magic, refusal, count, data_bytes = proto.REPLY.unpack_from(head, _LENGTH_BYTES)
        table_size = proto.table_bytes(count)
        if magic != proto.REPLY_MAGIC or count != len(items):
            raise _ProtocolError(f"node {node}: not a reply to {len(items)} keys")
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
        pieces: list[memoryview] = []
        taken: list[tuple[int, int]] = []
        for j in np.flatnonzero(served).tolist():
            b, index = items[j]
            into, takes = sink(b, index, int(lengths[j]))
            pieces.extend(into)
            if takes:
                taken.append((b, index))
        conn.recv_pieces([piece for piece in pieces if len(piece)], deadline)
        self.counters["shards_served"] += int(served.sum())
        self.counters["bytes_received"] += data_bytes
        return taken

    def _lost(self, node: int) -> None:
        """A node that failed this read: its connection is dropped (a late reply must not
        reach the next request), the next read dials it again."""
        self.counters["node_failures"] += 1
        conn = self._conns.pop(node, None)
        if conn is not None:
            conn.close()


def _request(part: bytes, keys: list[bytes]) -> bytes:
    """One read request frame: this node's part of the capability and the keys asked."""
    head = proto.REQUEST.pack(
        proto.REQUEST_MAGIC, proto.OP_READ, proto.VERSION, 0, len(part), len(keys)
    )
    body = b"".join([head, part, *keys])
    return len(body).to_bytes(_LENGTH_BYTES, "big") + body
