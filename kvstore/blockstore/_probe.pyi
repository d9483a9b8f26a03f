"""Types of the C extension built from ``_probe.c``."""

from typing import Any

def find_rows(table: Any, column: Any, keys: Any, out: Any, multiplier: int, bits: int) -> None: ...
def claim_slots(
    table: Any,
    column: Any,
    keys: Any,
    rows: Any,
    slots: Any,
    first: Any,
    multiplier: int,
    bits: int,
) -> None: ...
