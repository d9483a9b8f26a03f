"""The direct socket channel beside Ray: the data plane of the block tier and the SWA fetch.

Ray stays the control plane (placement, restarts, names, endpoints, every other call), but a Ray
actor call cost ~1-1.5 ms of CPU on this kind of machine, caller and actor together (submit,
task dispatch, serialisation, output store), and a value over 100 KiB goes through the object
store (measured with Ray 2.60). A plain socket with one request and one scatter-gather reply moves a
batch at several GB/s. So the calls that move bytes or sit on the hit path go over a socket to
a thread in the actor's process: a storage node's ``put``/``commit``/``abort``/``get``/``holds``/
``delete``, a meta shard's ``lookup_wire`` and the calls of every put (``begin_put``,
``commit``, ``abort_put``, ``release``), an SWA entrypoint's ``lookup`` and an SWA store's
``fetch`` of a state. A round trip costs tens of microseconds; arrays go out uncopied.

What crosses the socket, and why it is safe to listen:

- **Frames**: a 4-byte big-endian length, then that many bytes; a frame is refused (the peer
  dropped) before it is read when it is longer than the side expects: a handshake message's
  exact size before the peer is authenticated, ``frame_limit`` after. The limit fits the
  batches the clients send; a larger call is not sent (the caller checks) and a larger answer
  not made (``FrameTooLarge``): both go through Ray.
- **Values** are ``kvstore.wire`` encodings, which build data and never run code (pickle, the
  format before, ran whatever a frame named, in the actor and in the gateway). A call is
  ``(method, args)``, a reply ``(True, value)`` or ``(False, "Type: message")``.
- **A mutual challenge** on a key the actor makes at start and hands out only through Ray (it
  never crosses the socket)::

      server -> client   MAGIC + Ns                  (a fresh 32-byte nonce)
      client -> server   Nc + HMAC(key, "<MAGIC> client" + Ns + Nc + "host:port")
      server -> client        HMAC(key, "<MAGIC> server" + Ns + Nc + "host:port")

  Each side checks the other's proof (``hmac.compare_digest``) and hangs up on a wrong one; a
  client raises ``PermissionError``. Both nonces make a proof good for one connection only, the
  role label keeps one side's proof from passing as the other's, and the endpoint the client
  dialed (the one the actor handed out) binds it to that address: an impostor on a port a
  restarted actor freed cannot relay the handshake to the actor's new port.
- **Bounded handshakes**: at most ``MAX_HANDSHAKES`` peers are being authenticated at once (one
  thread each; more are closed at once: the caller goes through Ray), each within
  ``HANDSHAKE_TIMEOUT_S`` from its accept, however slowly it sends.
- **Bounded request bytes**: a server holds at most ``max_inflight_bytes`` of requests at once.
  A connection reserves its request's size (known from the length prefix) before it reads the
  body and gives it back once the reply is sent; with the budget spent it waits up to
  ``budget_wait_s`` (TCP holds the sender back meanwhile), then reads the body into nothing
  and answers ``busy`` (as does a request larger than the whole budget): the caller's call
  fails (``NodeUnavailable``), the connection and every other peer go on. A body must arrive,
  and a reply be taken, within ``io_timeout_s``, so a stalled peer gives its bytes back.
  Replies are not counted: the served methods make them one at a time (the actor's lock) and
  each lives only until it is sent, within the same bound.
- **TLS** (``ServerTLS``/``ClientTLS``, off by default: on loopback it buys nothing) wraps the
  socket before the challenge, for calls between machines: without it, a machine in the path
  could still read or alter the frames of a connection after its handshake. An operator turns
  it on through the environment (``tls_from_env``), the same in every process of the cluster;
  deploy hands the setting on to the actors it starts (``tls_env_options``).

Failure semantics match Ray's as the callers see them: a dead or restarted actor closes its
sockets, the caller's call fails (``NodeUnavailable`` in ``RayFanout``), the stale endpoint is
forgotten and the next call asks the actor, through Ray, for its new one. A caller that wants
no Ray call on its byte path at all asks for the endpoints up front (``FastChannels.prepare``).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections import Counter
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, TypeVar

import ray
from ray.exceptions import RayError

from kvstore import wire
from kvstore.errors import ConfigError
from kvstore.wire import MAX_FRAME_BYTES, Buffer, WireError

log = logging.getLogger(__name__)

#: (host, port, authkey) of a serving actor.
Endpoint = tuple[str, int, bytes]
K = TypeVar("K", bound=Hashable)

#: A peer must finish the key handshake within this long (both sides), so a dead or wedged
#: actor makes a call fail instead of hang.
HANDSHAKE_TIMEOUT_S = 2.0
#: Peers being authenticated at once (a thread each); more are turned away until one is done.
MAX_HANDSHAKES = 16
#: A request's body must arrive (after its length), and its reply be taken, within this long:
#: a peer stalled mid-frame would otherwise hold a thread and its share of the budget for good.
IO_TIMEOUT_S = 5.0
#: Request bytes a server holds at once, by default (a few of the largest batches).
INFLIGHT_BYTES = 256 << 20
#: How long a request waits for the budget before it is answered ``busy``: under the callers'
#: own send bound (``HANDSHAKE_TIMEOUT_S`` at the least), so they read "busy", not a timeout.
BUDGET_WAIT_S = 1.0
_BACKLOG = 128
_MAGIC = b"kvstore.fastcall.v2"
_NONCE = 32
_PROOF = 32  # HMAC-SHA256
_HELLO = len(_MAGIC) + _NONCE
_ANSWER = _NONCE + _PROOF
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


@dataclass(frozen=True)
class ServerTLS:
    """A server's certificate chain and private key (PEM files)."""

    certfile: str
    keyfile: str

    def context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.certfile, self.keyfile)
        return context


@dataclass(frozen=True)
class ClientTLS:
    """The CA (PEM file) a server's certificate must chain to. ``server_name``: the name the
    certificate must carry too; None checks the chain alone (a cluster CA that signs only the
    cluster's servers; the key challenge inside still proves the actor)."""

    cafile: str
    server_name: str | None = None


@functools.lru_cache(maxsize=8)
def _client_context(tls: ClientTLS) -> ssl.SSLContext:
    """Made once per setting: loading a CA file costs more than a loopback call."""
    context = ssl.create_default_context(cafile=tls.cafile)
    context.check_hostname = tls.server_name is not None
    return context


#: The operator's TLS setting (PEM file paths), read by every process that serves or dials.
TLS_CERT_ENV = "KVSTORE_FASTCALL_TLS_CERT"
TLS_KEY_ENV = "KVSTORE_FASTCALL_TLS_KEY"
TLS_CA_ENV = "KVSTORE_FASTCALL_TLS_CA"
TLS_SERVER_NAME_ENV = "KVSTORE_FASTCALL_TLS_SERVER_NAME"
TLS_ENV = (TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV, TLS_SERVER_NAME_ENV)


def tls_from_env(
    environ: Mapping[str, str] = os.environ, *, serving: bool = False
) -> tuple[ServerTLS | None, ClientTLS | None]:
    """The fastcall TLS setting of this process: ``(server, client)``, ``(None, None)`` when no
    variable is set (plain sockets; an empty value counts as unset). The cluster's processes
    dial each other, so a setting is whole or refused (``ConfigError`` naming the variable):
    a certificate needs its key and a CA (clients must trust the servers), a server name needs
    the CA, every file must load. A CA alone is a client-only process (the gateway needs no
    key); ``serving``: this process starts a ``FastCallServer``, which must then have a
    certificate (its clients speak TLS to it)."""
    value = {name: environ.get(name) or None for name in TLS_ENV}
    cert, key, ca, server_name = (value[name] for name in TLS_ENV)
    for name in (TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV):
        path = value[name]
        if path is not None and not os.path.isfile(path):
            raise ConfigError(name, f"{path}: no such file")
    if (cert is None) != (key is None):
        missing, given = (TLS_KEY_ENV, TLS_CERT_ENV) if key is None else (TLS_CERT_ENV, TLS_KEY_ENV)
        raise ConfigError(missing, f"must be set with {given} (a certificate and its key)")
    if ca is None and (cert is not None or server_name is not None):
        given = TLS_CERT_ENV if cert is not None else TLS_SERVER_NAME_ENV
        raise ConfigError(TLS_CA_ENV, f"must be set with {given}: this cluster's clients dial TLS")
    if serving and ca is not None and cert is None:
        raise ConfigError(
            TLS_CERT_ENV, f"must be set with {TLS_CA_ENV} where fastcall is served (TLS clients)"
        )
    server = ServerTLS(cert, key) if cert is not None and key is not None else None
    client = ClientTLS(ca, server_name) if ca is not None else None
    try:  # a bad PEM is the operator's to fix at start-up, not a refused peer later
        if server is not None:
            server.context()
    except (ssl.SSLError, OSError) as error:
        raise ConfigError(TLS_CERT_ENV, f"{cert} with {TLS_KEY_ENV}={key}: {error}") from None
    try:
        if client is not None:
            _client_context(client)
    except (ssl.SSLError, OSError) as error:
        raise ConfigError(TLS_CA_ENV, f"{ca}: {error}") from None
    return server, client


def tls_env_options(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Actor options handing this process's TLS variables on to an actor it starts (``{}`` when
    none is set). A Ray worker is started by its node's raylet, with the raylet's environment,
    not the deploying process's. The setting is checked here as for a server (the actors serve),
    so a bad one fails the deploy instead of every actor's start."""
    tls_from_env(environ, serving=True)
    env_vars = {name: environ[name] for name in TLS_ENV if environ.get(name)}
    return {"runtime_env": {"env_vars": env_vars}} if env_vars else {}


class FastConnection:
    """One framed socket (plain or TLS); what ``connect`` answers. ``send_bytes``/
    ``recv_bytes`` move one frame of raw bytes; the channel sends ``kvstore.wire`` values.
    Every operation given a ``deadline`` (``time.monotonic()``) raises ``TimeoutError`` once
    it passed; without one it blocks."""

    def __init__(self, sock: socket.socket, frame_limit: int = MAX_FRAME_BYTES) -> None:
        self._sock = sock
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._timed = False  # whether a deadline left a timeout on the socket
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
            self._until(deadline)
            sent = self._sock.sendmsg(views[:_MAX_PARTS])
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

    def discard(self, size: int, deadline: float | None = None) -> None:
        """Read ``size`` bytes into nothing (a body refused unread would break the stream)."""
        scratch = memoryview(bytearray(min(size, _CHUNK)))
        while size:
            piece = min(size, len(scratch))
            self._recv_into(scratch[:piece], deadline)
            size -= piece

    def _recv_into(self, view: memoryview, deadline: float | None) -> None:
        while view:
            self._until(deadline)
            got = self._sock.recv_into(view)
            if not got:
                raise EOFError("fastcall: the peer closed the connection")
            view = view[got:]

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


def _proof(key: bytes, role: bytes, nonces: tuple[bytes, bytes], host: str, port: int) -> bytes:
    """One side's proof that it holds ``key``, for this connection (``nonces``: the server's,
    the client's) to this endpoint only."""
    binding = f"{host}:{port}".encode()
    return hmac.new(key, b"".join((_MAGIC, b" ", role, *nonces, binding)), hashlib.sha256).digest()


def _tls_handshake(sock: ssl.SSLSocket, deadline: float) -> None:
    """The TLS handshake, done by ``deadline`` however slowly the peer sends (a socket timeout
    would bound each wait, not the whole)."""
    sock.setblocking(False)
    poller = select.poll()
    while True:
        try:
            sock.do_handshake()
            return
        except ssl.SSLWantReadError:
            poller.register(sock, select.POLLIN)
        except ssl.SSLWantWriteError:
            poller.register(sock, select.POLLOUT)
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise TimeoutError("fastcall: the TLS handshake took too long")
        poller.unregister(sock)


class _Budget:
    """Request bytes a server holds at once, at most ``limit`` (see the module doc)."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"max_inflight_bytes must be positive, got {limit}")
        self.limit = limit
        self.held = 0
        self.peak = 0
        self.refused = 0
        self._changed = threading.Condition()

    def take(self, size: int, wait_s: float) -> bool:
        """Reserve ``size`` bytes, waiting up to ``wait_s`` for them; False: refused."""
        with self._changed:
            if size > self.limit or not self._changed.wait_for(
                lambda: self.held + size <= self.limit, wait_s
            ):
                self.refused += 1
                return False
            self.held += size
            self.peak = max(self.peak, self.held)
            return True

    def give(self, size: int) -> None:
        with self._changed:
            self.held -= size
            self._changed.notify_all()


class FastCallServer:
    """Serves ``methods`` of ``target`` on ``host`` (an ephemeral port), one thread per peer.
    After each reply is sent, the target's ``after_reply()`` (if any) runs: work a call brought
    that its caller need not wait for.

    ``lock`` is the lock the actor already holds around its plain object, so socket calls and
    Ray calls never run in it at once. Each peer first passes the mutual challenge (see the
    module doc), in its own thread, so a slow or silent peer never holds up the others.
    ``max_inflight_bytes``, ``budget_wait_s`` and ``io_timeout_s`` bound the request bytes held
    at once and how long a peer may hold them (the module doc).
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
    ) -> None:
        self._target = target
        self._methods = frozenset(methods)
        self._lock = lock
        self._tls = tls.context() if tls is not None else None
        self._frame_limit = frame_limit
        self._budget = _Budget(max_inflight_bytes)
        self._budget_wait = budget_wait_s
        self._io_timeout = io_timeout_s
        self._served: Counter[str] = Counter()
        self._counting = threading.Lock()  # not ``lock``: the actor may hold it asking stats()
        self._authkey = os.urandom(32)
        self._socket = socket.create_server((host, 0), backlog=_BACKLOG)
        address = self._socket.getsockname()
        self.endpoint: Endpoint = (str(address[0]), int(address[1]), self._authkey)
        self._closed = False
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        # A Ray worker is a child of its node's raylet. Once the raylet is gone (the machine was
        # removed or declared dead) Ray routes no call here any more, but this process may
        # linger a while; its socket must not keep answering for a dead actor.
        self._parent = os.getppid()
        threading.Thread(target=self._accept_loop, name="fastcall-accept", daemon=True).start()

    def stats(self) -> dict[str, Any]:
        """Calls served per method, requests refused ``busy``, request bytes held now and at
        the most so far."""
        budget = self._budget
        with self._counting:
            served = dict(self._served)
        return {
            "served": served,
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
                peer, _ = self._socket.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # out of descriptors or the like: try again, do not spin
                continue
            if not self._handshakes.acquire(blocking=False):
                peer.close()  # unauthenticated peers cost a thread each: no more than this
                continue
            threading.Thread(target=self._serve, args=(peer,), daemon=True).start()

    def _serve(self, peer: socket.socket) -> None:
        try:
            conn = self._handshake(peer)
        finally:
            self._handshakes.release()
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
            budget = self._budget
            why = (
                f"a call of {size} bytes is over the in-flight budget of {budget.limit}"
                if size > budget.limit
                else f"{budget.held} of {budget.limit} in-flight bytes held for "
                f"{self._budget_wait} s"
            )
            return wire.encode((False, f"busy: {why}"))
        try:
            method, args = _request(conn.recv_body(size, deadline))
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
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        host, port, authkey = self.endpoint
        sock = peer
        try:
            peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(peer, server_side=True, do_handshake_on_connect=False)
                _tls_handshake(sock, deadline)
            conn = FastConnection(sock, self._frame_limit)
            server_nonce = os.urandom(_NONCE)
            conn.send_frame([_MAGIC + server_nonce], deadline)
            answer = conn.recv_frame(_ANSWER, deadline)
            nonces = (server_nonce, bytes(answer[:_NONCE]))
            if not hmac.compare_digest(
                bytes(answer[_NONCE:]), _proof(authkey, b"client", nonces, host, port)
            ):
                log.warning("fastcall: a peer without the key was refused")
                sock.close()
                return None
            conn.send_frame([_proof(authkey, b"server", nonces, host, port)], deadline)
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


def _request(frame: bytearray) -> tuple[str, tuple[Any, ...]]:
    """``(method, args)`` of a call frame."""
    call = wire.decode(frame)
    if type(call) is not tuple or len(call) != 2:
        raise WireError("a call is (method, args)")
    method, args = call
    if type(method) is not str or type(args) is not tuple:
        raise WireError("a call is (method: str, args: tuple)")
    return method, args


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
    host, port, authkey = endpoint
    deadline = time.monotonic() + timeout_s
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            sock = _client_context(tls).wrap_socket(
                sock, server_hostname=tls.server_name, do_handshake_on_connect=False
            )
            try:
                _tls_handshake(sock, deadline)
            except ssl.SSLCertVerificationError as error:
                raise PermissionError(f"fastcall: {host}:{port}: {error.verify_message}") from None
        conn = FastConnection(sock, frame_limit)
        try:
            hello = conn.recv_frame(_HELLO, deadline)
        except EOFError:
            raise ConnectionError(f"fastcall: {host}:{port} turned the connection away") from None
        if len(hello) != _HELLO or not hello.startswith(_MAGIC):
            raise PermissionError(f"fastcall: {host}:{port} is not a fastcall server")
        nonces = (bytes(hello[len(_MAGIC) :]), os.urandom(_NONCE))
        conn.send_frame([nonces[1] + _proof(authkey, b"client", nonces, host, port)], deadline)
        try:
            answer = conn.recv_frame(_PROOF, deadline)
        except EOFError:
            raise PermissionError(f"fastcall: {host}:{port} refused the key") from None
        if not hmac.compare_digest(bytes(answer), _proof(authkey, b"server", nonces, host, port)):
            raise PermissionError(f"fastcall: {host}:{port} could not prove the key: an impostor")
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
        when a new connection is not set up, or the call not sent, within ``dial_timeout_s``:
        a caller with a deadline passes what is left of it; a loaded actor may take a while to
        answer, so a short fixed bound would make healthy dials fail), ``TypeError`` for an
        argument the wire does not carry and ``WireError`` for a call over the frame limit
        (both before any socket is used)."""
        parts = wire.encode((method, tuple(args)), self._frame_limit)
        with self._lock:
            conn = self._free.pop() if self._free else None
        if conn is None:
            timeout = max(0.001, min(dial_timeout_s, HANDSHAKE_TIMEOUT_S))
            conn = connect(self.endpoint, timeout, self._tls, self._frame_limit)
        try:
            # Bounded: a batch of shards is more than the socket buffers hold, and a frozen
            # actor would otherwise keep the sender here for good.
            conn.send_frame(parts, time.monotonic() + max(0.001, dial_timeout_s))
        except BaseException:
            conn.close()
            raise
        return conn

    def finish(self, conn: FastConnection) -> Any:
        """The reply of the call sent on ``conn`` (ready: see ``wait_ready``); ``conn`` is
        reused. Raises ``RemoteError`` if the method raised or the actor was too busy
        (``FrameTooLarge``: the answer would not fit a frame), ``OSError``/``EOFError`` if the
        actor went away (or answered a frame that is not a reply: the connection is dropped)."""
        try:
            # Its first bytes are in; the rest must follow within a bound (a frozen actor).
            reply = wire.decode(conn.recv_frame(deadline=time.monotonic() + IO_TIMEOUT_S))
            if type(reply) is not tuple or len(reply) != 2 or type(reply[0]) is not bool:
                raise WireError("a reply is (ok: bool, value)")
        except WireError as error:
            conn.close()
            host, port, _ = self.endpoint
            raise ConnectionError(f"fastcall: {host}:{port} sent a bad reply: {error}") from None
        except BaseException:
            conn.close()
            raise
        with self._lock:
            self._free.append(conn)
        ok, value = reply
        if not ok:
            too_large = str(value).startswith(f"{FrameTooLarge.__name__}:")
            raise (FrameTooLarge if too_large else RemoteError)(value)
        return value

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for conn in free:
            conn.close()


class FastChannels:
    """Channels to many actors, by target name. ``get`` never blocks: the first call to a
    target (and the first after its channel failed) goes through Ray while the actor is asked,
    through Ray too, for its endpoint (``fast_endpoint()``); later calls use the socket
    (``prepare`` asks up front). A target without one (or not answering) is asked again after
    ``retry_s``."""

    def __init__(self, retry_s: float = 1.0, tls: ClientTLS | None = None) -> None:
        self._retry = retry_s
        self._tls = tls
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
            channel = FastChannel((host, port, authkey), self._tls)
            return self._channels.setdefault(target, channel)

    def prepare(self, handles: Mapping[K, Any], timeout_s: float) -> list[K]:
        """Ask every target of ``handles`` (target -> actor handle) without a channel for its
        endpoint, all at once, and wait up to ``timeout_s`` for the answers, so that even the
        first calls go over the sockets; returns the targets still without a channel."""
        for target, handle in handles.items():
            self.get(target, handle)  # starts asking
        with self._lock:
            asking = [self._asking[target] for target in handles if target in self._asking]
        if asking:
            ray.wait(asking, num_returns=len(asking), timeout=max(0.0, timeout_s))
        return [target for target, handle in handles.items() if self.get(target, handle) is None]

    def forget(self, target: Hashable, channel: FastChannel) -> None:
        """The actor behind ``channel`` went away (or restarted on a new port)."""
        with self._lock:
            if self._channels.get(target) is channel:
                del self._channels[target]
        channel.close()


def wait_ready(conns: Collection[FastConnection], timeout: float) -> list[FastConnection]:
    """The connections of ``conns`` with a reply (or EOF) to read, waiting up to ``timeout``."""
    buffered = [conn for conn in conns if conn.pending()]  # TLS read ahead: the fd may be quiet
    by_fd = {conn.fileno(): conn for conn in conns if conn not in buffered}
    if not by_fd:
        return buffered
    ready = wait(list(by_fd), timeout=0.0 if buffered else max(0.0, timeout))
    return buffered + [by_fd[fd] for fd in ready]  # type: ignore[index]
