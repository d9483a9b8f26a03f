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
def take_replies(
    fds: Any,
    heads: tuple[Any, ...],
    tables: tuple[bytes, ...],
    sums: Any,
    rows: Any,
    buffers: tuple[Any, ...],
    which: Any,
    offsets: Any,
    lengths: Any,
    columns: int,
    first_at: Any,
    first_bytes: int,
    max_prefix: int,
    deadline: float,
    state: Any,
    check: tuple[Any, Any, Any, Any, int, int, bytes, int] | None,
) -> None: ...
