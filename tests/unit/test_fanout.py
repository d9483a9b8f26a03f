"""The call seam: typed calls through ``LocalFanout``, ``gather`` under one deadline, and the
deadline rules of ``RayFanout``'s direct socket path (real sockets on 127.0.0.1, no Ray: the
actor handles are fakes whose Ray calls fail at once, as a gone actor's would)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import pytest
from ray.exceptions import RayError

from kvstore.blockstore.calls import StorageNodeCalls, node_target
from kvstore.blockstore.fanout import ENTRY, NODE, LocalFanout, Target, Ticket, gather
from kvstore.errors import NodeUnavailable
from kvstore.fastcall.client import FastChannel
from kvstore.fastcall.server import FastCallServer
from kvstore.runtime.fanout import RayFanout


class Node:
    """Stands for a storage node: only what these tests call."""

    def __init__(self, node_id: int) -> None:
        self.node_id = node_id
        self.deleted: list[tuple[list[bytes], float | None]] = []

    def ping(self) -> int:
        return self.node_id

    def delete(self, keys: list[bytes], not_after: float | None = None) -> int:
        self.deleted.append((keys, not_after))
        return len(keys)


class RecordingFanout(LocalFanout):
    def __init__(self, targets: dict[Any, object]) -> None:
        super().__init__(targets)
        self.cancelled: list[Ticket[Any]] = []

    def cancel(self, tickets: Iterable[Ticket[Any]]) -> None:
        self.cancelled.extend(tickets)


def test_calls_dispatch_by_the_protocol_methods_name_with_keyword_arguments() -> None:
    nodes = {i: Node(i) for i in range(3)}
    fanout = LocalFanout({node_target(i): node for i, node in nodes.items()})
    ticket = fanout.submit(node_target(1), StorageNodeCalls.delete, [b"k"], not_after=5.0)
    assert fanout.result(ticket) == 1
    assert nodes[1].deleted == [([b"k"], 5.0)]
    assert fanout.calls == [((NODE, 1), "delete")]  # targets equal their plain tuples


def test_gather_keeps_the_order_given_and_names_what_did_not_answer() -> None:
    fanout = RecordingFanout({node_target(i): Node(i) for i in range(4)})
    fanout.dead.add((NODE, 1))
    fanout.hung.add((NODE, 2))
    tickets = [fanout.submit(node_target(i), StorageNodeCalls.ping) for i in (3, 2, 1, 0)]
    started = time.monotonic()
    outcomes = gather(fanout, tickets, 0.2)
    assert time.monotonic() - started >= 0.2  # the hung one was waited for, to the deadline
    assert list(outcomes) == tickets
    assert outcomes[tickets[0]] == 3 and outcomes[tickets[3]] == 0
    assert isinstance(outcomes[tickets[2]], NodeUnavailable)  # dead
    late = outcomes[tickets[1]]
    assert isinstance(late, NodeUnavailable) and "node 2.ping did not answer" in str(late)
    assert fanout.cancelled == [tickets[1]]  # only the call given up on


# --- RayFanout's direct socket path ----------------------------------------------------------


class EntryCalls(Protocol):
    """What these tests' stand-in entrypoints answer."""

    def lookup(self, keys: list[str]) -> list[str]: ...


class Entry:
    def __init__(self, name: str) -> None:
        self.name = name
        self.served_at: list[float] = []
        self.hold = threading.Event()
        self.hold.set()

    def lookup(self, keys: list[str]) -> list[str]:
        self.served_at.append(time.monotonic())
        self.hold.wait(10)
        return [f"{self.name}:{key}" for key in keys]


class FakeHandle:
    """An actor handle whose every Ray call fails at once (records which were tried)."""

    def __init__(self) -> None:
        self.tried: list[str] = []

    def __getattr__(self, method: str) -> Any:
        handle = self

        class Method:
            def remote(self, *args: Any, **kwargs: Any) -> Any:
                handle.tried.append(method)
                raise RayError(f"no Ray here ({method})")

        return Method()


class Entrypoints:
    """Three entrypoints served over real sockets, reached through one ``RayFanout`` (handles
    found by its resolver) whose channels already hold an open connection each."""

    names = ("e0", "e1", "e2")

    def __init__(self) -> None:
        self.entries = {name: Entry(name) for name in self.names}
        self.handles = {Target(ENTRY, name): FakeHandle() for name in self.names}
        self.servers = []
        self.fanout = RayFanout({}, resolve=self.handles.get, fast_methods=(EntryCalls.lookup,))
        for name, entry in self.entries.items():
            lock = threading.Lock()
            server = FastCallServer(entry, ("lookup",), lock)
            self.servers.append(server)
            self.channels[self.target(name)] = FastChannel(server.endpoint)
        assert self.lookup(1.0) == {name: [f"{name}:k"] for name in self.names}
        assert all(channel.idle() for channel in self.channels.values())
        for entry in self.entries.values():
            entry.served_at.clear()

    @property
    def channels(self) -> dict[Any, FastChannel]:
        return self.fanout._fast._channels  # type: ignore[return-value]

    @staticmethod
    def target(name: str) -> Target[EntryCalls]:
        return Target(ENTRY, name)

    def lookup(self, timeout: float, first: str = "e0") -> dict[str, Any]:
        order = [first] + [name for name in self.names if name != first]
        tickets = {
            self.fanout.submit(self.target(name), EntryCalls.lookup, ["k"]): name for name in order
        }
        return {tickets[t]: outcome for t, outcome in gather(self.fanout, tickets, timeout).items()}

    def close(self) -> None:
        for entry in self.entries.values():
            entry.hold.set()
        for server in self.servers:
            server.close()


@pytest.fixture
def entrypoints() -> Iterator[Entrypoints]:
    made = Entrypoints()
    yield made
    made.close()


def test_a_silent_endpoint_delays_no_other_target_and_is_forgotten(
    entrypoints: Entrypoints,
) -> None:
    """A removed machine's worker may linger: the kernel accepts on its socket, nobody answers.
    Submitted first, its dial must hold up none of the calls over open connections, be given
    up at the caller's deadline, and leave the next call to ask Ray."""
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        victim = entrypoints.target("e0")
        entrypoints.channels[victim] = FastChannel((*silent.getsockname(), b"k" * 32))
        timeout = 1.0
        started = time.monotonic()
        answers = entrypoints.lookup(timeout, first="e0")
        elapsed = time.monotonic() - started
        assert answers["e1"] == ["e1:k"] and answers["e2"] == ["e2:k"]
        assert isinstance(answers["e0"], NodeUnavailable)
        assert elapsed < timeout + 0.5  # not the handshake's own 2 s
        for name in ("e1", "e2"):  # sent before the dial, not after it gave up
            assert entrypoints.entries[name].served_at[0] - started < timeout / 2
        assert victim not in entrypoints.channels  # forgotten: the next call asks Ray
        assert entrypoints.handles[victim].tried == []  # its dial was abandoned at the deadline
        entrypoints.lookup(timeout)
        assert entrypoints.handles[victim].tried == ["fast_endpoint", "lookup"]
    finally:
        silent.close()


def _dials_behind_a_silent_one(entrypoints: Entrypoints) -> socket.socket:
    """e0's channel points at a socket the kernel accepts on for nobody (a host cut off
    answers no better); e1's and e2's channels have no connection open: every call dials."""
    silent = socket.create_server(("127.0.0.1", 0))
    entrypoints.channels[entrypoints.target("e0")] = FastChannel((*silent.getsockname(), b"k" * 32))
    for name, server in zip(entrypoints.names[1:], entrypoints.servers[1:], strict=True):
        entrypoints.channels[entrypoints.target(name)] = FastChannel(server.endpoint)
    return silent


def test_a_dial_that_hangs_holds_up_no_other_dial_nor_the_replies(
    entrypoints: Entrypoints,
) -> None:
    """A host cut off mid-read: the calls to its actor hang, so the hedge's calls to it need new
    connections, whose dials hang too. Dialed first, it must not hold up the dials of the
    healthy actors (a partition test missed blocks that way), nor the reading of their
    replies: the wait returns with them well before its deadline."""
    silent = _dials_behind_a_silent_one(entrypoints)
    try:
        fanout = entrypoints.fanout
        tickets = {
            fanout.submit(entrypoints.target(name), EntryCalls.lookup, ["k"]): name
            for name in entrypoints.names  # e0 first
        }
        started = time.monotonic()
        healthy = [t for t, name in tickets.items() if name != "e0"]
        ready: list[Any] = []
        while len(ready) < len(healthy) and time.monotonic() - started < 1.5:
            ready += fanout.wait([t for t in tickets if t not in ready], 1.5)
        elapsed = time.monotonic() - started
        assert sorted(tickets[t] for t in ready) == ["e1", "e2"], elapsed
        assert elapsed < 1.0  # not after e0's dial gave up (its bound: the handshake's 2 s)
        assert [fanout.result(t) for t in healthy] == [["e1:k"], ["e2:k"]]
        outcomes = gather(fanout, tickets, 0.3)
        assert isinstance(outcomes[next(iter(tickets))], NodeUnavailable)
        assert entrypoints.target("e0") not in entrypoints.channels  # its dial was abandoned
    finally:
        silent.close()


def test_gather_async_does_not_wait_on_a_hung_dial_either(entrypoints: Entrypoints) -> None:
    import asyncio

    from kvstore.blockstore.fanout import gather_async

    silent = _dials_behind_a_silent_one(entrypoints)
    try:
        fanout = entrypoints.fanout
        tickets = [
            fanout.submit(entrypoints.target(name), EntryCalls.lookup, ["k"])
            for name in entrypoints.names
        ]
        started = time.monotonic()
        outcomes = list(asyncio.run(gather_async(fanout, tickets, 1.0)).values())
        assert time.monotonic() - started < 1.5
        assert outcomes[1:] == [["e1:k"], ["e2:k"]]
        assert isinstance(outcomes[0], NodeUnavailable)
        for name in ("e1", "e2"):  # sent at once, not after e0's dial
            assert entrypoints.entries[name].served_at[0] - started < 0.5
    finally:
        silent.close()


def test_a_reply_past_the_deadline_closes_its_connection_and_forgets_the_endpoint(
    entrypoints: Entrypoints,
) -> None:
    slow = entrypoints.entries["e1"]
    target = entrypoints.target("e1")
    channel = entrypoints.channels[target]
    slow.hold.clear()
    started = time.monotonic()
    answers = entrypoints.lookup(0.3)
    assert time.monotonic() - started < 0.3 + 0.5
    assert answers["e0"] == ["e0:k"] and answers["e2"] == ["e2:k"]
    assert isinstance(answers["e1"], NodeUnavailable)
    assert target not in entrypoints.channels and not channel.idle()  # its socket is gone
    slow.hold.set()  # the late reply goes out now, to a closed connection
    entrypoints.lookup(1.0)
    assert entrypoints.handles[target].tried == ["fast_endpoint", "lookup"]  # asked Ray
    # Ray found the same endpoint again: a new connection, which never sees the late reply.
    entrypoints.channels[target] = channel
    slow.served_at.clear()
    assert entrypoints.lookup(1.0)["e1"] == ["e1:k"]
    assert len(slow.served_at) == 1


def test_gather_async_gives_the_same_outcomes_and_bounds_a_hung_target() -> None:
    import asyncio
    import time

    from kvstore.blockstore.fanout import META, LocalFanout, Target, gather_async

    class Shard:
        def echo(self, value: int) -> int:
            return value

    fanout = LocalFanout({Target(META, i): Shard() for i in range(3)})
    fanout.hung.add(Target(META, 2))
    tickets = [fanout.submit(Target(META, i), Shard.echo, i) for i in range(3)]  # type: ignore[arg-type]
    started = time.monotonic()
    outcomes = asyncio.run(gather_async(fanout, tickets, 0.2))
    assert 0.2 <= time.monotonic() - started < 2.0
    values = list(outcomes.values())
    assert values[:2] == [0, 1]
    assert isinstance(values[2], NodeUnavailable) and "did not answer" in str(values[2])
