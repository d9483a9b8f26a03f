"""The direct calls' wire codec: every kind round trips, everything else is refused, and a
malformed frame is a ``WireError`` that costs no more memory than the frame itself."""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvstore import wire
from kvstore.swa.directory import StoreRef
from kvstore.wire import MAX_DEPTH, WireError


def frame(value: object) -> bytearray:
    return bytearray(b"".join(wire.encode(value)))


def round_trip(value: object) -> Any:
    return wire.decode(frame(value))


def same(got: Any, want: Any) -> bool:
    """Equal, and of the same kinds all the way down (arrays: dtype, shape and values)."""
    if isinstance(want, np.ndarray):
        return (
            type(got) is np.ndarray
            and got.dtype == want.dtype
            and got.shape == want.shape
            and np.array_equal(got, want, equal_nan=want.dtype.kind == "f")
        )
    if type(got) is not type(want):
        return False
    if isinstance(want, list | tuple):
        return len(got) == len(want) and all(map(same, got, want))
    if isinstance(want, float) and want != want:
        return got != got  # NaN
    return bool(got == want)


WIRE_DTYPES = ("bool", "uint8", "uint16", "uint32", "uint64", "int32", "int64", "float32")


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        -1,
        (1 << 63) - 1,
        -(1 << 63),
        0.0,
        -2.5,
        float("inf"),
        float("nan"),
        "",
        "ünïcødé ✓",
        b"",
        b"\x00" * 32,
        [],
        (),
        [1, "a", None],
        (1, (2, (3,))),
        [b"k" * 32, b"\x00" * 32],  # the block keys' compact form
        [b"ab", b"abc"],  # unequal lengths: one value each
        [b"ab", "ab"],
        [True, False, True],  # a node's answer per key: the bool lists' compact form
        [True, 1],  # not all bools: one value each
        StoreRef("m0", "kv-store-m0"),
        [StoreRef("m0", "s0"), None, StoreRef("m1", "s1")],
    ],
    ids=repr,
)
def test_every_plain_kind_round_trips_as_itself(value: object) -> None:
    assert same(round_trip(value), value)


@pytest.mark.parametrize("dtype", [*WIRE_DTYPES, "float64"])
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 4), (250, 4), (0, 12), (2, 3, 5)])
def test_arrays_keep_dtype_shape_and_values(dtype: str, shape: tuple[int, ...]) -> None:
    values = (np.arange(int(np.prod(shape))) % 7).astype(dtype).reshape(shape)
    assert same(round_trip(values), values)
    assert same(round_trip(("x", values, 3)), ("x", values, 3))  # not only at the start


def test_arrays_decode_as_aligned_views_of_the_frame() -> None:
    keys = np.arange(4000, dtype=np.uint64).reshape(1000, 4)
    data = frame((b"odd length", keys, np.ones(5, bool), np.arange(3, dtype=np.int64)))
    _, got, flags, rows = wire.decode(data)
    assert np.shares_memory(got, np.frombuffer(data, np.uint8))  # no copy
    for array in (got, flags, rows):
        assert array.flags.aligned and array.flags.c_contiguous
    assert np.array_equal(rows, [0, 1, 2]) and flags.all()
    readonly = wire.decode(bytes(data))[1]  # over bytes: a read-only view, equally right
    assert not readonly.flags.writeable and np.array_equal(readonly, keys)


def test_read_only_and_strided_arrays_are_sent_as_their_values() -> None:
    base = np.arange(24, dtype=np.int64).reshape(4, 6)
    view = base[:, ::2]
    assert not view.flags.c_contiguous
    assert same(round_trip(view), view.copy())
    frozen = np.arange(5, dtype=np.uint32)
    frozen.setflags(write=False)
    assert same(round_trip(frozen), frozen)


def test_encoding_an_array_does_not_copy_it() -> None:
    keys = np.arange(4000, dtype=np.uint64).reshape(1000, 4)
    parts = wire.encode(("lookup_wire", (keys,)))
    assert any(isinstance(p, memoryview) and np.shares_memory(np.asarray(p), keys) for p in parts)


def test_a_list_of_bools_travels_as_one_item_and_decodes_as_bools() -> None:
    answer = [True, False] * 32  # what a node answers for a put of 64 shards
    data = frame(answer)
    assert data[:1] == b"B" and len(data) == 5 + 64  # one run of bytes, not 64 values
    got = wire.decode(data)
    assert got == answer and all(type(item) is bool for item in got)


def test_numpy_scalars_travel_as_python_scalars() -> None:
    scalars = [np.int64(5), np.uint32(7), np.float64(0.5), np.bool_(True)]
    assert same(round_trip(scalars), [5, 7, 0.5, True])


def test_a_repeated_dataclass_is_sent_once_and_decodes_equal() -> None:
    ref = StoreRef("m0", "kv-store-m0")
    answers = [ref if i % 3 else None for i in range(300)]
    assert len(frame(answers)) < len(frame(["kv-store-m0"] * 200))  # back-references
    got = round_trip(answers)
    assert got == answers and got[1] is got[2]


@dataclass(frozen=True)
class Unregistered:
    name: str


@dataclass
class Mutable:
    name: str


@pytest.mark.parametrize(
    "value",
    [
        object(),
        Unregistered("x"),
        {"a": 1},  # no call sends a dict
        {"a", "set"},
        bytearray(b"x"),
        1 << 64,
        -(1 << 63) - 1,
        np.zeros(3, dtype=np.complex64),
        np.array(["a"], dtype=object),
        np.zeros(2, dtype=">u8"),  # big-endian: not the wire's byte order
        np.float16(1.0),
        [[[[[[[[[[1]]]]]]]]]],  # nested deeper than MAX_DEPTH
    ],
    ids=repr,
)
def test_values_the_format_does_not_carry_are_refused_on_encode(value: object) -> None:
    with pytest.raises(TypeError):
        wire.encode(value)


def test_nesting_up_to_the_limit_is_fine_one_more_is_refused_both_ways() -> None:
    deep: Any = 1
    for _ in range(MAX_DEPTH):
        deep = [deep]
    assert round_trip(deep) == deep
    with pytest.raises(TypeError, match="deeper"):
        wire.encode([deep])
    too_deep = b"l\x01\x00\x00\x00" * (MAX_DEPTH + 1) + b"N"  # handmade: no encoder would
    with pytest.raises(WireError, match="deeper"):
        wire.decode(too_deep)


def test_only_frozen_dataclasses_can_be_registered() -> None:
    with pytest.raises(TypeError):
        wire.register(Mutable)
    with pytest.raises(TypeError):
        wire.register(dict)


def test_a_frame_over_the_limit_is_refused_on_encode() -> None:
    with pytest.raises(WireError, match="over the limit"):
        wire.encode(np.zeros(1000, np.uint64), limit=4000)
    assert len(b"".join(wire.encode(np.zeros(1000, np.uint64), limit=8100))) <= 8100


def _u32(value: int) -> bytes:
    return struct.pack("<I", value)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"?",  # unknown tag
        b"i\x01\x02",  # truncated int
        b"s" + _u32(10) + b"short",  # a length beyond the frame
        b"s" + _u32(2) + b"\xff\xfe",  # not utf-8
        b"b" + _u32(0xFFFFFFFF),
        b"l" + _u32(0xFFFFFFFF),  # a count the frame cannot hold: no 4-billion-item list
        b"k" + _u32(1 << 31) + _u32(0),  # zero-width keys would cost memory the frame lacks
        b"k" + _u32(4) + _u32(32) + bytes(64),
        b"B" + _u32(3) + b"\x01\x00",  # bools beyond the frame
        b"B" + _u32(2) + b"\x01\x02",  # a bool byte other than 0 and 1: one encoding a value
        b"a\x05\x01" + struct.pack("<Q", 1 << 40) + bytes(8),  # a huge array, 8 bytes sent
        b"a\x63\x01" + struct.pack("<Q", 1) + bytes(8),  # dtype code 99
        b"a\x05\x40" + bytes(8 * 64),  # 64 dimensions
        b"r\x03abc\x00",  # an unregistered dataclass name
        b"r\x1ekvstore.swa.directory.StoreRef" + b"t" + _u32(1) + b"N",  # 1 field of 2
        b"r\x1ekvstore.swa.directory.StoreRef" + b"l" + _u32(2) + b"NN",  # not a tuple
        b"R" + _u32(0),  # a back-reference to nothing
        b"NN",  # trailing bytes
        pickle.dumps(("lookup", ()), protocol=5),
    ],
    ids=repr,
)
def test_malformed_frames_are_a_wire_error(data: bytes) -> None:
    with pytest.raises(WireError):
        wire.decode(data)


def test_a_dataclass_name_not_registered_is_refused() -> None:
    data = frame(StoreRef("m0", "s0"))
    assert wire.decode(data) == StoreRef("m0", "s0")
    wrong = data.replace(b"StoreRef", b"StoreReg")
    with pytest.raises(WireError, match="not a registered"):
        wire.decode(wrong)


# --- the shapes that actually travel ----------------------------------------------------------


def test_the_meta_request_and_reply_round_trip() -> None:
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 1 << 63, (1000, 4), dtype=np.int64).astype(np.uint64)
    request = ("lookup_wire", ((keys, [3, 7], "interactive", None, keys[:5].copy(), None),))
    assert same(round_trip(request), request)
    n = 1000
    rows = np.arange(n, dtype=np.int64)
    placements = np.full((n, 12), -1, np.int32)
    reply = (True, (np.ones(n, bool), np.zeros(n, bool), placements, rows, 12.5, False, (4,), rows))
    assert same(round_trip(reply), reply)
    assert same(round_trip((False, "InvalidArgument: keys")), (False, "InvalidArgument: keys"))


def test_the_entrypoint_lookup_round_trips() -> None:
    keys = [bytes([i]) * 32 for i in range(40)]
    assert same(round_trip(("lookup", (keys, None))), ("lookup", (keys, None)))
    assert same(round_trip(("lookup", (keys, "m2"))), ("lookup", (keys, "m2")))
    refs = [StoreRef(f"m{i % 3}", f"s{i % 3}") if i % 4 else None for i in range(40)]
    assert same(round_trip((True, refs)), (True, refs))


# --- property: whatever the format carries comes back as itself -------------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 63) - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=40)
    | st.builds(StoreRef, st.text(max_size=5), st.text(max_size=5))
)
_arrays = hnp.arrays(
    st.sampled_from([np.dtype(name) for name in (*WIRE_DTYPES, "float64")]),
    hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
)
_values = st.recursive(
    _scalars | _arrays,
    lambda inner: st.lists(inner, max_size=5) | st.lists(inner, max_size=5).map(tuple),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(_values)
def test_any_value_of_the_carried_kinds_round_trips(value: object) -> None:
    assert same(round_trip(value), value)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_decode_or_are_a_wire_error(data: bytes) -> None:
    try:
        wire.decode(data)
    except WireError:
        pass
