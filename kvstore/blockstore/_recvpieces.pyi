"""Types of the C extension built from ``_recvpieces.c``."""

from typing import Any

def recv_pieces(
    fd: int,
    buffers: tuple[Any, ...],
    which: Any,
    offsets: Any,
    lengths: Any,
    first: int,
    skip: int,
    most: int,
) -> tuple[int, int, int, bool]: ...
