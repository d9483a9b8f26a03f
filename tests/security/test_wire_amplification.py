"""A small frame that decodes to a large heap (issue 31, item 7).

The finding: an 8 MiB fastcall frame declaring 4 M two-byte keys decoded to 790 MiB of RSS
(44x), from any peer holding the key (and, through a frame's items, in the gateway too). Now a
frame may hold at most ``wire.MAX_ITEMS`` items, counted from each declared count before any
item is made: the crafted frames here are refused with nothing allocated, and the frames the
calls really send still decode.

Against the code before the fix the crafted frames decode (no error), and the server answers
the peer instead of dropping it.
"""

from __future__ import annotations

import struct
import threading
import tracemalloc
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore import wire
from kvstore.fastcall.client import connect
from kvstore.fastcall.server import FastCallServer
from kvstore.swa.directory import StoreRef
from kvstore.wire import WireError

#: Read so, not imported: the module runs against the code before the fix too (no bound there).
MAX_ITEMS: int = getattr(wire, "MAX_ITEMS", 1 << 18)


def _u32(value: int) -> bytes:
    return struct.pack("<I", value)


def as_call(value: bytes) -> bytearray:
    """``("get", (value,))``, the value spliced in as it is."""
    return bytearray(b"t" + _u32(2) + b"s" + _u32(3) + b"get" + b"t" + _u32(1) + value)


MANY = 1 << 20  # 4x the bound: what a frame of a few MiB can declare
CRAFTED = {
    "1 M two-byte keys (2 MiB)": b"k" + _u32(MANY) + _u32(2) + bytes(2 * MANY),
    "1 M Nones (1 MiB)": b"l" + _u32(MANY) + b"N" * MANY,
    "1 M empty lists (5 MiB)": b"l" + _u32(MANY) + (b"l" + _u32(0)) * MANY,
}


def _peak_to_refuse(frame: bytes) -> int:
    """Bytes allocated at the peak while ``frame`` is decoded and refused for its item count."""
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match=f"more than {MAX_ITEMS} items in one frame"):
            wire.decode(frame)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("crafted", list(CRAFTED.values()), ids=list(CRAFTED))
def test_a_frame_of_many_tiny_items_is_refused_before_they_are_made(crafted: bytes) -> None:
    frame = as_call(crafted)
    peak = _peak_to_refuse(frame)
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse a frame of {len(frame)}"


def test_the_items_of_every_container_of_a_frame_count_together() -> None:
    half = MAX_ITEMS // 2 + 1
    frame = as_call(b"t" + _u32(2) + (b"l" + _u32(half) + b"F" * half) * 2)
    peak = _peak_to_refuse(frame)
    assert peak < 16 * MAX_ITEMS  # the first list made: a slot an item, at the most the bound


def test_the_bound_is_the_same_both_ways() -> None:
    at_the_bound = [None] * (MAX_ITEMS - 3)
    value = ("get", (at_the_bound,))  # the call's 2 items, the args' 1 and the list's
    assert wire.decode(b"".join(wire.encode(value))) == value
    one_more = ("get", (at_the_bound + [None],))
    with pytest.raises(WireError, match=f"over the limit of {MAX_ITEMS}"):
        wire.encode(one_more)  # a sender never makes what its peer would refuse
    with pytest.raises(WireError, match="items in one frame"):
        wire.decode(bytearray(b"".join(wire.encode(one_more, max_items=MAX_ITEMS + 1))))


def test_the_frames_the_calls_send_still_decode() -> None:
    rng = np.random.default_rng(31)
    keys = [rng.bytes(32) for _ in range(64)]
    shards = [rng.integers(0, 255, 140 << 10, dtype=np.uint8) for _ in keys]
    put = ("put", ((1 << 64) - 5, keys, shards))
    got = wire.decode(bytearray(b"".join(wire.encode(put))))
    assert got[1][1] == keys and all(map(np.array_equal, got[1][2], shards))
    words = rng.integers(0, 1 << 63, (1000, 4), dtype=np.int64).astype(np.uint64)
    lookup = ("lookup_wire", ((words, [3], "interactive", None, None, None),))
    assert np.array_equal(wire.decode(b"".join(wire.encode(lookup)))[1][0][0], words)
    # The largest that travels item by item: an SWA lookup of a gateway request's 65,536 keys.
    many = [rng.bytes(32) for _ in range(1 << 16)]
    assert wire.decode(b"".join(wire.encode(("lookup", (many, None)))))[1][0] == many
    refs = [StoreRef(f"m{i % 3}", f"s{i % 3}") if i % 4 else None for i in range(1 << 16)]
    assert wire.decode(b"".join(wire.encode((True, refs))))[1] == refs


class Target:
    def get(self, keys: list[bytes]) -> int:
        return len(keys)


@pytest.fixture
def server() -> Iterator[FastCallServer]:
    served = FastCallServer(Target(), ("get",), threading.Lock())
    yield served
    served.close()


def test_a_peer_sending_such_a_frame_is_dropped_and_others_are_served(
    server: FastCallServer,
) -> None:
    with connect(server.endpoint) as conn:  # it holds the key: the decoder is what is left
        conn.send_bytes(as_call(CRAFTED["1 M two-byte keys (2 MiB)"]))
        with pytest.raises(EOFError):
            conn.recv_bytes()
    with connect(server.endpoint) as conn:
        conn.send_frame(wire.encode(("get", ([b"k" * 32] * 1000,))))
        assert wire.decode(conn.recv_bytes()) == (True, 1000)
