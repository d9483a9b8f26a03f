"""Types of the C extension built from ``_sendrecords.c``."""

from typing import Any

def send_records(
    fd: int,
    parts: tuple[Any, ...],
    places: Any,
    seqs: Any,
    fds: Any,
    record_bytes: int,
    deadline: float,
) -> int: ...
