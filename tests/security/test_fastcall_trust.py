"""The direct socket channel (``kvstore.fastcall``) under attack: each test reproduces
one finding of the security review of issue 15, against real sockets on 127.0.0.1.

Written against the API the channel had before the fix too (``FastCallServer``,
``FastChannel``, ``connect``, ``endpoint``, ``wait_ready``; frames are a 4-byte big-endian
length and the bytes), so each can be run against the old code to see the attack work:

- an impostor at an endpoint, without the key, was accepted by a caller;
- an authenticated peer's pickle ran code in the actor (and an impostor's in the caller);
- every unauthenticated peer got a thread of its own, with no bound.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.fastcall.client import FastChannel, connect
from kvstore.fastcall.frames import wait_ready
from kvstore.fastcall.handshake import HANDSHAKE_TIMEOUT_S
from kvstore.fastcall.server import FastCallServer


class Target:
    def double(self, values: np.ndarray) -> np.ndarray:
        return values * 2


@pytest.fixture
def server() -> Iterator[FastCallServer]:
    lock = threading.Lock()
    served = FastCallServer(Target(), ("double",), lock)
    yield served
    served.close()


def call(endpoint: tuple[str, int, bytes], values: np.ndarray) -> object:
    channel = FastChannel(endpoint)
    try:
        conn = channel.start("double", (values,))
        assert wait_ready([conn], 10.0) == [conn]
        return channel.finish(conn)
    finally:
        channel.close()


def read_frame(sock: socket.socket) -> bytes:
    (size,) = struct.unpack(">I", _read(sock, 4))
    return _read(sock, size)


def _read(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            raise EOFError
        data += more
    return data


def write_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(struct.pack(">I", len(data)) + data)


class WritesMarker:
    """A pickle that creates ``path`` when loaded: stands for any code an attacker picks."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    """Whether the other end hangs up within ``within_s`` (reading whatever it sends first)."""
    sock.settimeout(within_s)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:
        pass  # reset: closed too
    return True


# --- (a) the challenge must authenticate the server too --------------------------------------


class Impostor:
    """Listens on a port of its own, as a local user may on one a restarted actor freed, and
    answers callers with what it can produce without the key: the real server's frames, relayed
    (``relay_to``), or a made-up challenge and a guessed answer (``guess``). Once a caller's
    handshake passes, it answers the first call with a pickle that writes ``marker``."""

    def __init__(
        self,
        marker: Path,
        relay_to: tuple[str, int] | None = None,
        hello: bytes = b"",
        guess: bytes = b"",
    ) -> None:
        self.marker, self.relay_to, self.hello, self.guess = marker, relay_to, hello, guess
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint_address = self.listener.getsockname()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        with client:
            try:
                if self.relay_to is not None:
                    with socket.create_connection(self.relay_to) as real:
                        write_frame(client, read_frame(real))  # the real challenge
                        write_frame(real, read_frame(client))  # the caller's answer to it
                        write_frame(client, read_frame(real))  # the real server's verdict
                else:
                    write_frame(client, self.hello[:-32] + os.urandom(32))  # a made-up nonce
                    read_frame(client)
                    write_frame(client, self.guess)
                read_frame(client)  # the caller's first call, sent to the impostor
                write_frame(client, pickle.dumps(WritesMarker(self.marker)))
                read_frame(client)
            except (OSError, EOFError):
                return

    def close(self) -> None:
        self.listener.close()


def _hello_of(server: FastCallServer) -> bytes:
    """The challenge frame the real server sends (anyone who connects sees one)."""
    with socket.create_connection(server.endpoint[:2]) as sock:
        return read_frame(sock)


def _assert_refused(impostor: Impostor, key: bytes, marker: Path) -> None:
    """A caller dialing the impostor's address with the actor's key refuses it, and runs
    nothing it sent."""
    try:
        host, port = impostor.endpoint_address
        with pytest.raises(PermissionError):
            call((host, port, key), np.ones(2))
        assert not marker.exists()
    finally:
        impostor.close()


def test_an_impostor_relaying_the_real_servers_handshake_is_refused(
    server: FastCallServer, tmp_path: Path
) -> None:
    """The impostor holds no key; it passes the real server's challenge to the caller and the
    caller's answer back. The caller must not take it for the actor."""
    marker = tmp_path / "ran-in-the-caller"
    _assert_refused(Impostor(marker, relay_to=server.endpoint[:2]), server.endpoint[2], marker)


@pytest.mark.parametrize(
    "guess",
    [b"kvstore.fastcall.v1", os.urandom(32)],
    ids=["the-old-welcome", "a-random-proof"],
)
def test_an_impostor_making_up_the_challenge_is_refused(
    server: FastCallServer, tmp_path: Path, guess: bytes
) -> None:
    """The impostor sends a challenge of the real format with a nonce of its own, then the
    best answers it has without the key: the old protocol's public welcome, or random bytes."""
    marker = tmp_path / "ran-in-the-caller"
    _assert_refused(
        Impostor(marker, hello=_hello_of(server), guess=guess), server.endpoint[2], marker
    )


# --- (b) no frame may run code -----------------------------------------------------------------


def test_a_pickle_from_an_authenticated_peer_runs_nothing_and_others_are_served(
    server: FastCallServer, tmp_path: Path
) -> None:
    """A peer holding the key (a compromised gateway, or a frame altered in flight) sends a
    pickle instead of a call: the actor must drop it, not load it."""
    marker = tmp_path / "ran-in-the-actor"
    conn = connect(server.endpoint)
    try:
        conn.send_bytes(pickle.dumps(WritesMarker(marker)))
        with pytest.raises((EOFError, OSError)):  # dropped: no answer comes
            conn.recv_bytes()
    finally:
        conn.close()
    assert not marker.exists()
    assert np.array_equal(call(server.endpoint, np.ones(3)), [2, 2, 2])  # type: ignore[arg-type]


def test_a_pickle_from_an_unauthenticated_peer_runs_nothing_and_others_are_served(
    server: FastCallServer, tmp_path: Path
) -> None:
    marker = tmp_path / "ran-in-the-actor"
    with socket.create_connection(server.endpoint[:2]) as sock:
        read_frame(sock)
        write_frame(sock, pickle.dumps(WritesMarker(marker)))  # as the answer to the challenge
        assert closed_by_peer(sock, HANDSHAKE_TIMEOUT_S + 1.0)
    assert not marker.exists()
    assert np.array_equal(call(server.endpoint, np.ones(3)), [2, 2, 2])  # type: ignore[arg-type]


# --- (c) unauthenticated peers must not cost unbounded threads --------------------------------


def test_a_hundred_unfinished_handshakes_neither_pile_up_threads_nor_shut_a_client_out(
    server: FastCallServer,
) -> None:
    before = threading.active_count()
    silent = [socket.create_connection(server.endpoint[:2]) for _ in range(100)]
    try:
        peak = before
        sampled_until = time.monotonic() + 0.5  # the accept loop takes them all by then
        while time.monotonic() < sampled_until:
            peak = max(peak, threading.active_count())
            time.sleep(0.01)
        assert peak - before <= 24, f"{peak - before} threads for 100 silent peers"
        # A real caller is served within the handshake timeout: at once, or as soon as the
        # silent peers' time is up (turned away meanwhile, it would go through Ray).
        started = time.monotonic()
        while True:
            try:
                answer = call(server.endpoint, np.ones(2))
                break
            except (OSError, EOFError):
                assert time.monotonic() - started < HANDSHAKE_TIMEOUT_S + 1.5
                time.sleep(0.05)
        assert np.array_equal(answer, [2, 2])  # type: ignore[arg-type]
        assert time.monotonic() - started < HANDSHAKE_TIMEOUT_S + 1.5
    finally:
        for sock in silent:
            sock.close()


def test_an_oversized_frame_before_authentication_is_dropped_unread(
    server: FastCallServer,
) -> None:
    """A peer that announces a large frame as its answer to the challenge is dropped at once:
    the server neither waits for nor buffers it."""
    with socket.create_connection(server.endpoint[:2]) as sock:
        read_frame(sock)
        sock.sendall(struct.pack(">I", 1 << 20) + bytes(1024))  # 1 MiB announced
        started = time.monotonic()
        assert closed_by_peer(sock, HANDSHAKE_TIMEOUT_S + 1.0)
        assert time.monotonic() - started < HANDSHAKE_TIMEOUT_S / 2  # not the timeout
    assert np.array_equal(call(server.endpoint, np.ones(1)), [2])  # type: ignore[arg-type]
