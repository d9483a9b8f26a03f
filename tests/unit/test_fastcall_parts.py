"""The parts of ``kvstore.fastcall`` one at a time, without a server: the framing, the key
challenge over a socket pair, the byte budget, and the package's own rule (its ``__init__`` is a
map that imports nothing)."""

from __future__ import annotations

import ast
import hashlib
import hmac
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore import wire
from kvstore.fastcall import frames, handshake
from kvstore.fastcall.admission import HandshakeSlots
from kvstore.fastcall.budget import Budget
from kvstore.fastcall.frames import FastConnection, call_of, reply_of
from kvstore.fastcall.handshake import MAGIC, Endpoint, answer, challenge, proof
from kvstore.wire import WireError

ENDPOINT: Endpoint = ("127.0.0.1", 4242, b"k" * 32)


@pytest.fixture
def pair() -> Iterator[tuple[FastConnection, FastConnection]]:
    left, right = socket.socketpair()
    with FastConnection(left, frame_limit=1 << 16) as a, FastConnection(right) as b:
        yield a, b


def _deadline() -> float:
    return time.monotonic() + 5.0


# --- frames -----------------------------------------------------------------------------------


def test_a_frame_crosses_whole_from_its_parts(pair) -> None:
    a, b = pair
    b.send_frame([b"ab", memoryview(b"cd"), bytearray(b"e")], _deadline())
    assert a.recv_frame(deadline=_deadline()) == b"abcde"
    b.send_bytes(b"")
    assert a.recv_bytes() == b""


def test_a_frame_over_the_limit_is_refused_before_its_body_is_read(pair) -> None:
    a, b = pair
    b.send_frame([b"x" * 100])
    with pytest.raises(WireError, match="a frame of 100 bytes, 10 at the most"):
        a.recv_frame(limit=10)
    a.discard(100)  # its body is still there, unread (a server drops such a peer)
    b.send_frame([b"y" * 3000])
    assert a.recv_length() == 3000
    a.discard(3000)  # read into nothing: the stream stays in step
    b.send_frame([b"next"])
    assert a.recv_frame() == b"next"


def test_a_frame_larger_than_the_socket_buffers_waits_for_room_within_its_deadline() -> None:
    """A plain socket never gets a timeout: a send or receive with a deadline is made
    non-blocking and waits in ``poll`` when it would block. A frame far larger than the
    buffers crosses whole while the reader takes it slowly; a peer that reads nothing makes
    the send a ``TimeoutError`` at its deadline, not a hang."""
    left, right = socket.socketpair()
    with FastConnection(left, frame_limit=1 << 26) as a, FastConnection(right) as b:
        payload = bytes(range(256)) * (32 << 10)  # 8 MiB

        def read_slowly() -> None:
            time.sleep(0.2)
            got.append(a.recv_frame(deadline=_deadline()))

        got: list[bytearray] = []
        reader = threading.Thread(target=read_slowly)
        reader.start()
        b.send_frame([payload[:3], memoryview(payload)[3:]], _deadline())
        reader.join()
        assert got == [payload]
        assert b._sock.gettimeout() is None and a._sock.gettimeout() is None
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            b.send_frame([payload], time.monotonic() + 0.3)
        assert 0.25 < time.monotonic() - started < 3.0


def test_a_closed_peer_is_eof_and_a_passed_deadline_a_timeout(pair) -> None:
    a, b = pair
    with pytest.raises(TimeoutError):
        a.recv_frame(deadline=0.0)
    b.close()
    with pytest.raises(EOFError):
        a.recv_frame()


def test_calls_and_replies_have_one_shape_each() -> None:
    def frame(value: object) -> bytearray:
        return bytearray(b"".join(bytes(part) for part in wire.encode(value)))

    assert call_of(frame(("get", (1, "a")))) == ("get", (1, "a"))
    assert reply_of(frame((True, [1, 2]))) == (True, [1, 2])
    for bad in [("get",), ("get", [1]), (1, ()), "get"]:
        with pytest.raises(WireError, match="a call is"):
            call_of(frame(bad))
    for bad in [(1, 2), (True,), [True, 1], None]:
        with pytest.raises(WireError, match="a reply is"):
            reply_of(frame(bad))
    assert issubclass(frames.FrameTooLarge, frames.RemoteError)


# --- the handshake ----------------------------------------------------------------------------


def _challenged(conn: FastConnection, endpoint: Endpoint, result: list[object]) -> None:
    try:
        result.append(challenge(conn, endpoint, _deadline()))
    except Exception as error:  # the client hung up: the test says what it expected
        result.append(error)
    if result[-1] is not True:
        conn.close()  # what the server does with a peer that failed the challenge


def test_both_halves_agree_on_the_same_key_and_endpoint(pair) -> None:
    server, client = pair
    result: list[object] = []
    thread = threading.Thread(target=_challenged, args=(server, ENDPOINT, result))
    thread.start()
    answer(client, ENDPOINT, _deadline())
    thread.join(5.0)
    assert result == [True]


@pytest.mark.parametrize(
    "dialed",
    [
        (ENDPOINT[0], ENDPOINT[1], b"x" * 32),  # not the key
        (ENDPOINT[0], ENDPOINT[1] + 1, ENDPOINT[2]),  # the key, but another endpoint
    ],
)
def test_a_client_without_the_key_for_this_endpoint_is_refused(pair, dialed: Endpoint) -> None:
    server, client = pair
    result: list[object] = []
    thread = threading.Thread(target=_challenged, args=(server, ENDPOINT, result))
    thread.start()
    with pytest.raises(PermissionError, match=f"127.0.0.1:{dialed[1]} refused the key"):
        answer(client, dialed, _deadline())
    thread.join(5.0)
    assert result == [False]


def test_a_server_that_is_not_fastcall_is_named(pair) -> None:
    server, client = pair
    server.send_frame([b"x" * (len(MAGIC) + 32)])
    with pytest.raises(PermissionError, match="127.0.0.1:4242 is not a fastcall server"):
        answer(client, ENDPOINT, _deadline())


def test_a_proof_is_bound_to_role_nonces_and_endpoint() -> None:
    key, nonces = b"k" * 32, (b"s" * 32, b"c" * 32)
    client = proof(key, b"client", nonces, "h", 1)
    message = MAGIC + b" client" + nonces[0] + nonces[1] + b"h:1"
    assert client == hmac.new(key, message, hashlib.sha256).digest()
    assert client != proof(key, b"server", nonces, "h", 1)
    assert client != proof(key, b"client", nonces[::-1], "h", 1)
    assert client != proof(key, b"client", nonces, "h", 2)


# --- the budget -------------------------------------------------------------------------------


def test_the_budget_holds_at_most_its_limit_and_says_why_it_refused() -> None:
    budget = Budget(100)
    assert budget.take(60, 0.0) and budget.take(40, 0.0)
    assert not budget.take(1, 0.01)
    assert budget.refusal(1, 0.01) == "100 of 100 in-flight bytes held for 0.01 s"
    assert not budget.take(101, 10.0)  # never fits: refused at once
    assert budget.refusal(101, 10.0) == "a call of 101 bytes is over the in-flight budget of 100"
    waiter = threading.Thread(target=lambda: budget.give(60))
    waiter.start()
    assert budget.take(50, 5.0)  # the bytes given back while it waited
    waiter.join()
    assert (budget.held, budget.peak, budget.refused) == (90, 100, 2)
    with pytest.raises(ValueError, match="must be positive"):
        Budget(0)


# --- the handshake slots ----------------------------------------------------------------------


def test_one_source_holds_only_its_share_of_the_handshake_slots() -> None:
    slots = HandshakeSlots(limit=4, per_source=2)
    mine = [slots.take("10.0.0.9"), slots.take("10.0.0.9")]
    assert all(mine) and not slots.take("10.0.0.9")  # its share is spent: others find room
    others = [slots.take("10.0.0.1"), slots.take("10.0.0.2")]
    assert all(others) and slots.held() == 4
    slots.give(others[0])
    assert slots.take("10.0.0.3") and slots.held() == 4
    assert slots.turned_away == 1 and slots.evicted == 0
    with pytest.raises(ValueError, match="per_source"):
        HandshakeSlots(limit=2, per_source=3)


def test_when_full_the_busiest_sources_oldest_handshake_makes_room() -> None:
    """A flood spread over many addresses fills every slot within its shares; a newcomer from a
    quieter source then takes the busiest source's oldest slot, whose socket is shut."""
    slots = HandshakeSlots(limit=4, per_source=2)
    pairs = [socket.socketpair() for _ in range(2)]
    try:
        oldest = slots.take("10.0.0.9", pairs[0][0])
        second = slots.take("10.0.0.9", pairs[1][0])
        rest = [slots.take("10.0.0.1"), slots.take("10.0.0.2")]
        assert oldest and second and all(rest)
        newcomer = slots.take("10.0.0.3")
        assert newcomer is not None and slots.evicted == 1 and slots.held() == 4
        assert pairs[0][0].recv(1) == b""  # the evicted peer's socket was shut: its thread ends
        slots.give(oldest)  # the evicted peer's own give comes later: a no-op
        assert slots.held() == 4
        # Every source now holds one: equals are left alone, the newcomer is turned away.
        assert slots.take("10.0.0.4") is None and slots.evicted == 1
        for slot in (second, *rest, newcomer):
            slots.give(slot)
        assert slots.held() == 0 and not slots._held  # nothing kept per address once gone
    finally:
        for a, b in pairs:
            a.close()
            b.close()


# --- the package ------------------------------------------------------------------------------


def test_the_package_init_is_a_map_that_imports_nothing() -> None:
    init = Path(handshake.__file__).with_name("__init__.py")
    tree = ast.parse(init.read_text())
    assert ast.get_docstring(tree)
    assert not [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
