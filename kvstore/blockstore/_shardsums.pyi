"""Types of the C extension built from ``_shardsums.c``."""

from typing import Any

def check_sums(
    heads: Any, head_at: Any, data: Any, piece_at: Any, piece_len: Any, pads: Any, ok: Any
) -> None: ...
def row_sums(rows: Any, row_len: int) -> bytes: ...
