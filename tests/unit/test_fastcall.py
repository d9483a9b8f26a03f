"""The direct socket channel of the hot calls: real sockets on 127.0.0.1, no Ray."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvstore.runtime.fastcall import (
    HANDSHAKE_TIMEOUT_S,
    FastCallServer,
    FastChannel,
    RemoteError,
    connect,
    wait_ready,
)


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
