"""Types of the C extension built from ``_shardsums.c``."""

from typing import Any

def check_sums(
    heads: Any, head_at: Any, data: Any, piece_at: Any, piece_len: Any, pads: Any, ok: Any
) -> None: ...
def row_sums(rows: Any, row_len: int, start: int = 8, stop: int = -1) -> bytes: ...
def check_rows(
    rows: Any, row_len: int, keys: Any, ok: Any, index: Any, payload_len: Any, payload_hash: Any
) -> None: ...
