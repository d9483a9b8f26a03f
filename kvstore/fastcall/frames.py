"""The wire framing of the direct socket calls: what crosses a connection, frame by frame.

- **Frames**: a 4-byte big-endian length, then that many bytes (``FastConnection``, on a plain
  or a TLS socket); a frame is refused (the peer dropped) before it is read when it is longer
  than the side expects: a handshake message's exact size before the peer is authenticated,
  ``frame_limit`` after. The limit fits the batches the clients send; a larger call is not sent
  (the caller checks) and a larger answer not made (``FrameTooLarge``): both go through Ray.
- **Values** are ``kvstore.wire`` encodings, which build data and never run code (pickle, the
  format before, ran whatever a frame named, in the actor and in the gateway). A call is
  ``(method, args)`` (``call_of``), a reply ``(True, value)`` or ``(False, "Type: message")``
  (``reply_of``); a failed reply reaches the caller as ``RemoteError``.
- **Bounded I/O**: every operation given a deadline raises ``TimeoutError`` once it passed; a
  request's body, and its reply, must move within ``IO_TIMEOUT_S``.
"""

from __future__ import annotations

import math
import select
import socket
import ssl
import struct
import time
from collections.abc import Collection, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from kvstore import wire
from kvstore.wire import MAX_FRAME_BYTES, Buffer, WireError

#: A request's body must arrive (after its length), and its reply be taken, within this long:
#: a peer stalled mid-frame would otherwise hold a thread and its share of the budget for good.
IO_TIMEOUT_S = 5.0
_LENGTH = struct.Struct(">I")
#: Parts one ``sendmsg`` takes at most (IOV_MAX is 1024 on Linux).
_MAX_PARTS = 512
#: TLS sends (no ``sendmsg``) and discarded bodies move in pieces this large, each bounded.
_CHUNK = 1 << 20


class RemoteError(Exception):
    """The served method raised; the message names its type and text."""


class FrameTooLarge(RemoteError):
    """The answer was larger than a frame may be (a batch beyond what the socket carries):
    nothing failed, the call must go another way (``RayFanout``: through Ray)."""


class FastConnection:
    """One framed socket (plain or TLS); what ``connect`` answers. ``send_bytes``/
    ``recv_bytes`` move one frame of raw bytes; the channel sends ``kvstore.wire`` values.
    Every operation given a ``deadline`` (``time.monotonic()``) raises ``TimeoutError`` once
    it passed; without one it blocks."""

    def __init__(self, sock: socket.socket, frame_limit: int = MAX_FRAME_BYTES) -> None:
        self._sock = sock
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._timed = False  # whether a deadline left a timeout on the socket
        self._poller: select.poll | None = None  # a plain socket's wait when a call would block
        self.frame_limit = frame_limit

    def fileno(self) -> int:
        return self._sock.fileno()

    def pending(self) -> bool:
        """Whether TLS holds decrypted bytes not yet read (the descriptor may not say so)."""
        return self._tls and self._sock.pending() > 0  # type: ignore[attr-defined]

    def send_frame(self, parts: Sequence[Buffer], deadline: float | None = None) -> None:
        views = [memoryview(part).cast("B") for part in parts]
        views.insert(0, memoryview(_LENGTH.pack(sum(map(len, views)))))
        if self._tls:  # TLS has no sendmsg
            data = memoryview(b"".join(views))
            for start in range(0, len(data), _CHUNK):
                self._until(deadline)
                self._sock.sendall(data[start : start + _CHUNK])
            return
        while views:  # scatter-gather: the arrays' memory goes out uncopied
            sent = self._send_some(views[:_MAX_PARTS], deadline)
            while views and sent >= len(views[0]):
                sent -= len(views.pop(0))
            if views and sent:
                views[0] = views[0][sent:]

    def recv_frame(self, limit: int | None = None, deadline: float | None = None) -> bytearray:
        """The next frame; ``WireError`` when its length passes ``limit`` (the frame is not
        read: drop the connection), ``EOFError`` when the peer hung up."""
        size = self.recv_length(deadline)
        limit = self.frame_limit if limit is None else limit
        if size > limit:
            raise WireError(f"a frame of {size} bytes, {limit} at the most")
        return self.recv_body(size, deadline)

    def recv_length(self, deadline: float | None = None) -> int:
        """The length prefix of the next frame (its body is still to read)."""
        head = bytearray(_LENGTH.size)
        self._recv_into(memoryview(head), deadline)
        size: int = _LENGTH.unpack(head)[0]
        return size

    def recv_body(self, size: int, deadline: float | None = None) -> bytearray:
        body = bytearray(size)
        self._recv_into(memoryview(body), deadline)
        return body

    def recv_array(self, size: int, deadline: float | None = None) -> memoryview:
        """``recv_body`` into fresh memory left uninitialised until the bytes land (a view of
        a uint8 array): a ``bytearray`` is zeroed first, a memset as long as the body (a
        put's 730 KB on each storage node, every call)."""
        body = memoryview(np.empty(size, np.uint8))  # type: ignore[arg-type]  # numpy's stubs
        self._recv_into(body, deadline)
        return body

    def discard(self, size: int, deadline: float | None = None) -> None:
        """Read ``size`` bytes into nothing (a body refused unread would break the stream)."""
        scratch = memoryview(bytearray(min(size, _CHUNK)))
        while size:
            piece = min(size, len(scratch))
            self._recv_into(scratch[:piece], deadline)
            size -= piece

    def _recv_into(self, view: memoryview, deadline: float | None) -> None:
        while view:
            got = self._recv_some(view, deadline)
            if not got:
                raise EOFError("fastcall: the peer closed the connection")
            view = view[got:]

    # A plain socket stays blocking, without a timeout: an operation with a deadline is made
    # non-blocking by its flag and waits in ``poll`` only when it would block. Setting a
    # timeout before each operation instead (as TLS must, ``_until``) cost a system call each
    # time, three a call.

    def _recv_some(self, view: memoryview, deadline: float | None) -> int:
        if self._tls or deadline is None:
            self._until(deadline)
            return self._sock.recv_into(view)
        self._untimed()
        while True:
            try:
                return self._sock.recv_into(view, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                self._wait(select.POLLIN, deadline)

    def _send_some(self, views: list[memoryview], deadline: float | None) -> int:
        if deadline is None:
            self._until(None)
            return self._sock.sendmsg(views)
        self._untimed()
        while True:
            try:
                return self._sock.sendmsg(views, (), socket.MSG_DONTWAIT)
            except BlockingIOError:
                self._wait(select.POLLOUT, deadline)

    def _untimed(self) -> None:
        if self._sock.gettimeout() is not None:  # left by ``_until`` or ``connect``
            self._sock.settimeout(None)
            self._timed = False

    def _wait(self, events: int, deadline: float) -> None:
        """Wait in ``poll`` until the socket is ready for ``events``; ``TimeoutError`` once
        ``deadline`` passed."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("fastcall: the peer took too long")
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self._sock, events)
        else:
            self._poller.modify(self._sock, events)
        self._poller.poll(max(1, math.ceil(left * 1000)))

    def _until(self, deadline: float | None) -> None:
        """Bound the next socket operation by ``deadline`` (None: block)."""
        if deadline is None:
            if self._timed:
                self._sock.settimeout(None)
                self._timed = False
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("fastcall: the peer took too long")
        self._sock.settimeout(left)
        self._timed = True

    def send_bytes(self, data: Buffer) -> None:
        self.send_frame([data])

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        return bytes(self.recv_frame(maxlength))

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> FastConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def call_of(frame: Buffer) -> tuple[str, tuple[Any, ...]]:
    """``(method, args)`` of a call frame; ``WireError`` when it is not one."""
    call = wire.decode(frame)
    if type(call) is not tuple or len(call) != 2:
        raise WireError("a call is (method, args)")
    method, args = call
    if type(method) is not str or type(args) is not tuple:
        raise WireError("a call is (method: str, args: tuple)")
    return method, args


def reply_of(frame: bytearray) -> tuple[bool, Any]:
    """``(ok, value)`` of a reply frame; ``WireError`` when it is not one."""
    reply = wire.decode(frame)
    if type(reply) is not tuple or len(reply) != 2 or type(reply[0]) is not bool:
        raise WireError("a reply is (ok: bool, value)")
    return reply[0], reply[1]


class Watched(Protocol):
    """What ``wait_ready`` watches: a connection, or a dial in progress (``client.Dialing``)."""

    def fileno(self) -> int: ...

    def pending(self) -> bool: ...


W = TypeVar("W", bound=Watched)


def wait_ready(conns: Collection[W], timeout: float) -> list[W]:
    """The connections of ``conns`` with a reply (or EOF) to read, or dials that are over,
    waiting up to ``timeout``."""
    buffered = [conn for conn in conns if conn.pending()]  # TLS read ahead: the fd may be quiet
    by_fd = {conn.fileno(): conn for conn in conns if conn not in buffered}
    if not by_fd:
        return buffered
    poller = select.poll()  # not ``select.select``: descriptors past 1,024 are common here
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    ready = poller.poll(0 if buffered else math.ceil(max(0.0, timeout) * 1000))
    return buffered + [by_fd[fd] for fd, _ in ready]
