"""The direct socket as a data plane: its in-flight budget, bounded sends and reads, batches of
shards. Real sockets on 127.0.0.1, no Ray.

The budget tests serve a method that blocks until the test lets it go, behind a lock that does
not exclude (``Overlapping``): every request the server let in then sits inside the method at
once, so what the method sees is the server's real concurrency, measured apart from the
server's own bookkeeping."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from certs import self_signed

from kvstore import wire
from kvstore.blockstore.fanout import NODE, Target, gather
from kvstore.blockstore.records import PutStatus
from kvstore.errors import NodeUnavailable
from kvstore.fastcall.client import FastChannel, connect
from kvstore.fastcall.frames import RemoteError, wait_ready
from kvstore.fastcall.server import FastCallServer
from kvstore.fastcall.tls import ClientTLS, ServerTLS
from kvstore.runtime.fanout import RayFanout

BUDGET = 1 << 20
CHUNK = 300_000  # three fit in the budget with their headers, four do not


class Overlapping:
    """A lock that lets everyone in: the target's calls overlap as far as the server allows."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class Holder:
    """``hold`` keeps its caller until ``gate`` opens and records the bytes inside at once."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self._count = threading.Lock()
        self.inside = 0
        self.inside_calls = 0
        self.peak = 0

    def hold(self, blob: np.ndarray) -> int:
        with self._count:
            self.inside += blob.nbytes
            self.inside_calls += 1
            self.peak = max(self.peak, self.inside)
        try:
            assert self.gate.wait(30), "the test never opened the gate"
        finally:
            with self._count:
                self.inside -= blob.nbytes
                self.inside_calls -= 1
        return blob.nbytes

    def size(self, blob: np.ndarray) -> int:
        """What ``hold`` answers, at once."""
        return blob.nbytes


def serve(holder: Holder, **options: Any) -> FastCallServer:
    return FastCallServer(
        holder, ("hold", "size"), Overlapping(), max_inflight_bytes=BUDGET, **options
    )  # type: ignore[arg-type]


def call(channel: FastChannel, method: str, *args: object) -> Any:
    conn = channel.start(method, args)
    assert wait_ready([conn], 30.0) == [conn]
    return channel.finish(conn)


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


@pytest.fixture
def holder() -> Iterator[Holder]:
    made = Holder()
    yield made
    made.gate.set()


def test_the_budget_bounds_the_request_bytes_inside_the_server_at_once(holder: Holder) -> None:
    server = serve(holder, budget_wait_s=30.0)
    holder.gate.clear()
    answers: list[Any] = []

    def client() -> None:
        answers.append(call(FastChannel(server.endpoint), "hold", np.ones(CHUNK, np.uint8)))

    threads = [threading.Thread(target=client) for _ in range(6)]
    try:
        for thread in threads:
            thread.start()
        until(lambda: holder.inside_calls == 3, "three requests inside")
        until(lambda: server.stats()["inflight_bytes"] > 3 * CHUNK, "their bytes counted")
        # The other three wait for the budget, their bodies unread; none gets in meanwhile.
        time.sleep(0.3)
        assert holder.inside_calls == 3
        assert server.stats()["inflight_bytes"] <= BUDGET
        holder.gate.set()
        for thread in threads:
            thread.join(30)
    finally:
        holder.gate.set()
        server.close()
    assert answers == [CHUNK] * 6  # every call was served in the end
    assert 3 * CHUNK <= holder.peak <= BUDGET
    until(lambda: server.stats()["inflight_bytes"] == 0, "every reservation given back")
    stats = server.stats()  # (a reply is out a moment before its bytes are given back)
    assert stats["inflight_peak"] <= BUDGET
    assert stats["served"] == {"hold": 6} and stats["refused_busy"] == 0


def test_a_request_larger_than_the_budget_is_refused_and_its_connection_serves_on(
    holder: Holder,
) -> None:
    server = serve(holder)
    try:
        channel = FastChannel(server.endpoint)
        with pytest.raises(RemoteError, match="over the in-flight budget"):
            call(channel, "hold", np.ones(BUDGET + 1, np.uint8))
        assert channel.idle()  # the body was read into nothing: the stream is in step
        assert call(channel, "size", np.ones(10, np.uint8)) == 10
        assert server.stats()["refused_busy"] == 1
    finally:
        server.close()


def test_a_spent_budget_answers_busy_while_others_are_served_and_is_not_retried_through_ray(
    holder: Holder,
) -> None:
    """The caller sees a failed call (``NodeUnavailable``), not a hang, and its fanout does not
    send the same bytes again through Ray: the node is too busy either way."""
    server = serve(holder, budget_wait_s=0.2)
    handle = RayLess()
    target = Target(NODE, 0)
    fanout = RayFanout({target: handle}, fast_methods=(Holder.hold,))
    fanout._fast._channels[target] = FastChannel(server.endpoint)  # as prepare leaves it
    blocker = threading.Thread(
        target=call, args=(FastChannel(server.endpoint), "hold", np.ones(900_000, np.uint8))
    )
    try:
        holder.gate.clear()
        blocker.start()
        until(lambda: holder.inside_calls == 1, "the budget held")
        ticket = fanout.submit(target, Holder.hold, np.ones(CHUNK, np.uint8))  # type: ignore[arg-type]
        outcome = gather(fanout, [ticket], 10.0)[ticket]
        assert isinstance(outcome, NodeUnavailable) and "busy" in str(outcome)
        assert handle.tried == []  # no Ray call
        assert call(FastChannel(server.endpoint), "size", np.ones(1000, np.uint8)) == 1000
        holder.gate.set()
        blocker.join(30)
        ticket = fanout.submit(target, Holder.hold, np.ones(CHUNK, np.uint8))  # type: ignore[arg-type]
        assert gather(fanout, [ticket], 10.0)[ticket] == CHUNK  # the budget is back
    finally:
        holder.gate.set()
        server.close()
    assert server.stats()["refused_busy"] == 1


def test_a_peer_stalled_mid_request_gives_its_bytes_back(holder: Holder) -> None:
    server = serve(holder, io_timeout_s=1.0)
    try:
        stalled = connect(server.endpoint)
        stalled._sock.sendall((900_000).to_bytes(4, "big") + b"t" * 10)  # a length, a crumb
        until(lambda: server.stats()["inflight_bytes"] == 900_000, "the request reserved")
        until(lambda: server.stats()["inflight_bytes"] == 0, "the reservation given back")
        with pytest.raises((EOFError, OSError)):  # and the stalled peer dropped
            stalled.recv_frame(deadline=time.monotonic() + 10)
        stalled.close()
        assert call(FastChannel(server.endpoint), "hold", np.ones(900_000, np.uint8)) == 900_000
    finally:
        server.close()


def test_sending_to_an_actor_that_stopped_reading_fails_within_the_callers_bound() -> None:
    """A frozen actor (authenticated, then silent) takes no more of a batch than the socket
    buffers hold: the sender gives up at its bound instead of waiting for good."""
    listener = socket.create_server(("127.0.0.1", 0))
    frozen = FastCallServer(Holder(), (), threading.Lock())
    frozen.close()
    frozen.endpoint = (*listener.getsockname(), frozen.endpoint[2])
    accepted: list[Any] = []

    def handshake_then_freeze() -> None:
        peer, _ = listener.accept()
        accepted.append(frozen._handshake(peer))  # kept open, never read

    thread = threading.Thread(target=handshake_then_freeze, daemon=True)
    thread.start()
    try:
        channel = FastChannel(frozen.endpoint)
        with pytest.raises(TimeoutError):
            channel.start("hold", (np.ones(32 << 20, np.uint8),), dial_timeout_s=0.5)
        assert not channel.idle()  # the half-sent connection is gone
    finally:
        thread.join(10)
        for conn in accepted:
            if conn is not None:
                conn.close()
        listener.close()


class Shards:
    def get(self, keys: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        lengths = np.full(len(keys), 11_405, np.int64)
        return np.arange(int(lengths.sum()), dtype=np.uint64).astype(np.uint8), lengths

    def put(
        self,
        token: int,
        keys: list[bytes],
        shards: list[np.ndarray],
        class_ids: list[int],
        created: list[float],
    ) -> list[bool]:
        return [shard.size == 11_405 and shard[0] == i % 256 for i, shard in enumerate(shards)]

    def begin_put(self, keys: list[bytes], token: int) -> list[int]:
        return [PutStatus.GRANTED, PutStatus.EXISTS, PutStatus.BUSY][: len(keys)]


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "tls"])
def test_a_batch_of_shards_and_a_writers_token_cross_whole(secure: bool, tmp_path: Path) -> None:
    """More arrays than one ``sendmsg`` takes, a reply bigger than the socket buffers, a u64
    writer token and ``PutStatus`` answers: what the write and read paths send."""
    tls_server = tls_client = None
    if secure:
        cert, key = self_signed(tmp_path)
        tls_server, tls_client = ServerTLS(cert, key), ClientTLS(cert, "localhost")
    lock = threading.Lock()
    server = FastCallServer(Shards(), ("get", "put", "begin_put"), lock, tls=tls_server)
    try:
        channel = FastChannel(server.endpoint, tls_client)
        shards = [np.full(11_405, i % 256, np.uint8) for i in range(700)]
        token = (1 << 64) - 1  # a random 64-bit token is above i64 half the time
        keys = [bytes([i % 256]) * 32 for i in range(700)]
        acks = call(channel, "put", token, keys, shards, [0] * 700, [1.5] * 700)
        assert acks == [True] * 700
        buffer, lengths = call(channel, "get", keys[:64])
        assert buffer.nbytes == 64 * 11_405 and lengths.tolist() == [11_405] * 64
        answers = call(channel, "begin_put", keys[:3], token)
        assert answers == [PutStatus.GRANTED, PutStatus.EXISTS, PutStatus.BUSY]
    finally:
        server.close()


def test_a_call_the_wire_cannot_carry_goes_through_ray_and_keeps_the_channel() -> None:
    lock = threading.Lock()
    server = FastCallServer(Shards(), ("get",), lock, frame_limit=1 << 16)
    handle = RayLess()
    target = Target(NODE, 0)
    fanout = RayFanout({target: handle}, fast_methods=(Shards.get,))
    channel = FastChannel(server.endpoint, frame_limit=1 << 16)
    fanout._fast._channels[target] = channel
    try:
        too_big = [bytes(32)] * 4096  # 128 KiB of keys: over this channel's frame limit
        ticket = fanout.submit(target, Shards.get, too_big)  # type: ignore[arg-type]
        assert isinstance(gather(fanout, [ticket], 1.0)[ticket], NodeUnavailable)
        assert handle.tried == ["get"]  # through Ray (which has none here)
        assert fanout._fast._channels[target] is channel  # the socket is still fine
        ticket = fanout.submit(target, Shards.get, [bytes(32)])  # type: ignore[arg-type]
        assert gather(fanout, [ticket], 10.0)[ticket][1].tolist() == [11_405]
    finally:
        server.close()


def test_an_answer_larger_than_a_frame_is_asked_again_through_ray() -> None:
    """A read of more shards than one frame holds (a long prompt's blocks) is not a failed
    node: the call goes through Ray, and the socket stays in use."""
    lock = threading.Lock()
    server = FastCallServer(Shards(), ("get",), lock, frame_limit=1 << 16)
    handle = RayLess()
    target = Target(NODE, 0)
    fanout = RayFanout({target: handle}, fast_methods=(Shards.get,))
    channel = FastChannel(server.endpoint)
    fanout._fast._channels[target] = channel
    try:
        ticket = fanout.submit(target, Shards.get, [bytes(32)] * 8)  # type: ignore[arg-type]
        assert isinstance(gather(fanout, [ticket], 10.0)[ticket], NodeUnavailable)
        assert handle.tried == ["get"]  # 8 x 11,405 B answered: over 64 KiB, so through Ray
        assert fanout._fast._channels[target] is channel and channel.idle()
        ticket = fanout.submit(target, Shards.get, [bytes(32)] * 2)  # type: ignore[arg-type]
        assert gather(fanout, [ticket], 10.0)[ticket][1].tolist() == [11_405] * 2
        assert handle.tried == ["get"]
    finally:
        server.close()


def test_u64_tokens_and_enum_answers_round_trip_through_the_wire() -> None:
    for value in (1 << 63, (1 << 64) - 1, -(1 << 63)):
        assert wire.decode(b"".join(wire.encode(value))) == value
    answer = wire.decode(b"".join(wire.encode([PutStatus.BUSY])))
    assert answer == [PutStatus.BUSY] and type(answer[0]) is int  # the same value, as an int
    with pytest.raises(TypeError):
        wire.encode(1 << 64)


class RayLess:
    """An actor handle whose Ray calls all fail: records the methods tried through Ray."""

    def __init__(self) -> None:
        self.tried: list[str] = []

    def __getattr__(self, method: str) -> Any:
        from ray.exceptions import RayError

        tried = self.tried

        class Method:
            def remote(self, *args: Any, **kwargs: Any) -> Any:
                tried.append(method)
                raise RayError(f"no Ray here ({method})")

        return Method()
