"""The calling side of the direct socket: ``connect`` and ``FastChannel``.

``connect`` dials an actor's endpoint (host, port and the key it handed out through Ray), wraps
TLS around the socket when the setting has it, and answers the key challenge
(``kvstore.fastcall.handshake``), all within one bound. A ``FastChannel`` keeps a pool of such
connections to one actor, one per call in flight: ``start`` sends a call, ``frames.wait_ready``
tells when its reply is in, ``finish`` reads it and puts the connection back. A caller that
must not block on a dial has its call sent over a free connection or dialed in the background
(``send_or_dial``; a ``Dialing`` is watched by ``wait_ready`` like a connection).

Finding the endpoint is not this package's: ``kvstore.runtime.endpoints`` asks the actor through
Ray (``FastChannels``).
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from kvstore import wire
from kvstore.fastcall import handshake
from kvstore.fastcall.frames import (
    IO_TIMEOUT_S,
    FastConnection,
    FrameTooLarge,
    RemoteError,
    reply_of,
)
from kvstore.fastcall.handshake import HANDSHAKE_TIMEOUT_S, Endpoint
from kvstore.fastcall.tls import ClientTLS, client_context, tls_handshake
from kvstore.wire import MAX_FRAME_BYTES, Buffer, WireError


def connect(
    endpoint: Endpoint,
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
    tls: ClientTLS | None = None,
    frame_limit: int = MAX_FRAME_BYTES,
) -> FastConnection:
    """An authenticated connection to ``endpoint``; raises ``OSError`` (``TimeoutError`` when
    the actor does not answer in ``timeout_s``, ``ConnectionRefusedError`` when it is gone,
    ``ConnectionError`` when it turned the connection away (busy), ``PermissionError`` when the
    key is refused or the peer cannot prove it holds it: not the actor)."""
    host, port, _ = endpoint
    deadline = time.monotonic() + timeout_s
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            sock = client_context(tls).wrap_socket(
                sock, server_hostname=tls.server_name, do_handshake_on_connect=False
            )
            try:
                tls_handshake(sock, deadline)
            except ssl.SSLCertVerificationError as error:
                raise PermissionError(f"fastcall: {host}:{port}: {error.verify_message}") from None
        conn = FastConnection(sock, frame_limit)
        handshake.answer(conn, endpoint, deadline)
        sock.settimeout(None)
        return conn
    except WireError as error:  # a handshake frame of the wrong size
        sock.close()
        raise PermissionError(
            f"fastcall: {host}:{port} is not a fastcall server: {error}"
        ) from None
    except BaseException:
        sock.close()
        raise


class FastChannel:
    """The calling side of one actor's ``FastCallServer``: a pool of authenticated sockets
    (one per call in flight), safe to use from several threads."""

    def __init__(
        self,
        endpoint: Endpoint,
        tls: ClientTLS | None = None,
        frame_limit: int = MAX_FRAME_BYTES,
    ) -> None:
        self.endpoint = endpoint
        self._tls = tls
        self._frame_limit = frame_limit
        self._free: list[FastConnection] = []
        self._lock = threading.Lock()

    def idle(self) -> bool:
        """Whether a call can start without dialing (a connection is free)."""
        return bool(self._free)

    def start(
        self, method: str, args: tuple[Any, ...], dial_timeout_s: float = HANDSHAKE_TIMEOUT_S
    ) -> FastConnection:
        """Send a call; the returned connection becomes readable when its reply is in.
        Raises ``OSError``/``EOFError`` when the actor cannot be reached (``TimeoutError``
        when a new connection is not set up, or the call not sent, within ``dial_timeout_s``,
        at most the handshake's bound: a loaded actor may take a while to answer, so a short
        fixed bound would make healthy dials fail), ``TypeError`` for an argument the wire does
        not carry and ``WireError`` for a call over the frame limit (both before any socket is
        used)."""
        return self._start(wire.encode((method, tuple(args)), self._frame_limit), dial_timeout_s)

    def send_or_dial(
        self, method: str, args: tuple[Any, ...], timeout_s: float = HANDSHAKE_TIMEOUT_S
    ) -> FastConnection | Dialing:
        """``start`` for a caller who must not block on a dial: sent over a free connection
        (returned), else on a new one dialed in a thread of its own (the ``Dialing``). The
        wire's errors are raised here, before any socket is used."""
        parts = wire.encode((method, tuple(args)), self._frame_limit)
        conn = self._free_connection()
        if conn is None:
            return Dialing(lambda: self._start(parts, HANDSHAKE_TIMEOUT_S))
        self._send(conn, parts, timeout_s)
        return conn

    def _start(self, parts: list[Buffer], dial_timeout_s: float) -> FastConnection:
        conn = self._free_connection()
        if conn is None:
            timeout = max(0.001, min(dial_timeout_s, HANDSHAKE_TIMEOUT_S))
            conn = connect(self.endpoint, timeout, self._tls, self._frame_limit)
        self._send(conn, parts, dial_timeout_s)
        return conn

    def _free_connection(self) -> FastConnection | None:
        with self._lock:
            return self._free.pop() if self._free else None

    @staticmethod
    def _send(conn: FastConnection, parts: list[Buffer], timeout_s: float) -> None:
        try:
            # Bounded: a batch of shards is more than the socket buffers hold, and a frozen
            # actor would otherwise keep the sender here for good.
            conn.send_frame(parts, time.monotonic() + max(0.001, timeout_s))
        except BaseException:
            conn.close()
            raise

    def finish(self, conn: FastConnection) -> Any:
        """The reply of the call sent on ``conn`` (ready: see ``wait_ready``); ``conn`` is
        reused. Raises ``RemoteError`` if the method raised or the actor was too busy
        (``FrameTooLarge``: the answer would not fit a frame), ``OSError``/``EOFError`` if the
        actor went away (or answered a frame that is not a reply: the connection is dropped)."""
        try:
            # Its first bytes are in; the rest must follow within a bound (a frozen actor).
            ok, value = reply_of(conn.recv_frame(deadline=time.monotonic() + IO_TIMEOUT_S))
        except WireError as error:
            conn.close()
            host, port, _ = self.endpoint
            raise ConnectionError(f"fastcall: {host}:{port} sent a bad reply: {error}") from None
        except BaseException:
            conn.close()
            raise
        with self._lock:
            self._free.append(conn)
        if not ok:
            too_large = str(value).startswith(f"{FrameTooLarge.__name__}:")
            raise (FrameTooLarge if too_large else RemoteError)(value)
        return value

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for conn in free:
            conn.close()


class Dialing:
    """A call being sent on a new connection, dialed in a thread of its own
    (``FastChannel.send_or_dial``). A dial to an actor that does not answer (its host cut off,
    or a lingering worker whose kernel accepts for nobody) takes the handshake's whole bound;
    done in the caller's thread it held up every call the caller had still to send and every
    reply it was waiting for, and a read missed blocks it could have decoded.

    ``fileno`` becomes readable when the dial is over; ``take`` then gives the connection the
    reply will come on, or what stopped the call (``start``'s errors). A caller that gives up
    ``abandon``s it: the connection, whenever it comes, is closed unread."""

    def __init__(self, start: Callable[[], FastConnection]) -> None:
        """``start()``: dial and send, in the dial's thread."""
        self._lock = threading.Lock()
        self._outcome: FastConnection | Exception | None = None
        self._abandoned = False
        self._taken = True  # until the eventfd is open there is nothing to close
        self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._taken = False
        threading.Thread(target=self._run, args=(start,), name="fastcall-dial", daemon=True).start()

    def _run(self, start: Callable[[], FastConnection]) -> None:
        outcome: FastConnection | Exception
        try:
            outcome = start()
        except Exception as error:  # the caller sorts it out, as if ``start`` had raised
            outcome = error
        with self._lock:
            if not self._abandoned:
                self._outcome = outcome
                os.eventfd_write(self._wake, 1)
                return
        _close(outcome)
        os.close(self._wake)

    def fileno(self) -> int:
        return self._wake

    def pending(self) -> bool:
        """Nothing buffered to read (what ``frames.wait_ready`` asks of a connection)."""
        return False

    def finished(self) -> bool:
        with self._lock:
            return self._outcome is not None

    def take(self) -> FastConnection | Exception:
        """The dial's outcome (``finished`` must be true); the caller owns the connection."""
        with self._lock:
            outcome, self._outcome = self._outcome, None
            if outcome is None:
                raise RuntimeError("fastcall: a dial taken before it finished")
            self._taken = True
        os.close(self._wake)
        return outcome

    def abandon(self) -> None:
        """The caller gave up: close what the dial made, now or when it is over."""
        with self._lock:
            if self._taken or self._abandoned:
                return
            self._abandoned = True
            outcome, self._outcome = self._outcome, None
            if outcome is None:
                return  # still dialing: its thread closes what it makes
        _close(outcome)
        os.close(self._wake)

    def __del__(self) -> None:
        self.abandon()  # a dial nobody took or abandoned (its thread is over: it held ``self``)


def _close(outcome: FastConnection | Exception) -> None:
    if isinstance(outcome, FastConnection):
        outcome.close()
