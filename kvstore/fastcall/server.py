"""``FastCallServer``: the actor's side of the direct socket, serving methods of its object.

One thread accepts; each peer gets a thread of its own, which first runs the key challenge
(``handshake``, inside TLS when the setting has it) and then serves that peer's calls one after
the other, each under the lock the actor already holds around its object (socket calls and Ray
calls never run in it at once).

What makes it safe to listen:

- **Bounded handshakes, shared by source**: at most ``MAX_HANDSHAKES`` peers are being
  authenticated at once (one thread each), no more than ``MAX_HANDSHAKES_PER_SOURCE`` of them
  from one address (``admission``), so a flood from one source cannot take every slot; more are
  closed at once (the caller goes through Ray). Each must prove the key within
  ``UNAUTHENTICATED_S`` from its accept, however slowly it sends.
- **Bounded request bytes**: at most ``max_inflight_bytes`` of requests held at once, and a
  stalled peer gives its bytes back (``budget``).
- **No code from the wire**: a call names a method of ``methods`` and its ``kvstore.wire``
  arguments (``frames``); any other frame drops the peer.
- **No serving for a dead actor**: once the node's raylet (this process's parent) is gone, the
  socket stops answering.
- **No plaintext beyond loopback**: a server told to listen on any other address without TLS
  refuses to start (``ConfigError`` naming the address and the two ways out) unless the
  operator said insecure (``tls.check_plaintext``); then it warns.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Collection
from typing import Any

from kvstore import wire
from kvstore.fastcall import handshake
from kvstore.fastcall.admission import HandshakeSlots, Slot
from kvstore.fastcall.budget import BUDGET_WAIT_S, INFLIGHT_BYTES, Budget
from kvstore.fastcall.frames import IO_TIMEOUT_S, FastConnection, FrameTooLarge, call_of
from kvstore.fastcall.handshake import Endpoint
from kvstore.fastcall.tls import FastcallConfig, ServerTLS, check_plaintext, tls_handshake
from kvstore.wire import MAX_FRAME_BYTES, Buffer, WireError

log = logging.getLogger(__name__)

#: How long an unauthenticated peer may hold its slot (the server's half of the challenge, TLS
#: included): an honest client answers within a round trip or two, so this is short, and a
#: connection that only sits there gives its slot back soon. Under the clients' own bound
#: (``handshake.HANDSHAKE_TIMEOUT_S``) so that a dial the server gave up on fails, not hangs.
UNAUTHENTICATED_S = 1.0
#: Connections the kernel queues before the accept loop takes them: room for a burst (a flood's
#: connections are taken and closed at once, so honest ones do not wait behind a full queue).
_BACKLOG = 1024


class FastCallServer:
    """Serves ``methods`` of ``target`` on ``host`` (an ephemeral port), one thread per peer.
    After each reply is sent, the target's ``after_reply()`` (if any) runs: work a call brought
    that its caller need not wait for.

    ``lock`` is the lock the actor already holds around its plain object, so socket calls and
    Ray calls never run in it at once. Each peer first passes the mutual challenge (see
    ``kvstore.fastcall.handshake``), in its own thread, so a slow or silent peer never holds up
    the others. ``max_inflight_bytes``, ``budget_wait_s`` and ``io_timeout_s`` bound the request
    bytes held at once and how long a peer may hold them (``kvstore.fastcall.budget``).

    Without ``tls``, ``host`` must be loopback unless ``insecure`` (``tls.check_plaintext``):
    refused before anything listens. ``from_env`` takes both from the operator's setting.
    """

    def __init__(
        self,
        target: object,
        methods: Collection[str],
        lock: threading.Lock,
        host: str = "127.0.0.1",
        tls: ServerTLS | None = None,
        frame_limit: int = MAX_FRAME_BYTES,
        max_inflight_bytes: int = INFLIGHT_BYTES,
        budget_wait_s: float = BUDGET_WAIT_S,
        io_timeout_s: float = IO_TIMEOUT_S,
        insecure: bool = False,
    ) -> None:
        # Checked here, where every server starts, before the socket exists: nothing listens
        # in plaintext beyond loopback, not even for a moment, unless the operator said so.
        if check_plaintext(host, tls is not None, insecure):
            log.warning(
                "fastcall: serving %s in plaintext (insecure): every tenant's KV crosses the "
                "network in the clear",
                host,
            )
        self._target = target
        self._methods = frozenset(methods)
        self._lock = lock
        self._tls = tls.context() if tls is not None else None
        self._frame_limit = frame_limit
        self._budget = Budget(max_inflight_bytes)
        self._budget_wait = budget_wait_s
        self._io_timeout = io_timeout_s
        self._served: Counter[str] = Counter()
        self._counting = threading.Lock()  # not ``lock``: the actor may hold it asking stats()
        self._authkey = os.urandom(32)
        self._socket = socket.create_server((host, 0), backlog=_BACKLOG)
        address = self._socket.getsockname()
        self.endpoint: Endpoint = (str(address[0]), int(address[1]), self._authkey)
        self._closed = False
        self._handshakes = HandshakeSlots()
        # A Ray worker is a child of its node's raylet. Once the raylet is gone (the machine was
        # removed or declared dead) Ray routes no call here any more, but this process may
        # linger a while; its socket must not keep answering for a dead actor.
        self._parent = os.getppid()
        threading.Thread(target=self._accept_loop, name="fastcall-accept", daemon=True).start()

    @classmethod
    def from_env(
        cls,
        target: object,
        methods: Collection[str],
        lock: threading.Lock,
        host: str,
        frame_limit: int = MAX_FRAME_BYTES,
        max_inflight_bytes: int = INFLIGHT_BYTES,
    ) -> FastCallServer:
        """A server with this process's data-plane setting (``FastcallConfig``: TLS where it
        is set, plaintext beyond loopback only under ``KVSTORE_FASTCALL_INSECURE``): what the
        actors start, with the setting deploy handed on to them (``tls_env_options``)."""
        config = FastcallConfig.from_env()
        server_tls, _ = config.tls.sides(serving=True)
        return cls(
            target,
            methods,
            lock,
            host,
            tls=server_tls,
            frame_limit=frame_limit,
            max_inflight_bytes=max_inflight_bytes,
            insecure=config.insecure,
        )

    def stats(self) -> dict[str, Any]:
        """Calls served per method, whether in TLS, requests refused ``busy``, request bytes held
        now and at the most so far, peers in the handshake now and turned away (no slot) so
        far."""
        budget = self._budget
        with self._counting:
            served = dict(self._served)
        return {
            "served": served,
            "tls": self._tls is not None,
            "handshakes": self._handshakes.held(),
            "turned_away": self._handshakes.turned_away,
            "evicted": self._handshakes.evicted,
            "refused_busy": budget.refused,
            "inflight_bytes": budget.held,
            "inflight_peak": budget.peak,
            "max_inflight_bytes": budget.limit,
        }

    def _orphaned(self) -> bool:
        if os.getppid() == self._parent:
            return False
        if not self._closed:
            log.warning("fastcall: the node's raylet is gone; no longer serving")
            self.close()
        return True

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                peer, address = self._socket.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # out of descriptors or the like: try again, do not spin
                continue
            slot = self._handshakes.take(str(address[0]), peer)
            if slot is None:
                peer.close()  # unauthenticated peers cost a thread each: no more than this
                continue
            threading.Thread(target=self._serve, args=(peer, slot), daemon=True).start()

    def _serve(self, peer: socket.socket, slot: Slot) -> None:
        try:
            conn = self._handshake(peer)
        finally:
            self._handshakes.give(slot)
        if conn is None:
            return
        with conn:
            while True:
                try:
                    size = conn.recv_length()  # an idle pooled connection waits here
                except (EOFError, OSError):
                    return  # the peer went away
                if size > self._frame_limit:  # dropped unread: no call of ours is that long
                    log.warning(
                        "fastcall: dropped a peer sending %d bytes (%d at the most)",
                        size,
                        self._frame_limit,
                    )
                    return
                held = self._budget.take(size, self._budget_wait)
                try:
                    reply = self._answer(conn, size, held)
                    if reply is None:
                        return
                    conn.send_frame(reply, time.monotonic() + self._io_timeout)
                except (EOFError, OSError):  # gone, or stalled past io_timeout_s
                    return
                finally:
                    if held:
                        self._budget.give(size)
                if held:
                    self._after_reply()

    def _answer(self, conn: FastConnection, size: int, held: bool) -> list[Buffer] | None:
        """The reply frame to the request of ``size`` bytes whose body is next on ``conn`` (its
        bytes reserved when ``held``), or None: drop this peer."""
        deadline = time.monotonic() + self._io_timeout
        if not held:  # read into nothing: the stream stays in step for the next call
            conn.discard(size, deadline)
            return wire.encode((False, f"busy: {self._budget.refusal(size, self._budget_wait)}"))
        try:
            method, args = call_of(conn.recv_array(size, deadline))
        except WireError as error:  # an undecodable message: drop this peer
            log.warning("fastcall: dropped a peer: %s", error)
            return None
        if self._orphaned():
            return None  # the caller sees the connection close and asks Ray instead
        if method not in self._methods:
            reply: tuple[bool, Any] = (False, f"no fast method {method!r}")
        else:
            try:
                with self._lock:
                    reply = (True, getattr(self._target, method)(*args))
                    with self._counting:
                        self._served[method] += 1
            except Exception as error:
                reply = (False, f"{type(error).__name__}: {error}")
        try:
            return wire.encode(reply, self._frame_limit)
        except WireError as error:  # a batch too large for one frame: the caller asks Ray
            return wire.encode((False, f"{FrameTooLarge.__name__}: {error}"))
        except TypeError as error:  # an answer the wire does not carry
            return wire.encode((False, f"{type(error).__name__}: {error}"))

    def _handshake(self, peer: socket.socket) -> FastConnection | None:
        """The peer, authenticated (None when it failed the challenge or took too long)."""
        deadline = time.monotonic() + UNAUTHENTICATED_S
        sock = peer
        try:
            peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(peer, server_side=True, do_handshake_on_connect=False)
                tls_handshake(sock, deadline)
            conn = FastConnection(sock, self._frame_limit)
            if not handshake.challenge(conn, self.endpoint, deadline):
                log.warning("fastcall: a peer without the key was refused")
                sock.close()
                return None
            sock.settimeout(None)
            return conn
        except (OSError, EOFError, ValueError) as error:  # gone, too slow, TLS, a frame too big
            log.debug("fastcall: a peer failed the handshake: %r", error)
            sock.close()
            return None

    def _after_reply(self) -> None:
        """Work the caller need not wait for (``after_reply()`` of the target, if it has one):
        run once the reply is on its way, so it never adds to the call's latency."""
        after = getattr(self._target, "after_reply", None)
        if after is None:
            return
        try:
            with self._lock:
                after()
        except Exception:  # the reply is out; a failure here is the target's to log
            log.exception("fastcall: after_reply failed")

    def close(self) -> None:
        """Stop taking peers (the peers already connected are served until they leave)."""
        self._closed = True
        try:
            self._socket.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
        except OSError:
            pass
        self._socket.close()
