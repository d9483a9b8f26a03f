"""A direct socket channel for the few hot calls, beside Ray.

Ray stays the control plane (placement, restarts, names, every other call), but a Ray actor
call cost ~1.5 ms of CPU on this kind of machine, caller and actor together (submit, task
dispatch, serialisation, output store; measured while profiling QueryHit), and a QueryHit makes
one per meta shard and one per directory shard. The calls on the hit path (a meta shard's
``lookup_wire``, an entrypoint's ``lookup``) go instead over a plain socket to a thread in the
actor's process:
``multiprocessing.connection`` (length-prefixed pickles), HMAC-authenticated with a key the actor
makes at start and hands out only through Ray (a nonce-challenge handshake: the key never crosses
the wire). A round trip costs tens of microseconds.

Failure semantics match Ray's as the callers see them: a dead or restarted actor closes its
sockets, the caller's call fails (``NodeUnavailable`` in ``RayFanout``), the stale endpoint is
forgotten and the next call asks the actor, through Ray, for its new one.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import threading
import time
from collections.abc import Collection, Hashable
from multiprocessing.connection import Connection, wait
from typing import Any

import ray
from ray.exceptions import RayError

log = logging.getLogger(__name__)

#: (host, port, authkey) of a serving actor.
Endpoint = tuple[str, int, bytes]

#: A peer must finish the key handshake within this long (both sides), so a dead or wedged
#: actor makes a call fail instead of hang.
HANDSHAKE_TIMEOUT_S = 2.0
_BACKLOG = 128
_WELCOME = b"kvstore.fastcall.v1"


class RemoteError(Exception):
    """The served method raised; the message names its type and text."""


class FastCallServer:
    """Serves ``methods`` of ``target`` on ``host`` (an ephemeral port), one thread per peer.
    After each reply is sent, the target's ``after_reply()`` (if any) runs: work a call brought
    that its caller need not wait for.

    ``lock`` is the lock the actor already holds around its plain object, so socket calls and
    Ray calls never run in it at once. Each peer first proves it holds the key (HMAC-SHA256 of
    a fresh nonce), in its own thread and within ``HANDSHAKE_TIMEOUT_S``, so a slow or silent
    peer never holds up the others.
    """

    def __init__(
        self,
        target: object,
        methods: Collection[str],
        lock: threading.Lock,
        host: str = "127.0.0.1",
    ) -> None:
        self._target = target
        self._methods = frozenset(methods)
        self._lock = lock
        self._authkey = os.urandom(32)
        self._socket = socket.create_server((host, 0), backlog=_BACKLOG)
        address = self._socket.getsockname()
        self.endpoint: Endpoint = (str(address[0]), int(address[1]), self._authkey)
        self._closed = False
        # A Ray worker is a child of its node's raylet. Once the raylet is gone (the machine was
        # removed or declared dead) Ray routes no call here any more, but this process may
        # linger a while; its socket must not keep answering for a dead actor.
        self._parent = os.getppid()
        threading.Thread(target=self._accept_loop, name="fastcall-accept", daemon=True).start()

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
                peer, _ = self._socket.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # out of descriptors or the like: try again, do not spin
                continue
            threading.Thread(target=self._serve, args=(peer,), daemon=True).start()

    def _serve(self, peer: socket.socket) -> None:
        peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with Connection(peer.detach()) as conn:
            nonce = os.urandom(32)
            try:
                conn.send_bytes(nonce)
                if not conn.poll(HANDSHAKE_TIMEOUT_S):
                    return
                proof = conn.recv_bytes(64)
                if not hmac.compare_digest(proof, _proof(self._authkey, nonce)):
                    log.warning("fastcall: a peer without the key was refused")
                    return
                conn.send_bytes(_WELCOME)
            except (OSError, EOFError):
                return
            while True:
                try:
                    method, args = conn.recv()
                except (EOFError, OSError):
                    return  # the peer went away
                except Exception as error:  # an undecodable message: drop this peer
                    log.warning("fastcall: bad message: %r", error)
                    return
                if self._orphaned():
                    return  # the caller sees the connection close and asks Ray instead
                if method not in self._methods:
                    reply: tuple[bool, Any] = (False, f"no fast method {method!r}")
                else:
                    try:
                        with self._lock:
                            reply = (True, getattr(self._target, method)(*args))
                    except Exception as error:
                        reply = (False, f"{type(error).__name__}: {error}")
                try:
                    conn.send(reply)
                except (OSError, ValueError):
                    return
                self._after_reply()

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


def _proof(authkey: bytes, nonce: bytes) -> bytes:
    return hmac.new(authkey, nonce, hashlib.sha256).digest()


def connect(endpoint: Endpoint, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Connection:
    """An authenticated connection to ``endpoint``; raises ``OSError`` (``TimeoutError`` when
    the actor does not answer in ``timeout_s``, ``ConnectionRefusedError`` when it is gone,
    ``PermissionError`` when the key is refused)."""
    host, port, authkey = endpoint
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.settimeout(None)  # Connection reads the descriptor directly: it must block
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = Connection(sock.detach())
    try:
        if not conn.poll(timeout_s):
            raise TimeoutError(f"fastcall: {host}:{port} sent no challenge in {timeout_s} s")
        nonce = conn.recv_bytes(64)
        conn.send_bytes(_proof(authkey, nonce))
        if not conn.poll(timeout_s):
            raise TimeoutError(f"fastcall: {host}:{port} did not answer the handshake")
        if conn.recv_bytes(64) != _WELCOME:
            raise PermissionError(f"fastcall: {host}:{port} refused the key")
    except EOFError:
        conn.close()
        raise PermissionError(f"fastcall: {host}:{port} refused the key") from None
    except BaseException:
        conn.close()
        raise
    return conn


class FastChannel:
    """The calling side of one actor's ``FastCallServer``: a pool of authenticated sockets
    (one per call in flight), safe to use from several threads."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._free: list[Connection] = []
        self._lock = threading.Lock()

    def idle(self) -> bool:
        """Whether a call can start without dialing (a connection is free)."""
        return bool(self._free)

    def start(
        self, method: str, args: tuple[Any, ...], dial_timeout_s: float = HANDSHAKE_TIMEOUT_S
    ) -> Connection:
        """Send a call; the returned connection becomes readable when its reply is in.
        Raises ``OSError``/``EOFError`` when the actor cannot be reached (``TimeoutError``
        when a new connection is not set up within ``dial_timeout_s``: a caller with a
        deadline passes what is left of it; a loaded actor may take a while to answer, so a
        short fixed bound would make healthy dials fail)."""
        with self._lock:
            conn = self._free.pop() if self._free else None
        if conn is None:
            conn = connect(self.endpoint, max(0.001, min(dial_timeout_s, HANDSHAKE_TIMEOUT_S)))
        try:
            conn.send((method, args))
        except BaseException:
            conn.close()
            raise
        return conn

    def finish(self, conn: Connection) -> Any:
        """The reply of the call sent on ``conn`` (ready: see ``wait``); ``conn`` is reused.
        Raises ``RemoteError`` if the method raised, ``OSError``/``EOFError`` if the actor
        went away."""
        try:
            ok, value = conn.recv()
        except BaseException:
            conn.close()
            raise
        with self._lock:
            self._free.append(conn)
        if not ok:
            raise RemoteError(value)
        return value

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for conn in free:
            conn.close()


class FastChannels:
    """Channels to many actors, by target name. Never blocks: the first call to a target (and
    the first after its channel failed) goes through Ray while the actor is asked, through Ray
    too, for its endpoint (``fast_endpoint()``); later calls use the socket. A target without
    one (or not answering) is asked again after ``retry_s``."""

    def __init__(self, retry_s: float = 1.0) -> None:
        self._retry = retry_s
        self._channels: dict[Hashable, FastChannel] = {}
        self._asking: dict[Hashable, Any] = {}  # target -> ObjectRef of fast_endpoint()
        self._none_until: dict[Hashable, float] = {}
        self._lock = threading.Lock()

    def get(self, target: Hashable, handle: Any) -> FastChannel | None:
        """The target's channel, or None: call it through Ray this time."""
        with self._lock:
            channel = self._channels.get(target)
            if channel is not None:
                return channel
            asking = self._asking.get(target)
            if asking is None:
                if self._none_until.get(target, 0.0) <= time.monotonic():
                    try:
                        self._asking[target] = handle.fast_endpoint.remote()
                    except (RayError, AttributeError) as error:
                        self._none_until[target] = time.monotonic() + self._retry
                        log.debug("no fast path to %s: %s", target, error)
                return None
        ready, _ = ray.wait([asking], timeout=0)
        if not ready:
            return None
        try:
            host, port, authkey = ray.get(asking, timeout=0)
        except (RayError, TypeError, ValueError) as error:
            log.debug("no fast path to %s: %s", target, error)
            with self._lock:
                self._asking.pop(target, None)
                self._none_until[target] = time.monotonic() + self._retry
            return None
        with self._lock:
            self._asking.pop(target, None)
            return self._channels.setdefault(target, FastChannel((host, port, authkey)))

    def forget(self, target: Hashable, channel: FastChannel) -> None:
        """The actor behind ``channel`` went away (or restarted on a new port)."""
        with self._lock:
            if self._channels.get(target) is channel:
                del self._channels[target]
        channel.close()


def wait_ready(conns: Collection[Connection], timeout: float) -> list[Connection]:
    """The connections of ``conns`` with a reply (or EOF) to read, waiting up to ``timeout``."""
    return [conn for conn in wait(list(conns), timeout=max(0.0, timeout))]  # type: ignore[misc]
