"""The wire format of the direct socket calls (``kvstore.fastcall``): a schema'd codec
that can only build data, never run code.

Pickle, the format those calls had, rebuilds whatever a frame names, so anyone who reached the
socket (or sat in the middle of it) ran code in the actor and in the gateway. This codec knows a
closed set of kinds and refuses the rest: ``None``, ``bool``, ``int`` (from -2**63 to
2**64 - 1: signed 64-bit, and unsigned above it, as a writer's random u64 token), ``float``,
``str`` (utf-8), ``bytes``, ``list`` and ``tuple`` (each decodes as what it was: a caller
sees the types it would have seen locally), numpy arrays of the dtypes in ``_DTYPES``, and the
frozen dataclasses registered with ``register`` (by name and fields: decoding calls only the
registered class). A numpy scalar of an allowed dtype travels as the Python scalar of its
value, an ``int`` subclass (an ``IntEnum`` answer such as ``PutStatus``) as its ``int``: the
same value, compared equal by the caller. No call sends a dict, so none is carried.

A value is one tag byte and what the tag says follows (little-endian; ``n`` is a u32)::

    N  None        T / F  True / False     i  int (i64)       u  int (u64, above i64)
    f  float (f64)
    s  n, utf-8    b  n, bytes             l / t  n, n values (list / tuple)
    k  n, width, n*width bytes: a list of equal-length bytes (block keys: one copy, not n)
    B  n, n bytes of 0 or 1: a list of bools (a node's or meta shard's answer per key: one
       item to write and read, not n)
    a  dtype code (u8), ndim (u8), ndim x u64 dims, zero padding to 8, the C-order data
    r  name length (u8), name, a tuple of the fields' values (a registered dataclass)
    R  n: the n-th dataclass of this frame again (a directory answers a few StoreRefs, often)

Array data starts 8-aligned in the frame, so ``decode`` answers numpy views of the received
buffer (``np.frombuffer``, no copy; writable when the buffer is) that the C index probe can take
as they are. ``encode`` answers the frame as a list of buffers (headers, then each array's own
memory, uncopied) for a scatter-gather send. Decoding is bounded: every declared length and
count must fit in what is left of the frame, a frame holds at most ``MAX_ITEMS`` items (checked
from each count before the items are made), nesting deeper than ``MAX_DEPTH`` is refused, and
anything malformed is a ``WireError``, never another exception. The item bound is what keeps a
small frame from decoding to a large heap: every item is a Python object (or a slot holding
one) of tens of bytes, so a frame of 8 MiB that declared 4 M two-byte keys decoded to 790 MiB
(44x) before it; now a frame of any size makes at most ``MAX_ITEMS`` objects. ``encode``
refuses a value over the same bound, so a sender never makes a frame its peer would refuse (the
callers send such a batch through Ray, as one over the size limit).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

#: The largest frame a peer may send (the framing refuses a longer one before reading it): a
#: 1,000-key lookup is ~34 KB out and ~66 KB back.
MAX_FRAME_BYTES = 64 << 20
#: Containers (list, tuple, dataclass) inside containers: the calls need 3.
MAX_DEPTH = 8
#: Items in one frame, all its lists, tuples, dataclass fields and block keys together. The
#: largest call that travels is an SWA lookup of a gateway request's 65,536 keys (one per
#: item) and its answer (a StoreRef or None each); the block store's key lists are arrays (one
#: item). At ~100 bytes an object at the most, a frame decodes to ~25 MiB beyond its own bytes.
MAX_ITEMS = 1 << 18
#: Block keys are cut out of a frame this many at a time, by one cached ``struct`` each (a
#: format for every count would keep one compiled format per count a peer sent).
_KEY_RUN = 256
_MAX_NDIM = 32
_INT_MIN, _INT_MAX, _UINT_MAX = -(1 << 63), (1 << 63) - 1, (1 << 64) - 1

#: The dtypes an array may have on the wire, by code (stable: codes are the format).
_DTYPES: dict[int, np.dtype[Any]] = {
    code: np.dtype(name)
    for code, name in enumerate(
        ("|b1", "|u1", "<u2", "<u4", "<u8", "<i4", "<i8", "<f4", "<f8"), start=1
    )
}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}

_TAG_N = struct.Struct("<cI")  # a tag and a count
_TAG_I = struct.Struct("<cq")
_TAG_U = struct.Struct("<cQ")
_TAG_F = struct.Struct("<cd")
_KEYS = struct.Struct("<cII")
_U32 = struct.Struct("<I")
_DIMS = [struct.Struct(f"<{ndim}Q") for ndim in range(_MAX_NDIM + 1)]  # an array's shape
_I64 = struct.Struct("<q")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")

Buffer = bytes | bytearray | memoryview


class WireError(ValueError):
    """A frame that is not a valid encoding (or one over the size limit)."""


# --- the registry of dataclasses allowed on the wire ------------------------------------------

_BY_NAME: dict[str, type] = {}
_BY_TYPE: dict[type, tuple[bytes, tuple[str, ...]]] = {}
D = TypeVar("D", bound=type)


def register(cls: D) -> D:
    """Allow a frozen dataclass on the wire, by its qualified name and its fields (a class
    decorator). The fields' values must be of the kinds the codec knows."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen:
        raise TypeError(f"{cls!r} is not a frozen dataclass")
    name = f"{cls.__module__}.{cls.__qualname__}"
    fields = tuple(field.name for field in dataclasses.fields(cls))
    if not all(field.init for field in dataclasses.fields(cls)):
        raise TypeError(f"{cls!r}: every field must be an __init__ argument")
    if len(name) > 255:
        raise TypeError(f"{name}: a name too long for the wire")
    if _BY_NAME.get(name, cls) is not cls:
        raise TypeError(f"another class is registered as {name}")
    _BY_NAME[name] = cls
    _BY_TYPE[cls] = (name.encode(), fields)
    return cls


# --- encoding ---------------------------------------------------------------------------------


class _Out:
    """The frame being built: finished parts (headers, arrays' memory), the open header, and
    the dataclass instances already sent (by identity: the value holds them while it is
    encoded), which travel again as a back-reference."""

    __slots__ = ("parts", "head", "size", "sent", "items")

    def __init__(self) -> None:
        self.parts: list[Buffer] = []
        self.head = bytearray()
        self.size = 0  # bytes in ``parts``
        self.sent: dict[int, int] = {}
        self.items = 0  # as ``decode`` counts them


def encode(value: object, limit: int = MAX_FRAME_BYTES, max_items: int = MAX_ITEMS) -> list[Buffer]:
    """``value`` as a frame, in parts (``b"".join`` them for one buffer). Raises ``TypeError``
    for a value the format does not carry, ``WireError`` when the frame would pass ``limit`` or
    hold more than ``max_items`` items (its peer would refuse it)."""
    out = _Out()
    try:
        _put(out, value, 0)
    except struct.error as error:  # a length beyond u32
        raise WireError(f"a value too large for the wire: {error}") from None
    except UnicodeEncodeError as error:  # a str with lone surrogates has no utf-8
        raise TypeError(f"a str the wire cannot carry: {error}") from None
    if out.head:
        out.parts.append(out.head)
    size = out.size + len(out.head)
    if size > limit:
        raise WireError(f"a frame of {size} bytes is over the limit of {limit}")
    if out.items > max_items:
        raise WireError(f"a frame of {out.items} items is over the limit of {max_items}")
    return out.parts


def _put(out: _Out, value: Any, depth: int) -> None:
    kind = type(value)
    head = out.head
    if kind is np.ndarray:
        _put_array(out, value)
    elif value is None:
        head += b"N"
    elif kind is list or kind is tuple:
        _put_sequence(out, value, depth)
    elif kind is str:
        data = value.encode()
        head += _TAG_N.pack(b"s", len(data))
        head += data
    elif kind is int:
        if _INT_MIN <= value <= _INT_MAX:
            head += _TAG_I.pack(b"i", value)
        elif _INT_MAX < value <= _UINT_MAX:
            head += _TAG_U.pack(b"u", value)
        else:
            raise TypeError(f"int {value} is beyond the wire's 64-bit range")
    elif kind in _BY_TYPE:
        _put_dataclass(out, value, depth)
    elif kind is bool:
        head += b"T" if value else b"F"
    elif kind is float:
        head += _TAG_F.pack(b"f", value)
    elif kind is bytes:
        head += _TAG_N.pack(b"b", len(value))
        head += value
    elif isinstance(value, np.generic) and value.dtype in _CODES:
        _put(out, value.item(), depth)  # a numpy scalar: the Python scalar of its value
    elif isinstance(value, int):  # an IntEnum (bool is matched above): its value
        _put(out, int(value), depth)
    elif isinstance(value, np.ndarray):  # a subclass: its plain array
        _put_array(out, np.asarray(value))
    else:
        raise TypeError(f"{kind.__module__}.{kind.__qualname__} cannot cross the wire")


def _put_sequence(out: _Out, value: list[Any] | tuple[Any, ...], depth: int) -> None:
    _check_depth(depth)
    out.items += len(value)
    if type(value) is list and value and type(value[0]) is bytes:
        width = len(value[0])
        if width and set(map(type, value)) == {bytes} and set(map(len, value)) == {width}:
            out.head += _KEYS.pack(b"k", len(value), width)
            out.head += b"".join(value)
            return
    if type(value) is list and value and type(value[0]) is bool and set(map(type, value)) == {bool}:
        out.head += _TAG_N.pack(b"B", len(value))
        out.head += bytes(value)
        return
    out.head += _TAG_N.pack(b"l" if type(value) is list else b"t", len(value))
    head, sent, pack = out.head, out.sent, _TAG_N.pack
    for item in value:  # misses and repeated StoreRefs inline: most of a directory's answer
        index = sent.get(id(item))
        if index is not None:
            head += pack(b"R", index)
        elif item is None:
            head += b"N"
        else:
            _put(out, item, depth + 1)
            head = out.head  # an array closes the header it was in


def _put_dataclass(out: _Out, value: Any, depth: int) -> None:
    index = out.sent.get(id(value))
    if index is not None:  # a directory answers the same few StoreRefs for many keys
        out.head += _TAG_N.pack(b"R", index)
        return
    name, fields = _BY_TYPE[type(value)]
    out.head += bytes((ord("r"), len(name))) + name
    _put_sequence(out, tuple(getattr(value, field) for field in fields), depth)
    out.sent[id(value)] = len(out.sent)  # numbered once complete, as the decoder does


def _put_array(out: _Out, value: np.ndarray) -> None:
    code = _CODES.get(value.dtype)
    if code is None:
        raise TypeError(f"an array of dtype {value.dtype} cannot cross the wire")
    if value.ndim > _MAX_NDIM:
        raise TypeError(f"an array of {value.ndim} dimensions cannot cross the wire")
    if not value.flags.c_contiguous:
        value = np.ascontiguousarray(value)
    head = out.head
    head += b"a"
    head.append(code)
    head.append(value.ndim)
    head += _DIMS[value.ndim].pack(*value.shape)
    head += bytes(-(out.size + len(head)) % 8)  # the data starts 8-aligned
    if value.nbytes:
        out.parts.append(head)
        out.parts.append(value.data.cast("B"))
        out.size += len(head) + value.nbytes
        out.head = bytearray()


def _check_depth(depth: int) -> None:
    if depth >= MAX_DEPTH:
        raise TypeError(f"a value nested deeper than {MAX_DEPTH} cannot cross the wire")


# --- decoding ---------------------------------------------------------------------------------


class _In:
    """What decoding a frame has made so far: the dataclasses (for back-references) and how
    many more items it may make."""

    __slots__ = ("refs", "left", "limit")

    def __init__(self, limit: int) -> None:
        self.refs: list[Any] = []
        self.left = limit
        self.limit = limit

    def spend(self, count: int, at: int) -> None:
        """Room for ``count`` more items, declared at byte ``at`` (before any is made)."""
        self.left -= count
        if self.left < 0:
            raise WireError(f"more than {self.limit} items in one frame (at byte {at})")


Reader = Callable[[memoryview, int, int, _In], tuple[Any, int]]


def decode(frame: Buffer, max_items: int = MAX_ITEMS) -> Any:
    """The value ``frame`` encodes. Arrays are views of ``frame`` (keep it unchanged while they
    live). Raises ``WireError`` for anything but one whole, valid value, and for a frame of more
    than ``max_items`` items (refused before they are made)."""
    view = memoryview(frame).cast("B")
    try:
        value, at = _get(view, 0, 0, _In(max_items))
    except WireError:
        raise
    except (struct.error, IndexError, ValueError, TypeError) as error:
        # A length past the end, a bad back-reference, bad utf-8, a dataclass refusing its
        # fields, an array numpy cannot shape.
        raise WireError(f"malformed frame: {type(error).__name__}: {error}") from None
    if at != len(view):
        raise WireError(f"{len(view) - at} bytes after the value")
    return value


def _get(view: memoryview, at: int, depth: int, made: _In) -> tuple[Any, int]:
    """The value at ``at`` and where it ends (``made``: what the frame made so far)."""
    tag = view[at]
    if tag == _NONE:  # the common kinds first: this runs once per value
        return None, at + 1
    if tag == _BACK:
        (index,) = _U32.unpack_from(view, at + 1)
        return made.refs[index], at + 5
    reader = _READERS.get(tag)
    if reader is None:
        raise WireError(f"unknown tag {tag:#04x} at byte {at}")
    return reader(view, at + 1, depth, made)


def _span(view: memoryview, at: int, size: int) -> int:
    """The end of ``size`` bytes at ``at``, which must lie in the frame."""
    end = at + size
    if end > len(view):
        raise WireError(f"{size} bytes declared at byte {at}, {len(view) - at} left")
    return end


def _get_bytes(view: memoryview, at: int, depth: int, made: _In) -> tuple[bytes, int]:
    (size,) = _U32.unpack_from(view, at)
    end = _span(view, at + 4, size)
    return bytes(view[at + 4 : end]), end


def _get_str(view: memoryview, at: int, depth: int, made: _In) -> tuple[str, int]:
    data, end = _get_bytes(view, at, depth, made)
    return data.decode(), end


def _get_items(view: memoryview, at: int, depth: int, made: _In) -> tuple[list[Any], int]:
    if depth >= MAX_DEPTH:
        raise WireError(f"nested deeper than {MAX_DEPTH}")
    (count,) = _U32.unpack_from(view, at)
    made.spend(count, at)
    at += 4
    _span(view, at, count)  # a value takes a byte at the least: no count beyond the frame
    items: list[Any] = []
    add, index_at, refs = items.append, _U32.unpack_from, made.refs
    for _ in range(count):  # misses and repeated StoreRefs inline: most of a directory's answer
        tag = view[at]
        if tag == _BACK:
            add(refs[index_at(view, at + 1)[0]])
            at += 5
        elif tag == _NONE:
            add(None)
            at += 1
        else:
            item, at = _get(view, at, depth + 1, made)
            add(item)
    return items, at


def _get_tuple(view: memoryview, at: int, depth: int, made: _In) -> tuple[Any, int]:
    items, at = _get_items(view, at, depth, made)
    return tuple(items), at


def _get_keys(view: memoryview, at: int, depth: int, made: _In) -> tuple[list[bytes], int]:
    count, width = struct.unpack_from("<II", view, at)
    if width == 0:
        raise WireError("a key list of width 0")  # would cost memory the frame did not bring
    made.spend(count, at)
    start = at + 8
    end = _span(view, start, count * width)
    # One C call makes a run of keys: 5x faster than slicing them out one by one.
    runs, rest = divmod(count, _KEY_RUN)
    run, step = _key_run(width, _KEY_RUN), width * _KEY_RUN
    keys: list[bytes] = []
    for offset in range(start, start + runs * step, step):
        keys += run.unpack_from(view, offset)
    if rest:
        keys += _key_run(width, rest).unpack_from(view, start + runs * step)
    return keys, end


def _get_bools(view: memoryview, at: int, depth: int, made: _In) -> tuple[list[bool], int]:
    (count,) = _U32.unpack_from(view, at)
    made.spend(count, at)
    start = at + 4
    end = _span(view, start, count)
    data = bytes(view[start:end])
    if data.translate(None, b"\0\1"):  # one encoding per value: 0 or 1, nothing else
        raise WireError("a bool list holds a byte other than 0 and 1")
    return list(map(bool, data)), end


@functools.lru_cache(maxsize=16)
def _key_run(width: int, count: int) -> struct.Struct:
    """The format of ``count`` keys of ``width`` bytes (a few kept: one key width travels)."""
    return struct.Struct(f"{width}s" * count)


def _get_array(view: memoryview, at: int, depth: int, made: _In) -> tuple[Any, int]:
    code, ndim = view[at], view[at + 1]
    dtype = _DTYPES.get(code)
    if dtype is None or ndim > _MAX_NDIM:
        raise WireError(f"an array of dtype code {code} and {ndim} dimensions")
    shape = _DIMS[ndim].unpack_from(view, at + 2)
    at += 2 + 8 * ndim
    at += -at % 8
    count = math.prod(shape)
    end = _span(view, at, count * dtype.itemsize)
    if count == 0:
        return np.empty(shape, dtype), end
    array = np.frombuffer(view, dtype, count, at)
    return (array if ndim == 1 else array.reshape(shape)), end


def _get_dataclass(view: memoryview, at: int, depth: int, made: _In) -> tuple[Any, int]:
    end = _span(view, at + 1, view[at])
    name = str(view[at + 1 : end], "utf-8")
    cls = _BY_NAME.get(name)
    if cls is None:
        raise WireError(f"{name!r} is not a registered wire type")
    fields, at = _get(view, end, depth, made)
    if type(fields) is not tuple or len(fields) != len(_BY_TYPE[cls][1]):
        raise WireError(f"{name} takes a tuple of {len(_BY_TYPE[cls][1])} fields")
    value = cls(*fields)
    made.refs.append(value)
    return value, at


def _constant(value: object) -> Reader:
    return lambda view, at, depth, made: (value, at)


def _scalar(shape: struct.Struct) -> Reader:
    return lambda view, at, depth, made: (shape.unpack_from(view, at)[0], at + shape.size)


_NONE, _BACK = ord("N"), ord("R")
_READERS: dict[int, Reader] = {
    ord("T"): _constant(True),
    ord("F"): _constant(False),
    ord("i"): _scalar(_I64),
    ord("u"): _scalar(_U64),
    ord("f"): _scalar(_F64),
    ord("s"): _get_str,
    ord("b"): _get_bytes,
    ord("l"): _get_items,
    ord("t"): _get_tuple,
    ord("k"): _get_keys,
    ord("B"): _get_bools,
    ord("a"): _get_array,
    ord("r"): _get_dataclass,
}
