"""Buffer plumbing for the codec: flat byte views, addresses, and new ``bytes`` to fill.

Kept apart from ``codec.py`` because it leans on CPython details (through documented C API
calls via ``ctypes.pythonapi``) that the codec logic should not have to think about.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kvstore.ec.shard import byte_view
from kvstore.errors import InvalidArgument


def fresh_bytes_cpython(size: int) -> tuple[bytes | bytearray, memoryview]:
    """A new ``bytes`` of ``size`` uninitialised bytes and a writable window onto them.

    This is the C API's own pattern (``PyBytes_FromStringAndSize(NULL, n)``, fill, return)
    through ctypes: the object is written only before anyone else can see it, and it saves
    decode a full copy of the block (a bytearray would need ``bytes(...)`` at the end).
    """
    if size == 0:
        return b"", memoryview(bytearray(0))
    out = _new_bytes(None, size)
    window = (ctypes.c_ubyte * size).from_address(bytes_address(out))
    return out, memoryview(window).cast("B")


def fresh_bytearray(size: int) -> tuple[bytes | bytearray, memoryview]:
    out = bytearray(size)
    return out, memoryview(out)


try:  # CPython: the C API is reachable through ctypes.pythonapi
    _new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
    _new_bytes.restype = ctypes.py_object
    _new_bytes.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
    bytes_address = ctypes.pythonapi.PyBytes_AsString
    bytes_address.restype = ctypes.c_void_p
    bytes_address.argtypes = (ctypes.py_object,)
    fresh_bytes = fresh_bytes_cpython
    WRITABLE_BYTES = True
except AttributeError:  # other interpreters: one extra copy, no in-place fast path
    fresh_bytes = fresh_bytearray
    WRITABLE_BYTES = False


def address(buffer: memoryview | np.ndarray) -> int:
    """Address of a buffer's first byte, read-only ones included (ctypes' from_buffer is not)."""
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


def payload_array(payload: object) -> np.ndarray:
    """A flat uint8 view of the payload's bytes (a copy only for non-contiguous arrays)."""
    if isinstance(payload, np.ndarray):
        if payload.dtype == np.uint8 and payload.ndim == 1 and payload.flags.c_contiguous:
            return payload
        if payload.dtype.hasobject:
            raise InvalidArgument("payload", "numpy arrays of Python objects have no bytes")
        return np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
    if payload is None or isinstance(payload, str):
        raise InvalidArgument(
            "payload", f"must be bytes-like or a numpy array, got {type(payload).__name__}"
        )
    return np.frombuffer(byte_view(payload, "payload"), dtype=np.uint8)
