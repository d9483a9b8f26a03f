"""``EngineReadServer``: a storage node's engine read socket, beside the actor's fastcall one.

Engines (outside the cluster's trust: they hold a tenant's token, never a node's key) read a
lease's shards here, straight from the node, with the lease's read capability
(``capability``). The socket serves exactly one operation, "read these shards with this
capability" (``readproto``); there is no put, delete or any other method on it, and a frame
naming another operation drops the peer. Each asked shard is checked against the capability
before anything is read: this node's part of it proven under the cluster read key, current, not
revoked, and naming that shard; a refused shard gets a refusal status, never a byte. The proof
(decoding the part, its MAC) is made once per connection and part: the part's bytes, presented
again on that connection, are compared with the proven ones instead; its end and revocation are
checked every request.

What makes it safe to listen, as for the fastcall socket (``kvstore.fastcall.server``):

- **No plaintext beyond loopback** (``tls.check_plaintext``): refused before anything listens
  unless the operator said insecure; TLS where the data-plane setting has it.
- **Bounded admission**: a peer holds one of the handshake slots (``admission``, shared fairly
  by source) until it presented a valid capability, within ``UNAUTHENTICATED_S`` of its accept
  (TLS included); a peer whose first request is refused is dropped. At most ``MAX_PEERS``
  connections at once; an idle one is closed after ``IDLE_S``.
- **Bounded bytes**: a request is at most ``readproto.MAX_REQUEST_BYTES`` (refused unread
  beyond), its body must arrive within ``IO_TIMEOUT_S`` and its reply be taken within it too
  (each blocking send of a sendfile reply bounded by ``SO_SNDTIMEO``); the reply bytes a
  buffered (TLS) reply holds are bounded (``Budget``): sizes are taken from the node's index
  first, the bytes read only once reserved, a request over the budget answered ``BUSY`` per
  shard. A sendfile reply holds no reply bytes in the process.

The reply goes out with as few copies and calls as the socket allows. On a plain socket each shard
is sent as its whole record, straight from its segment file (``sendfile``: page cache to socket,
never through this process), records that lie end to end (a put batch's) in one call, the reply's
head sent with ``MSG_MORE`` so that it leaves with them: one C call (``_sendrecords.c``), the GIL
released; the record header before each shard is the reply's prefix (``readproto``). Places are
found in the node's index under the actor's lock and the segment's descriptor duplicated, so the
send runs without the lock (the log is only appended to, and a duplicated descriptor keeps a
compacted segment readable). Under TLS, which encrypts in this process, or without the C
extension, the node reads the served shards end to end into one buffer (``StorageNode.get``:
one ``preadv`` each, under the lock), sent with the status table in one frame, with no prefix.
Revocations come through the actor (Ray), never through this socket.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from kvstore.blockstore import readproto as proto
from kvstore.blockstore.capability import (
    CapabilityRefused,
    NodeGrant,
    ReadCapability,
    Revocations,
    check_current,
    check_grant,
)
from kvstore.blockstore.segments import RECORD_BYTES
from kvstore.clock import Clock, SystemClock
from kvstore.fastcall.admission import HandshakeSlots, Slot
from kvstore.fastcall.budget import BUDGET_WAIT_S, Budget
from kvstore.fastcall.frames import IO_TIMEOUT_S, FastConnection
from kvstore.fastcall.server import UNAUTHENTICATED_S
from kvstore.fastcall.tls import FastcallConfig, ServerTLS, check_plaintext, tls_handshake

_sendrecords: ModuleType | None
try:
    from kvstore.blockstore import _sendrecords
except ImportError:  # pragma: no cover - the CI machine builds it
    _sendrecords = None

log = logging.getLogger(__name__)

#: Connections served at once (a thread each): engines keep one per node and fetcher process.
MAX_PEERS = 256
#: An authenticated connection with no request for this long is closed (its thread freed).
IDLE_S = 120.0
#: Reply bytes held at once: a few of the largest replies.
REPLY_BUDGET_BYTES = 256 << 20
_BACKLOG = 1024


class ShardSource(Protocol):
    """What the server reads from: the storage node (``StorageNode``)."""

    def shard_extents(
        self, keys: list[bytes]
    ) -> tuple[np.ndarray, np.ndarray, dict[int, int]] | None: ...

    def shard_sizes(self, keys: list[bytes]) -> list[int]: ...

    def get(self, keys: list[bytes]) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass
class _Reply:
    """One reply: ``parts`` (head, status table, lengths, and on the buffer path the shards'
    buffer), then on the sendfile path the records at ``places`` (segment, offset, bytes of
    each served shard) sent straight from the segment files, read through ``readers``
    (segment → descriptor, closed once sent); ``reserved``: reply bytes held of the budget
    until then."""

    parts: list[Any]
    places: np.ndarray | None = None
    readers: dict[int, int] = field(default_factory=dict)
    reserved: int = 0


@dataclass
class _Proven:
    """The capability part a connection last presented and proved: its bytes, what they decode
    to and this node's grant in them. Its MAC depends on those bytes alone, so when the same
    bytes come again on the connection (an engine sends its lease's part with every request)
    they are not decoded or MACed again; whether it is current (its end, revocation) is
    checked every request all the same (``check_current``)."""

    encoded: bytes = b""
    proof: tuple[ReadCapability, NodeGrant] | None = None


class EngineReadServer:
    """Serves node ``node_id``'s shards of ``source`` (under ``lock``, the actor's) to holders
    of read capabilities minted under ``read_key``, on ``host`` (an ephemeral port). ``clock``:
    the wall clock expiries are checked against (a test moves it)."""

    def __init__(
        self,
        node_id: int,
        read_key: bytes,
        source: ShardSource,
        lock: threading.Lock,
        revocations: Revocations,
        host: str = "127.0.0.1",
        tls: ServerTLS | None = None,
        insecure: bool = False,
        clock: Clock | None = None,
        reply_budget_bytes: int = REPLY_BUDGET_BYTES,
        max_peers: int = MAX_PEERS,
        idle_s: float = IDLE_S,
    ) -> None:
        if check_plaintext(host, tls is not None, insecure):
            log.warning(
                "engine reads: serving %s in plaintext (insecure): every tenant's KV crosses "
                "the network in the clear",
                host,
            )
        if len(read_key) != 32:
            raise ValueError("read_key: must be 32 bytes")
        self.node_id = node_id
        self._key = read_key
        self._source = source
        self._lock = lock
        self.revocations = revocations
        self._clock = clock or SystemClock()
        self._tls = tls.context() if tls is not None else None
        self._budget = Budget(reply_budget_bytes)
        self._idle = idle_s
        self._peers = threading.BoundedSemaphore(max_peers)
        self._handshakes = HandshakeSlots()
        self._counting = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._socket = socket.create_server((host, 0), backlog=_BACKLOG)
        address = self._socket.getsockname()
        #: Where engines dial (no key: the capability is the credential).
        self.endpoint: tuple[str, int] = (str(address[0]), int(address[1]))
        self._closed = False
        self._parent = os.getppid()  # see FastCallServer: no serving for a dead actor
        threading.Thread(target=self._accept_loop, name="engine-read-accept", daemon=True).start()

    @classmethod
    def from_env(
        cls,
        node_id: int,
        read_key: bytes,
        source: ShardSource,
        lock: threading.Lock,
        revocations: Revocations,
        host: str,
    ) -> EngineReadServer:
        """A server with this process's data-plane setting (TLS, insecure), as the node's
        fastcall server has (``FastCallServer.from_env``)."""
        config = FastcallConfig.from_env()
        server_tls, _ = config.tls.sides(serving=True)
        return cls(
            node_id,
            read_key,
            source,
            lock,
            revocations,
            host,
            tls=server_tls,
            insecure=config.insecure,
        )

    def stats(self) -> dict[str, Any]:
        """Shards served and refused (by reason), bytes sent, sends from the segment files (one
        per run of records), peers dropped, requests busy."""
        with self._counting:
            counts = dict(self._counts)
        return {
            **counts,
            "tls": self._tls is not None,
            "reply_bytes_held": self._budget.held,
            "turned_away": self._handshakes.turned_away,
        }

    def _count(self, **amounts: int) -> None:
        with self._counting:
            counts = self._counts
            for name, amount in amounts.items():  # Counter.update's type checks cost more
                counts[name] += amount

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                peer, address = self._socket.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)
                continue
            if not self._peers.acquire(blocking=False):
                peer.close()
                self._count(peers_turned_away=1)
                continue
            slot = self._handshakes.take(str(address[0]), peer)
            if slot is None:
                self._peers.release()
                peer.close()
                continue
            threading.Thread(target=self._serve, args=(peer, slot), daemon=True).start()

    def _serve(self, peer: socket.socket, slot: Slot) -> None:
        try:
            self._serve_peer(peer, slot)
        finally:
            self._handshakes.give(slot)
            self._peers.release()

    def _serve_peer(self, peer: socket.socket, slot: Slot) -> None:
        accepted = time.monotonic()
        sock = peer
        try:
            peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Bounds each blocking send of a sendfile reply (os.sendfile ignores Python's
            # socket timeout); set before TLS takes the descriptor over.
            timeout = struct.pack("ll", int(IO_TIMEOUT_S), 0)
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeout)
            if self._tls is not None:
                sock = self._tls.wrap_socket(peer, server_side=True, do_handshake_on_connect=False)
                tls_handshake(sock, accepted + UNAUTHENTICATED_S)
        except (OSError, ValueError) as error:
            log.debug("engine reads: a peer failed the TLS handshake: %r", error)
            sock.close()
            return
        with FastConnection(sock, proto.MAX_REQUEST_BYTES) as conn:
            proven = False
            part = _Proven()
            while not self._closed:
                wait = accepted + UNAUTHENTICATED_S if not proven else time.monotonic() + self._idle
                reply: _Reply | None = None
                try:
                    size = conn.recv_length(wait)
                    if size > proto.MAX_REQUEST_BYTES or size < proto.REQUEST.size:
                        self._drop(f"a request of {size} bytes")
                        return
                    body = conn.recv_body(size, time.monotonic() + IO_TIMEOUT_S)
                    if self._orphaned():
                        return
                    answer = self._answer(body, part)
                    if answer is None:
                        return
                    reply, served = answer
                    deadline = time.monotonic() + IO_TIMEOUT_S
                    if reply.places is not None:
                        self._count(sends=_send_records(peer, reply, deadline))
                    else:
                        conn.send_frame(reply.parts, deadline)
                except (EOFError, OSError):  # gone, idle too long, or too slow
                    return
                except Exception:  # the node failed under the read: this peer asks elsewhere
                    log.exception("engine reads: node %d failed a read", self.node_id)
                    return
                finally:
                    if reply is not None:
                        for fd in reply.readers.values():
                            os.close(fd)
                        if reply.reserved:
                            self._budget.give(reply.reserved)
                if not served and not proven:
                    self._drop("its first request was refused")
                    return
                if not proven:
                    proven = True
                    self._handshakes.give(slot)  # a known reader now: its slot is free again

    def _drop(self, why: str) -> None:
        log.warning("engine reads: node %d dropped a peer: %s", self.node_id, why)
        self._count(peers_dropped=1)

    def _answer(self, body: bytearray, proven: _Proven) -> tuple[_Reply, bool] | None:
        """The reply to one request and whether it was served (its capability passed); None:
        drop the peer (not a read request). ``proven``: the part this connection proved last
        (updated when it proves another)."""
        view = memoryview(body)
        magic, op, version, _, cap_len, count = proto.REQUEST.unpack_from(view)
        if magic != proto.REQUEST_MAGIC or op != proto.OP_READ or version != proto.VERSION:
            self._drop(f"a frame naming operation {op} (magic {bytes(magic)!r}): not a read")
            return None
        if (
            count > proto.MAX_SHARDS_PER_REQUEST
            or len(view) != proto.REQUEST.size + cap_len + 32 * count
        ):
            self._drop(f"a read of {count} keys in {len(view)} bytes (malformed)")
            return None
        at = proto.REQUEST.size
        keys_raw = bytes(view[at + cap_len :])
        keys = [keys_raw[i : i + 32] for i in range(0, len(keys_raw), 32)]
        encoded = bytes(view[at : at + cap_len])
        try:
            if proven.proof is not None and encoded == proven.encoded:
                capability, grant = proven.proof
                check_current(capability, self._clock.now(), self.revocations)
            else:
                capability = ReadCapability.decode(encoded)
                grant = check_grant(
                    self._key, capability, self.node_id, self._clock.now(), self.revocations
                )
                proven.encoded, proven.proof = encoded, (capability, grant)
        except CapabilityRefused as refused:
            log.info("engine reads: node %d: %s", self.node_id, refused)
            self._count(**{f"refused_{refused.reason}": count, "requests_refused": 1})
            refusals = np.full(count, proto.STATUS[refused.reason], np.uint8)
            return _Reply(_parts(refusals, np.zeros(count, np.uint32), 0, refused)), False
        if grant.key_set.issuperset(keys):  # the usual request: one pass in C
            return self._read(keys, None), True
        allowed = [i for i, key in enumerate(keys) if key in grant.key_set]
        self._count(refused_other_shard=count - len(allowed))
        return self._read(keys, allowed), True

    def _read(self, keys: list[bytes], allowed: list[int] | None) -> _Reply:
        """The reply serving the ``allowed`` positions of ``keys`` (None: all of them), the
        others refused as another shard's: sent from the segment files where the socket is
        plain, else read into one buffer."""
        statuses = np.zeros(len(keys), np.uint8)  # OK
        wanted = keys
        if allowed is not None:
            statuses[:] = proto.STATUS[CapabilityRefused.OTHER_SHARD]
            if not allowed:
                return _Reply(_parts(statuses, np.zeros(len(keys), np.uint32), 0, None))
            wanted = [keys[i] for i in allowed]
        # TLS cannot sendfile: its bytes are encrypted in this process.
        if self._tls is None and _sendrecords is not None:
            with self._lock:
                found = self._source.shard_extents(wanted)
            if found is not None:
                return self._from_files(allowed, statuses, *found)
        lengths = np.zeros(len(keys), np.uint32)
        return self._from_buffer(wanted, allowed or list(range(len(keys))), statuses, lengths)

    def _from_files(
        self,
        allowed: list[int] | None,
        statuses: np.ndarray,
        held: np.ndarray,
        places: np.ndarray,
        readers: dict[int, int],
    ) -> _Reply:
        """The reply sending each held shard (``places``: segment, offset, bytes) as its
        whole record (the header before it is the reply's prefix, ``readproto``), once the
        node's lock is let go (``_send_records``)."""
        sizes = places[:, 2]
        if allowed is None and len(places) == len(statuses):  # the usual reply: all served
            lengths = sizes.astype("<u4")
        else:
            positions = np.arange(len(statuses)) if allowed is None else np.asarray(allowed)
            served = positions[held]
            statuses[positions] = proto.MISSING
            statuses[served] = proto.OK
            lengths = np.zeros(len(statuses), "<u4")
            lengths[served] = sizes
        total = int(sizes.sum()) + RECORD_BYTES * len(places)
        self._count(served=len(places), missing=len(held) - len(places), bytes_sent=total)
        parts = _parts(statuses, lengths, total, None, RECORD_BYTES)
        return _Reply(parts, places, readers)

    def _from_buffer(
        self, wanted: list[bytes], allowed: list[int], statuses: np.ndarray, lengths: np.ndarray
    ) -> _Reply:
        with self._lock:
            sizes = self._source.shard_sizes(wanted)
        reserve = sum(size for size in sizes if size > 0)
        if not self._budget.take(reserve, BUDGET_WAIT_S):
            statuses[allowed] = proto.BUSY
            self._count(busy=len(allowed))
            return _Reply(_parts(statuses, lengths, 0, None))
        try:
            with self._lock:
                buffer, got = self._source.get(wanted)
        except BaseException:
            self._budget.give(reserve)
            raise
        got_list = got.tolist()
        for position, length in zip(allowed, got_list, strict=True):
            if length >= 0:
                statuses[position] = proto.OK
                lengths[position] = length
            else:
                statuses[position] = proto.MISSING
        served = sum(1 for length in got_list if length >= 0)
        self._count(served=served, missing=len(allowed) - served, bytes_sent=int(buffer.size))
        return _Reply(
            [*_parts(statuses, lengths, int(buffer.size), None), buffer], reserved=reserve
        )

    def _orphaned(self) -> bool:
        if os.getppid() == self._parent:
            return False
        if not self._closed:
            log.warning("engine reads: the node's raylet is gone; no longer serving")
            self.close()
        return True

    def close(self) -> None:
        """Stop taking peers (those connected finish the request they are in)."""
        self._closed = True
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._socket.close()


def _parts(
    statuses: np.ndarray,
    lengths: np.ndarray,
    data_bytes: int,
    refused: CapabilityRefused | None,
    prefix: int = 0,
) -> list[Any]:
    """A reply's head, status table (padded) and lengths; its shards' bytes follow, each
    after ``prefix`` bytes."""
    count = len(statuses)
    code = 0 if refused is None else proto.STATUS[refused.reason]
    head = proto.REPLY.pack(proto.REPLY_MAGIC, code, prefix, count, data_bytes)
    table = np.zeros(proto.padded(count), np.uint8)
    table[:count] = statuses
    return [head, table, lengths.astype("<u4", copy=False)]


def _send_records(sock: socket.socket, reply: _Reply, deadline: float) -> int:
    """Send ``reply`` as one frame: its parts, then each served shard's record straight from
    its segment file, records end to end in one ``sendfile`` (``_sendrecords``); the sends it
    took. Each blocking send is bounded by the socket's SO_SNDTIMEO, the whole by ``deadline``;
    a file shorter than its index says breaks the frame: ``EOFError`` (the peer is dropped and
    reads elsewhere)."""
    assert _sendrecords is not None and reply.places is not None
    if sock.gettimeout() is not None:
        sock.settimeout(None)  # blocking: SO_SNDTIMEO bounds each wait
    readers = reply.readers
    return _sendrecords.send_records(
        sock.fileno(),
        tuple(reply.parts),
        reply.places,
        np.fromiter(readers.keys(), np.int64, len(readers)),
        np.fromiter(readers.values(), np.int64, len(readers)),
        RECORD_BYTES,
        deadline,
    )
