"""The direct socket channel of the hot calls: real sockets on 127.0.0.1, no Ray."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from certs import self_signed

from kvstore.fastcall import server as fastcall_server
from kvstore.fastcall.admission import MAX_HANDSHAKES, MAX_HANDSHAKES_PER_SOURCE
from kvstore.fastcall.client import FastChannel, connect
from kvstore.fastcall.frames import RemoteError, wait_ready
from kvstore.fastcall.handshake import HANDSHAKE_TIMEOUT_S
from kvstore.fastcall.server import FastCallServer
from kvstore.fastcall.tls import ClientTLS, ServerTLS


class Target:
    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self.calls = 0

    def double(self, values: np.ndarray) -> np.ndarray:
        assert self.lock.locked(), "served without the actor's lock"
        self.calls += 1
        return values * 2

    def fail(self) -> None:
        raise ValueError("keys[3]: must be 32 bytes")

    def private(self) -> str:
        return "never served"


@pytest.fixture
def served() -> tuple[FastCallServer, Target]:
    lock = threading.Lock()
    target = Target(lock)
    server = FastCallServer(target, ("double", "fail"), lock)
    yield server, target
    server.close()


def _call(channel: FastChannel, method: str, *args: object) -> object:
    conn = channel.start(method, args)
    assert wait_ready([conn], 10.0) == [conn]
    return channel.finish(conn)


def test_a_call_round_trips_arrays_and_reuses_its_connection(served) -> None:
    server, target = served
    channel = FastChannel(server.endpoint)
    values = np.arange(1000, dtype=np.uint64).reshape(250, 4)
    for _ in range(3):
        got = _call(channel, "double", values)
        assert isinstance(got, np.ndarray) and np.array_equal(got, values * 2)
    assert target.calls == 3
    assert len(channel._free) == 1  # one socket served all three calls
    channel.close()


def test_errors_name_the_method_or_the_exception_and_the_server_keeps_serving(served) -> None:
    server, _ = served
    channel = FastChannel(server.endpoint)
    with pytest.raises(RemoteError, match="no fast method 'private'"):
        _call(channel, "private")
    with pytest.raises(RemoteError, match=r"ValueError: keys\[3\]: must be 32 bytes"):
        _call(channel, "fail")
    assert np.array_equal(_call(channel, "double", np.ones(3)), np.full(3, 2.0))


def test_a_peer_without_the_key_is_refused_and_others_are_still_served(served) -> None:
    server, _ = served
    host, port, _key = server.endpoint
    with pytest.raises(PermissionError):
        connect((host, port, b"not the key"))
    assert np.array_equal(_call(FastChannel(server.endpoint), "double", np.ones(2)), [2, 2])


def test_a_silent_peer_holds_up_no_one(served) -> None:
    server, _ = served
    host, port, _key = server.endpoint
    with socket.create_connection((host, port)):  # connects, never answers the challenge
        assert np.array_equal(_call(FastChannel(server.endpoint), "double", np.ones(1)), [2])


def test_concurrent_callers_each_get_their_own_answer(served) -> None:
    server, _ = served
    channel = FastChannel(server.endpoint)
    wrong: list[int] = []

    def caller(offset: int) -> None:
        for step in range(50):
            value = np.array([offset * 1000 + step])
            if _call(channel, "double", value)[0] != value[0] * 2:  # type: ignore[index]
                wrong.append(offset)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def _serve_in_child(ready: Any) -> None:
    lock = threading.Lock()
    server = FastCallServer(Target(lock), ("double",), lock)
    ready.send((server.endpoint, os.getpid()))
    threading.Event().wait()  # serve until killed


def _serve_in_orphan(ready: Any) -> None:
    """Like a Ray worker whose raylet dies: the server's parent exits, the server lives on.
    The parent exits only once the server is up (it noted its parent while the parent lived,
    as a Ray worker does at start): exiting sooner raced the server's start."""
    context = multiprocessing.get_context("fork")
    mine, theirs = context.Pipe()
    inner = context.Process(target=_serve_in_child, args=(theirs,))
    inner.start()
    ready.send(mine.recv())
    os._exit(0)


def test_a_dead_server_fails_the_call_instead_of_hanging() -> None:
    context = multiprocessing.get_context("fork")
    mine, theirs = context.Pipe()
    child = context.Process(target=_serve_in_child, args=(theirs,), daemon=True)
    child.start()
    try:
        endpoint, _pid = mine.recv()
        channel = FastChannel(endpoint)
        assert _call(channel, "double", np.ones(1))[0] == 2  # type: ignore[index]
    finally:
        child.kill()
        child.join()
    with pytest.raises((OSError, EOFError)):  # the pooled socket: EOF, not a hang
        _call(channel, "double", np.ones(1))
    with pytest.raises(OSError):  # and a new one cannot connect
        _call(channel, "double", np.ones(1))


def test_a_server_whose_parent_died_stops_answering() -> None:
    context = multiprocessing.get_context("fork")
    mine, theirs = context.Pipe()
    parent = context.Process(target=_serve_in_orphan, args=(theirs,))
    parent.start()
    endpoint, pid = mine.recv()
    parent.join()  # the "raylet" is gone; the server process is still running
    try:
        channel = FastChannel(endpoint)
        with pytest.raises((OSError, EOFError)):  # a zombie actor never answers
            _call(channel, "double", np.ones(1))
    finally:
        os.kill(pid, signal.SIGKILL)


def test_dialing_an_endpoint_that_never_answers_gives_up_within_the_callers_deadline() -> None:
    """The kernel accepts for a process that no longer runs its server (a removed machine's
    lingering worker): a new connection fails once the caller's time is up, not after the
    handshake's own 2 s."""
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        channel = FastChannel((*silent.getsockname(), b"k" * 32))
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            channel.start("double", (np.ones(1),), dial_timeout_s=0.2)
        assert time.monotonic() - started < HANDSHAKE_TIMEOUT_S
    finally:
        silent.close()


def test_after_reply_work_runs_once_the_reply_is_out() -> None:
    """A target's ``after_reply`` (a lookup's riding releases) never adds to the call's
    latency: it runs after the reply is sent, under the actor's lock."""
    lock = threading.Lock()
    replied = threading.Event()
    after_ran = threading.Event()

    class Deferring(Target):
        def after_reply(self) -> None:
            assert self.lock.locked(), "after_reply ran without the actor's lock"
            # Were this run before the reply was sent, the caller would never get it to set
            # ``replied``: the wait below would time out.
            assert replied.wait(10), "after_reply ran before the reply was out"
            after_ran.set()

    target = Deferring(lock)
    server = FastCallServer(target, ("double",), lock)
    try:
        channel = FastChannel(server.endpoint)
        assert np.array_equal(_call(channel, "double", np.arange(3)), [0, 2, 4])
        replied.set()
        assert after_ran.wait(10)
    finally:
        server.close()


# --- the wire: data only, bounded ---------------------------------------------------------------


def test_an_argument_the_wire_does_not_carry_is_refused_before_any_socket_is_used(
    served,
) -> None:
    server, _ = served
    channel = FastChannel(server.endpoint)
    _call(channel, "double", np.ones(1))
    with pytest.raises(TypeError, match="cannot cross the wire"):
        channel.start("double", (object(),))
    assert len(channel._free) == 1  # the pooled connection was not spent on it
    assert np.array_equal(_call(channel, "double", np.ones(2)), [2, 2])


def test_an_answer_the_wire_does_not_carry_is_a_remote_error() -> None:
    lock = threading.Lock()

    class Odd(Target):
        def odd(self) -> object:
            return {1, 2}

    server = FastCallServer(Odd(lock), ("odd", "double"), lock)
    try:
        channel = FastChannel(server.endpoint)
        with pytest.raises(RemoteError, match="TypeError: builtins.set cannot cross the wire"):
            _call(channel, "odd")
        assert np.array_equal(_call(channel, "double", np.ones(1)), [2])  # same connection
    finally:
        server.close()


def test_a_frame_over_the_limit_drops_only_that_peer() -> None:
    lock = threading.Lock()
    server = FastCallServer(Target(lock), ("double",), lock, frame_limit=4096)
    try:
        big = FastChannel(server.endpoint)
        with pytest.raises((OSError, EOFError)):
            _call(big, "double", np.ones(1024))  # 8 KiB: the server hangs up unread
        assert np.array_equal(_call(FastChannel(server.endpoint), "double", np.ones(4)), [2] * 4)
    finally:
        server.close()


class WritesMarker:
    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def test_a_key_holding_peer_answering_a_pickle_runs_nothing_in_the_caller(tmp_path: Path) -> None:
    """Even a peer that passes the challenge (it holds the key) cannot make the caller load
    code: the reply is refused and the connection dropped, as a broken one is."""
    marker = tmp_path / "ran-in-the-caller"
    listener = socket.create_server(("127.0.0.1", 0))
    lock = threading.Lock()
    rogue = FastCallServer(Target(lock), (), lock)  # its handshake, on the listener's address
    rogue.close()
    rogue.endpoint = (*listener.getsockname(), rogue.endpoint[2])

    def serve() -> None:
        peer, _ = listener.accept()
        conn = rogue._handshake(peer)
        assert conn is not None
        conn.recv_frame()
        conn.send_bytes(pickle.dumps(WritesMarker(marker)))
        with pytest.raises(EOFError):
            conn.recv_frame(deadline=time.monotonic() + 10)  # the caller hangs up

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        channel = FastChannel(rogue.endpoint)
        with pytest.raises(ConnectionError, match="bad reply"):
            _call(channel, "double", np.ones(1))
        assert not channel.idle()  # that connection is gone, not pooled
        thread.join(10)
        assert not marker.exists()
    finally:
        listener.close()


# --- the handshake: mutual, bounded ----------------------------------------------------------


def test_the_handshake_ends_in_time_however_slowly_a_peer_sends(served, monkeypatch) -> None:
    server, _ = served
    monkeypatch.setattr(fastcall_server, "UNAUTHENTICATED_S", 0.5)
    with socket.create_connection(server.endpoint[:2]) as sock:
        started = time.monotonic()
        sock.recv(4096)  # the challenge
        sock.sendall(struct.pack(">I", 64))
        sock.settimeout(0.1)
        closed = False
        while time.monotonic() - started < 3.0 and not closed:
            try:
                sock.sendall(b"x")  # a byte at a time, each well within any per-read timeout
                closed = sock.recv(1) == b""
            except TimeoutError:
                continue
            except OSError:
                closed = True
        assert closed and time.monotonic() - started < 1.5


def silent_peers(host: str, port: int, sources: list[str]) -> list[socket.socket]:
    """A connection from each of ``sources`` that got its challenge and says nothing."""
    peers = []
    for source in sources:
        sock = socket.socket()
        sock.bind((source, 0))
        sock.connect((host, port))
        peers.append(sock)
    for sock in peers:
        sock.recv(4096)  # each is being handshaken: it got its challenge
    return peers


@pytest.mark.parametrize("limit", ["per source", "in all"])
def test_peers_beyond_the_handshake_limit_are_turned_away_at_once(served, limit: str) -> None:
    server, _ = served
    host, port, _ = server.endpoint
    if limit == "per source":  # one address's share: others may still dial
        silent = silent_peers(host, port, ["127.0.0.1"] * MAX_HANDSHAKES_PER_SOURCE)
    else:  # every slot, one per address: no source holds more than the newcomer would, so
        # no handshake is evicted for it (a busier source's would be: test_fastcall_flood)
        silent = silent_peers(host, port, [f"127.0.1.{i + 1}" for i in range(MAX_HANDSHAKES)])
    try:
        started = time.monotonic()
        with pytest.raises(ConnectionError, match="turned the connection away"):
            connect(server.endpoint)
        assert time.monotonic() - started < HANDSHAKE_TIMEOUT_S / 2  # not after a timeout
        if limit == "per source":
            from_elsewhere = socket.socket()
            from_elsewhere.bind(("127.0.0.3", 0))
            from_elsewhere.connect((host, port))
            with from_elsewhere:
                assert from_elsewhere.recv(4096)  # its challenge: a slot of its own
    finally:
        for sock in silent:
            sock.close()  # their handshakes end at once: room again
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    while True:
        try:
            connect(server.endpoint).close()
            break
        except ConnectionError:
            assert time.monotonic() < deadline
            time.sleep(0.02)


# --- TLS -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> dict[str, tuple[str, str]]:
    folder = tmp_path_factory.mktemp("tls")
    return {name: self_signed(folder, name, common_name=name) for name in ("server", "other")}


@pytest.fixture
def tls_served(certificates) -> tuple[FastCallServer, Target]:
    lock = threading.Lock()
    target = Target(lock)
    server = FastCallServer(target, ("double",), lock, tls=ServerTLS(*certificates["server"]))
    yield server, target
    server.close()


def test_a_call_round_trips_over_tls(tls_served, certificates) -> None:
    server, target = tls_served
    for trust in (
        ClientTLS(certificates["server"][0]),
        ClientTLS(certificates["server"][0], "localhost"),
    ):
        channel = FastChannel(server.endpoint, tls=trust)
        values = np.arange(4000, dtype=np.uint64).reshape(1000, 4)
        for _ in range(2):
            assert np.array_equal(_call(channel, "double", values), values * 2)
        assert len(channel._free) == 1
        channel.close()
    assert target.calls == 4


def test_a_tls_client_refuses_a_certificate_its_ca_did_not_sign(tls_served, certificates) -> None:
    server, target = tls_served
    with pytest.raises(PermissionError, match="certificate"):
        connect(server.endpoint, tls=ClientTLS(certificates["other"][0]))
    with pytest.raises(PermissionError, match="(?i)hostname"):  # right CA, another name
        connect(server.endpoint, tls=ClientTLS(certificates["server"][0], "elsewhere"))
    assert target.calls == 0


def test_a_plain_client_gets_nothing_from_a_tls_server(tls_served) -> None:
    server, target = tls_served
    with pytest.raises(TimeoutError):  # it waits for a challenge that TLS never sends in clear
        connect(server.endpoint, timeout_s=0.3)
    assert target.calls == 0
