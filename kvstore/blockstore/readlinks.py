"""The engine side of the nodes' engine read sockets: one connection per node, and one
exchange of read requests with every node at once (``DirectReader``'s wire).

An exchange sends every request first (a node answers its requests in order) and then takes
the replies of all nodes as their bytes arrive, over one ``poll`` of every socket, not node
after node: while the reader drains one node the others keep sending, and every block's
shards arrive in the order each node was asked for them (``DirectReader`` asks stripe position
0 of every block first when it hands bytes on as they arrive). Each reply's shard bytes are
received straight into the pieces the caller's ``place`` names (``Scatter``: on a plain socket
one C call takes all the socket holds, its ``recvmsg`` iovecs built from the pieces' arrays;
TLS has no scatter receive, so piece by piece there), and the caller is told of the shards
that landed whole (``on_shards``): each as soon as its last byte is in when the exchange is
paced, else as its reply ends. Unpaced, on plain sockets, the replies the caller planned
(``Usual``: every shard served whole, so where each byte goes is known before the requests
leave) are taken in one C call for all nodes (``_recvpieces.take_replies``): one poll loop,
each head checked as soon as it is in and the status table compared with the planned one,
without the GIL and without Python per reply or wake-up; a reply that turns out otherwise
goes on here from its table.

Failures never escape: a node that cannot be reached, times out or answers what is not a reply
loses its connection and is asked nothing more in this exchange; what it sent whole before
that still counts. A pooled connection that fails before its first reply had gone stale (the
node's idle bound): it is dialed again once and sent its requests again.
A node that failed an exchange rests (``noderests``): reads leave it out for a while. One far
behind the others, once they are all in, is given up on for the read (``noderests.Stragglers``)
where the caller says how many nodes it can do without: its blocks are decoded around it.
"""

from __future__ import annotations

import math
import select
import socket
import ssl
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from kvstore.blockstore import readproto as proto
from kvstore.blockstore.noderests import NodeRests, Stragglers
from kvstore.fastcall.tls import ClientTLS, client_context, tls_handshake

_pieces: ModuleType | None
try:  # the receive's iovec built in C; without a compiler at install, ``Scatter``'s views serve
    from kvstore.blockstore import _recvpieces as _pieces
except ImportError:  # pragma: no cover - the CI machine builds it
    _pieces = None

#: Bound of a resting node's background dial (what a loaded node's TLS handshake may take).
_CHECK_S = 2.0
#: Buffers one ``recvmsg_into`` fills at the most (IOV_MAX is 1024 on Linux).
_MAX_PIECES = 512
#: Buffers a ``Scatter``'s pieces may lie in (the C receive's limit).
MAX_BUFFERS = 8
_LENGTH_BYTES = 4
_HEAD_BYTES = _LENGTH_BYTES + proto.REPLY.size
#: A served shard's status byte in a reply's table.
_OK = bytes([proto.OK])

#: (host, port) of a node's engine read socket.
ReadEndpoint = tuple[str, int]

#: (block positions, stripe indices) of shards, in the order they were asked.
Items = tuple[np.ndarray, np.ndarray]

#: ``place(blocks, indices, lengths, prefix) -> (pieces, taken)``: where the served shards'
#: bytes go, in order, each after ``prefix`` bytes to skip (``readproto``), and which of them
#: the caller takes (the others land in scratch).
Place = Callable[[np.ndarray, np.ndarray, np.ndarray, int], tuple["Scatter", np.ndarray]]

#: One request to a node: the shards it asks for and its frame.
Request = tuple[Items, bytes]


class ShardCheck(NamedTuple):
    """What ``take_replies`` checks each row of a ``Usual`` against as it lands, where each
    row is a shard (its header ends its first piece, its last piece is its padding) and the
    xxhash extension has xxh3: its header names its block (the block's size and key) and
    stripe position, and the geometry; its checksum holds. ``sums[cells[r]]`` is set to 1 where
    all hold, 2 where not (left 0: not checked)."""

    cells: np.ndarray  # per row: block x k + stripe index
    sums: np.ndarray  # (blocks x k) uint8
    sizes: np.ndarray  # per block: its bytes
    keys: np.ndarray  # per block: its 32-byte key
    k: int
    m: int
    magic: bytes
    version: int


@dataclass
class Usual:
    """Where the bytes of a read's usual replies go (each reply serves every shard it was asked
    whole), worked out before the requests leave, so the replies of all nodes can be taken in
    one C call (``take_replies``) without Python per reply or wake-up. Row r of ``which``,
    ``offsets`` and ``lengths`` (``columns`` pieces each, row-major, into ``buffers``, as a
    ``Scatter`` names them) is the r-th shard asked over all requests; its first piece takes
    the reply's prefix before its own ``first_bytes`` bytes at ``first_at[r]``. ``requests``:
    per request, by the id of its blocks array, (that array, its first row, the row after its
    last, the status and length table of its usual reply, its shard bytes without prefixes).
    ``check``: None, or each row is a shard checked as it lands (``ShardCheck``)."""

    buffers: tuple[Any, ...]
    which: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    columns: int
    first_at: np.ndarray
    first_bytes: int
    requests: dict[int, tuple[np.ndarray, int, int, bytes, int]]
    check: ShardCheck | None = None

    def expected(self, request: Request) -> tuple[int, int, bytes, int] | None:
        """The rows, table and shard bytes of ``request``'s usual reply (None: not planned)."""
        (bs, _), _ = request
        found = self.requests.get(id(bs))
        if found is None or found[0] is not bs:
            return None
        return found[1:]


#: ``take_replies``' state row of a reply: its phase (below), whether it failed, the errno (0:
#: the end of the stream), bytes received, the piece to fill next and its bytes filled, the
#: next row to check.
_PHASE, _FAILED, _ERRNO, _RECEIVED, _FIRST, _SKIP, _CHECKED, _FIELDS = range(8)
_IN_HEAD, _IN_DATA, _DONE, _OTHER = range(4)


class ProtocolError(Exception):
    """A node answered what is not a reply to the request: drop its connection."""


class Scatter:
    """Pieces of a few buffers filled in order from a stream, as much as the socket holds per
    call. Piece ``p`` is ``buffers[which[p]][offsets[p]:][:lengths[p]]``: arrays, not a Python
    object a piece, so a reply of a thousand pieces costs a few array passes; one C call
    (``_recvpieces``) receives until the socket is drained, each ``recvmsg``'s iovec built from
    them, and says where the next byte goes. On TLS, a socket with a timeout or without the
    extension, memoryviews of the next pieces serve (``recvmsg_into``), one receive a call."""

    def __init__(
        self,
        buffers: Sequence[Any],
        which: np.ndarray,
        offsets: np.ndarray,
        lengths: np.ndarray,
    ) -> None:
        """``ValueError`` for more than ``MAX_BUFFERS`` buffers. Pieces of length 0 are
        skipped (wherever they point); a receive into a piece that lies outside its buffer
        raises ``ValueError`` before any byte lands."""
        if len(buffers) > MAX_BUFFERS:
            raise ValueError(f"scatter: {len(buffers)} buffers, {MAX_BUFFERS} at the most")
        self.buffers = tuple(buffers)
        self.which = np.ascontiguousarray(which, np.int64)
        self.offsets = np.ascontiguousarray(offsets, np.int64)
        self.lengths = lengths = np.ascontiguousarray(lengths, np.int64)
        self.ends = lengths.cumsum()
        self.total = int(self.ends[-1]) if len(self.ends) else 0
        self.done = 0
        self._at = int(self.ends.searchsorted(0, "right"))  # the first piece not yet full
        self._into = 0  # bytes of it filled
        self.drained = False

    def receive(self, sock: socket.socket, most: int | None = None) -> int:
        """Receive into the next pieces, at most ``most`` bytes (default: what the socket
        holds); the bytes taken, 0 if the socket (non-blocking) had none, ``EOFError`` at the
        end of the stream. ``drained``: whether the socket held no more after it (the caller
        need not ask again until it is ready)."""
        at, into = self._at, self._into
        if _pieces is not None and not isinstance(sock, ssl.SSLSocket) and sock.gettimeout() == 0.0:
            got, self._at, self._into, self.drained = _pieces.recv_pieces(
                sock.fileno(),
                self.buffers,
                self.which,
                self.offsets,
                self.lengths,
                at,
                into,
                -1 if most is None else most,
            )
            if not got and not self.drained:
                raise EOFError("engine reads: the node closed the connection")
            self.done += got
            return got
        try:
            if isinstance(sock, ssl.SSLSocket):
                view = self._piece(at)[into:]
                asked = len(view) if most is None else min(most, len(view))
                got = sock.recv_into(view, asked)
            else:
                stop = min(len(self.lengths), at + _MAX_PIECES)
                if most is not None:  # the pieces up to ``most`` bytes, the last one cut there
                    stop = min(stop, int(self.ends.searchsorted(self.done + most, "left")) + 1)
                views = [self._piece(p) for p in range(at, stop) if self.lengths[p]]
                views[0] = views[0][into:]  # piece ``at``: never empty
                if most is not None:
                    views[-1] = views[-1][: len(views[-1]) - max(0, sum(map(len, views)) - most)]
                asked = sum(map(len, views))
                got = sock.recvmsg_into(views)[0]
        except (BlockingIOError, ssl.SSLWantReadError):
            self.drained = True
            return 0
        if not got:
            raise EOFError("engine reads: the node closed the connection")
        # A short read on TLS says nothing: a record may end there with more behind it.
        self.drained = got < asked and not isinstance(sock, ssl.SSLSocket)
        self.done += got
        at = self._at = int(self.ends.searchsorted(self.done, "right"))
        self._into = self.done - int(self.ends[at] - self.lengths[at]) if at < len(self.ends) else 0
        return got

    def _piece(self, p: int) -> memoryview:
        """Piece ``p`` as a view (the C receive checks its pieces on its own)."""
        b, at, length = int(self.which[p]), int(self.offsets[p]), int(self.lengths[p])
        buffer = memoryview(self.buffers[b]).cast("B") if 0 <= b < len(self.buffers) else None
        if buffer is None or at < 0 or length < 0 or at + length > len(buffer):
            raise ValueError(f"scatter: piece {p} lies outside its buffer")
        return buffer[at : at + length]


class _Whole:
    """One buffer filled from a stream (a reply's head or status table), as a ``Scatter`` of
    one piece without its tables."""

    def __init__(self, buffer: bytearray) -> None:
        self._view = memoryview(buffer)
        self.total = len(buffer)
        self.done = 0
        self.drained = False

    def receive(self, sock: socket.socket, most: int | None = None) -> int:
        asked = self.total - self.done
        try:
            got = sock.recv_into(self._view[self.done :])
        except (BlockingIOError, ssl.SSLWantReadError):
            self.drained = True
            return 0
        if not got:
            raise EOFError("engine reads: the node closed the connection")
        self.drained = got < asked and not isinstance(sock, ssl.SSLSocket)
        self.done += got
        return got


class Connection:
    """One socket to a node's engine read socket (TLS where set); every blocking operation
    bounded by the read's deadline."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        #: Whether the socket may be out of blocking mode (a timeout set, or polled): the
        #: exchange puts it back at its end. A request that leaves at once touches no mode.
        self.timed = True

    @classmethod
    def dial(cls, endpoint: ReadEndpoint, tls: ClientTLS | None, deadline: float) -> Connection:
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
        self.sock.settimeout(left)
        self.timed = True

    def send(self, data: bytes, deadline: float) -> None:
        sent = 0
        if not isinstance(self.sock, ssl.SSLSocket):  # TLS takes no flags
            try:  # a request fits the socket's buffer: no timeout to set and unset
                sent = self.sock.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
        if sent < len(data):
            self._until(deadline)
            self.sock.sendall(memoryview(data)[sent:])

    def close(self) -> None:
        self.sock.close()


class _Reply:
    """One node's replies being taken without blocking: the reply's head with its status and
    length table (one piece: the table's size follows from the count asked), then the shard
    bytes into the buffers ``place`` names."""

    def __init__(self, node: int, conn: Connection, requests: list[Request], fresh: bool):
        self.node, self.conn, self.requests = node, conn, requests
        #: Nothing received yet on a connection from the pool (it may have gone stale).
        self.fresh = fresh
        self._start()

    def _start(self) -> None:
        (bs, _), _ = self.requests[0]
        self._head = bytearray(_HEAD_BYTES + proto.table_bytes(len(bs)))
        self._scatter: Scatter | _Whole = _Whole(self._head)
        self._items: Items | None = None  # set once the table is in: the data phase
        self._shard_ends: np.ndarray | None = None
        self._reported = 0
        self._refusal = self._data_bytes = 0
        self._prefix = -1  # the head not checked yet

    def step(
        self, place: Place, counters: Counter[str], limit: int | None, eager: bool
    ) -> list[Items]:
        """Take what the socket holds now, up to the last shard at stripe position ``limit``
        (None: all of it); the shards whose last byte arrived, as (blocks, indices) the caller
        took: as they land if ``eager``, else when their reply ends (``landed`` tells what a
        failed reply had landed). ``EOFError``, ``OSError``, ``ProtocolError``: the node
        failed."""
        landed: list[Items] = []
        drained = False  # the socket held no more: wait for it to be ready again
        while self.requests and not drained:
            room = self._room(limit)
            if room is not None and room <= 0:
                break
            got = self._scatter.receive(self.conn.sock, room)
            if not got:
                break
            drained = self._scatter.drained
            counters["bytes_received"] += got
            self.fresh = False
            landed += self._took(place, counters, eager)
        return landed

    def resume(self, received: int, place: Place, counters: Counter[str]) -> list[Items]:
        """Go on from ``take_replies``, which stopped this reply with ``received`` bytes of its
        head and table in (not the usual reply); what ``step`` would return."""
        self._scatter.done = received
        self.fresh = False
        return self._took(place, counters, eager=False)

    def _took(self, place: Place, counters: Counter[str], eager: bool) -> list[Items]:
        """Bytes came in: the head checked once in, the table read, the shards landed (see
        ``step``); once the reply is whole, on to the next request."""
        if self._items is None:
            if self._prefix < 0 and self._scatter.done >= _HEAD_BYTES:
                self._on_head()  # a head that is not a reply's fails before its table
            if self._scatter.done < self._scatter.total:
                return []
            self._on_table(place, counters)
        whole = self._scatter.done == self._scatter.total
        landed = self.landed() if eager or whole else []
        if whole:
            self.requests.pop(0)
            if self.requests:
                self._start()
        return landed

    def _on_head(self) -> None:
        """The head is in: check it against the request."""
        count = len(self.requests[0][0][0])
        head = self._head
        frame = int.from_bytes(head[:_LENGTH_BYTES], "big")
        magic, refusal, prefix, asked, data_bytes = proto.REPLY.unpack_from(head, _LENGTH_BYTES)
        if magic != proto.REPLY_MAGIC or asked != count or prefix > proto.MAX_PREFIX:
            raise ProtocolError(f"node {self.node}: not a reply to {count} keys")
        if frame != len(head) - _LENGTH_BYTES + data_bytes:
            raise ProtocolError(f"node {self.node}: a reply frame of {frame} bytes is inconsistent")
        self._refusal, self._prefix, self._data_bytes = refusal, prefix, data_bytes

    def _on_table(self, place: Place, counters: Counter[str]) -> None:
        """The head and table are in: receive the shard bytes where ``place`` says."""
        (bs, indices), _ = self.requests[0]
        count = len(bs)
        head = self._head
        refusal, prefix, data_bytes = self._refusal, self._prefix, self._data_bytes
        lengths = np.frombuffer(head, "<u4", count, _HEAD_BYTES + proto.padded(count))
        lengths = lengths.astype(np.int64)
        if head.count(_OK, _HEAD_BYTES, _HEAD_BYTES + count) == count:  # all served: the usual
            if int(lengths.sum()) + prefix * count != data_bytes:
                raise ProtocolError(f"node {self.node}: reply lengths do not add up")
        else:
            statuses = np.frombuffer(head, np.uint8, count, _HEAD_BYTES)
            served = statuses == proto.OK
            if (
                int(lengths[served].sum()) + prefix * int(served.sum()) != data_bytes
                or lengths[~served].any()
            ):
                raise ProtocolError(f"node {self.node}: reply lengths do not add up")
            if refusal:
                counters[f"refused_{proto.NAMES.get(refusal, refusal)}"] += count
            else:
                for status, times in Counter(statuses[~served].tolist()).items():
                    counters[f"shards_{proto.NAMES.get(status, status)}"] += times
            bs, indices, lengths = bs[served], indices[served], lengths[served]
        # With every shard served, ``place`` gets the request's own arrays (it may know them).
        self._scatter, taken = place(bs, indices, lengths, prefix)
        counters["shards_served"] += len(bs)
        self._items = (bs, indices)
        self._taken = None if taken.all() else taken  # None: every shard
        self._sizes = lengths + prefix  # each shard's bytes in the stream

    def _room(self, limit: int | None) -> int | None:
        """Shard bytes of this reply up to its last shard at stripe position ``limit`` not
        taken yet (None: no limit, or not in the shard bytes yet). The shards come in
        position order (``exchange``'s ``pace``)."""
        if limit is None or self._items is None:
            return None
        upto = int(self._items[1].searchsorted(limit, "right"))
        return (int(self._ends()[upto - 1]) if upto else 0) - self._scatter.done

    def position(self) -> int:
        """The stripe position of the next shard this node sends (``sys.maxsize``: none)."""
        if self._items is not None:
            positions = self._items[1]
            if self._reported < len(positions):
                return int(positions[self._reported])
        for (_, positions), _ in self.requests[0 if self._items is None else 1 :]:
            if len(positions):
                return int(positions[0])
        return sys.maxsize

    def _ends(self) -> np.ndarray:
        """Where each shard of this reply ends in its shard bytes (made when first asked: a
        reply told whole at its end needs none)."""
        if self._shard_ends is None:
            self._shard_ends = self._sizes.cumsum()
        return self._shard_ends

    def landed(self) -> list[Items]:
        """The shards of this reply whose last byte is in, not told before."""
        if self._items is None:
            return []
        bs, indices = self._items
        if self._scatter.done == self._scatter.total:
            whole = len(bs)
        else:
            whole = int(self._ends().searchsorted(self._scatter.done, "right"))
        if whole == self._reported:
            return []
        if self._reported == 0 and whole == len(bs) and self._taken is None:
            self._reported = whole
            return [(bs, indices)]
        span = slice(self._reported, whole)
        self._reported = whole
        if self._taken is None:
            return [(bs[span], indices[span])]
        taken = self._taken[span]
        return [(bs[span][taken], indices[span][taken])]


class NodeLinks:
    """One process's connections to the nodes at ``endpoints`` (node id → engine read socket),
    kept across exchanges. Not thread-safe."""

    def __init__(
        self, endpoints: Mapping[int, ReadEndpoint], tls: ClientTLS | None, counters: Counter[str]
    ) -> None:
        self.endpoints = dict(endpoints)
        self._tls = tls
        self._conns: dict[int, Connection] = {}
        self.counters = counters
        #: The nodes that failed an exchange (not reached, timed out, not a reply; not a stale
        #: pooled connection dialed again) since the caller last cleared it.
        self.down: set[int] = set()
        self.rests: NodeRests[Connection] = NodeRests(self._check_dial, Connection.close)

    def close(self) -> None:
        self.rests.close()
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

    def resting(self) -> set[int]:
        """The nodes to leave out of a read now (``noderests``); one back has the connection
        of its background dial pooled."""
        resting, back = self.rests.resting()
        for node, conn in back.items():
            if self._conns.setdefault(node, conn) is not conn:
                conn.close()  # asked meanwhile (more nodes resting than parity): one is pooled
            self.counters["nodes_back"] += 1
        return resting

    def _check_dial(self, node: int) -> Connection:
        return Connection.dial(self.endpoints[node], self._tls, time.monotonic() + _CHECK_S)

    def _failed(self, node: int) -> None:
        """``node`` failed this exchange: down for the read, then resting."""
        self.down.add(node)
        if self.rests.failed(node):
            self.counters["nodes_rested"] += 1

    def reachable(self, timeout_s: float = 1.0) -> set[int]:
        """The nodes whose engine read socket this process can open (TLS included) within
        ``timeout_s``, all dialed at once."""
        found: set[int] = set()
        deadline = time.monotonic() + timeout_s

        def dial(node: int, endpoint: ReadEndpoint) -> None:
            try:
                conn = Connection.dial(endpoint, self._tls, deadline)
            except (OSError, ValueError):
                return
            conn.close()
            found.add(node)

        threads = [
            threading.Thread(target=dial, args=item, daemon=True) for item in self.endpoints.items()
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()) + 0.1)
        return set(found)

    def exchange(
        self,
        requests: Mapping[int, list[Request]],
        place: Place,
        deadline: float,
        on_shards: Callable[[list[Items]], object] | None = None,
        pace: int | None = None,
        usual: Usual | None = None,
        spare: int = 0,
    ) -> list[Items]:
        """Send each node its ``requests`` and take every reply as it arrives; the shards that
        landed whole and were taken, as (blocks, indices), also told to ``on_shards``: as they
        land when paced, else as each reply ends (or fails). ``spare``: how many nodes' replies
        the caller can do without (``Stragglers``; 0: wait for all). ``pace``: with requests in
        stripe position order, a node more than ``pace`` positions ahead of the slowest one waits
        (its bytes stay in its socket and it stops sending) until that one catches up: every
        block's first shards come first, and the CPU goes to the node holding them back.
        ``usual``: where the usual replies' bytes go; unpaced on plain sockets they are taken
        in one C call, the others (and any reply that is not the usual one) here."""
        limit: int | None = None  # the last stripe position a node may send now
        replies: dict[int, _Reply] = {}
        # Pooled connections first: a node that must be dialed (and may not answer) after.
        for node in sorted(requests, key=lambda node: node not in self._conns):
            opened = self._open(node, list(requests[node]), deadline)
            if opened is not None:
                replies[node] = opened
        hedge = Stragglers(spare, len(replies), deadline)
        landed: list[Items] = []
        if usual is not None and pace is None and self._tls is None and _pieces is not None:
            landed += self._take_usual(replies, usual, place, hedge, on_shards)
        poller = select.poll()
        listening: dict[int, _Reply] = {}  # descriptor -> its reply
        waiting: set[int] = set()  # nodes ahead by more than ``pace``: not listened to

        def listen(reply: _Reply) -> None:
            reply.conn.sock.setblocking(False)
            reply.conn.timed = True
            fd = reply.conn.sock.fileno()
            listening[fd] = reply
            poller.register(fd, select.POLLIN)

        def tell(got: list[Items]) -> None:
            if got:
                landed.extend(got)
                if on_shards is not None:
                    on_shards(got)

        def forget(reply: _Reply) -> None:
            """``reply`` is over; what it landed whole counts."""
            tell(reply.landed())
            if reply.node in waiting:
                waiting.discard(reply.node)
            else:
                fd = reply.conn.sock.fileno()
                poller.unregister(fd)
                del listening[fd]
            del replies[reply.node]

        def keep_pace() -> None:
            nonlocal limit
            if pace is None or not replies:
                return
            limit = min(reply.position() for reply in replies.values()) + pace
            for node, reply in replies.items():
                ahead = reply.position() > limit
                if ahead and node not in waiting:
                    fd = reply.conn.sock.fileno()
                    poller.unregister(fd)
                    del listening[fd]
                    waiting.add(node)
                elif not ahead and node in waiting:
                    waiting.discard(node)
                    listen(reply)

        for reply in replies.values():
            listen(reply)
        keep_pace()
        while replies:
            # Paced, the nodes ahead wait for the slowest: those listened to are the ones out.
            until = hedge.until(len(listening))
            left = until - time.monotonic()
            ready = poller.poll(math.ceil(left * 1000)) if left > 0 else []
            if not ready and until < deadline:  # the stragglers' grace is over
                for reply in [listening[fd] for fd in list(listening)]:
                    self.counters["nodes_hedged"] += 1
                    forget(reply)
                    self._lost(reply.node)
                    hedge.lose()
                keep_pace()  # the nodes that waited for them go on
                continue
            if not ready:  # the deadline passed: the rest count as down for this read
                for reply in list(replies.values()):
                    forget(reply)
                    self._lost(reply.node)
                break
            for fd, _ in ready:
                found = listening.get(fd)  # None: finished or set waiting in this round
                if found is None:
                    continue
                reply = found
                try:
                    got = reply.step(place, self.counters, limit, eager=pace is not None)
                except (OSError, EOFError, ProtocolError):
                    forget(reply)
                    again = self._lost(reply.node, reply, deadline)
                    if again is not None:
                        replies[again.node] = again
                        listen(again)
                    else:
                        hedge.lose()
                    keep_pace()
                    continue
                tell(got)
                if not reply.requests:
                    self.rests.answered(reply.node)
                    forget(reply)
                keep_pace()
        for conn in self._conns.values():
            if conn.timed:
                conn.sock.setblocking(True)
                conn.timed = False
        return landed

    def _take_usual(
        self,
        replies: dict[int, _Reply],
        usual: Usual,
        place: Place,
        hedge: Stragglers,
        on_shards: Callable[[list[Items]], object] | None,
    ) -> list[Items]:
        """Take the planned replies of ``replies`` in one C call (``take_replies``); the shards
        that landed whole (also told to ``on_shards``). A reply that ends leaves ``replies``
        (a node with requests left stays, at its next one); one that failed, or was still out
        at the deadline or when ``hedge`` gave up on it, is dropped (a stale pooled
        connection, failed before its first byte, is dialed again and stays, sent its requests
        again); one that is not the usual reply stays, its head checked and its table taken
        here."""
        deadline = hedge.deadline
        taken = [
            (reply, found)
            for reply in replies.values()
            if (found := usual.expected(reply.requests[0])) is not None
        ]
        if not taken:
            return []
        state = np.zeros((len(taken), _FIELDS), np.int64)
        assert _pieces is not None
        _pieces.take_replies(
            np.array([reply.conn.sock.fileno() for reply, _ in taken], np.int64),
            tuple(reply._head for reply, _ in taken),
            tuple(table for _, (_, _, table, _) in taken),
            np.array([data for _, (_, _, _, data) in taken], np.int64),
            np.array([row for _, (lo, hi, _, _) in taken for row in (lo, hi)], np.int64),
            usual.buffers,
            usual.which,
            usual.offsets,
            usual.lengths,
            usual.columns,
            usual.first_at,
            usual.first_bytes,
            proto.MAX_PREFIX,
            deadline,
            state,
            usual.check,
            hedge.spare if len(taken) == len(replies) else 0,  # others still to come: wait
            hedge.min_s,
            hedge.factor,
        )
        landed: list[Items] = []
        rows = state.tolist()
        self.counters["bytes_received"] += sum(row[_RECEIVED] for row in rows)
        for (reply, (lo, _, _, _)), row in zip(taken, rows, strict=True):
            phase, failed, received, first = row[_PHASE], row[_FAILED], row[_RECEIVED], row[_FIRST]
            (bs, indices), _ = reply.requests[0]
            if phase == _OTHER and not failed:
                try:
                    landed += reply.resume(received, place, self.counters)
                except ProtocolError:
                    failed = 1
                else:
                    if not reply.requests:
                        del replies[reply.node]
                    continue
            whole = 0
            if phase in (_IN_DATA, _DONE):
                self.counters["shards_served"] += len(bs)
                whole = len(bs) if phase == _DONE else first // usual.columns - lo
            if whole:
                landed.append((bs[:whole], indices[:whole]))
            if phase == _DONE:
                self.counters["replies_taken_at_once"] += 1
                reply.fresh = False
                reply.requests.pop(0)
                if reply.requests:
                    reply._start()
                else:
                    self.rests.answered(reply.node)
                    del replies[reply.node]
                continue
            del replies[reply.node]  # failed, or out of time: down for this read
            if not failed and time.monotonic() < deadline:
                self.counters["nodes_hedged"] += 1  # a straggler given up on
            reply.fresh = reply.fresh and not received
            again = self._lost(reply.node, reply if failed else None, deadline)
            if again is not None:
                replies[again.node] = again
            else:
                hedge.lose()
        if landed and on_shards is not None:
            on_shards(landed)
        return landed

    def _open(self, node: int, requests: list[Request], deadline: float) -> _Reply | None:
        """Send ``node`` its requests on its pooled connection, else a new one (a failed send
        on a pooled one is worth one redial); None: it cannot be reached."""
        frames = b"".join(frame for _, frame in requests)
        conn = self._conns.get(node)
        if conn is not None:
            try:
                conn.send(frames, deadline)
                return _Reply(node, conn, requests, fresh=True)
            except OSError:
                self._drop(node)
        try:
            # Half of what is left: a node that does not answer its dial (its host cut off)
            # leaves the others time to answer theirs.
            half = deadline - (deadline - time.monotonic()) / 2
            conn = self._conns[node] = Connection.dial(self.endpoints[node], self._tls, half)
            conn.send(frames, deadline)
        except (OSError, ValueError):
            self._drop(node)
            self._failed(node)
            return None
        return _Reply(node, conn, requests, fresh=False)

    def _lost(self, node: int, reply: _Reply | None = None, deadline: float = 0.0) -> _Reply | None:
        """``node`` failed this exchange: its connection is dropped (a late reply must not
        reach the next request). A pooled connection that failed before its first byte is
        dialed again once and sent what it still owes (the new reply, or None)."""
        self._drop(node)
        if reply is None or not reply.fresh:
            self._failed(node)
            return None
        return self._open(node, reply.requests, deadline)

    def _drop(self, node: int) -> None:
        self.counters["node_failures"] += 1
        conn = self._conns.pop(node, None)
        if conn is not None:
            conn.close()
