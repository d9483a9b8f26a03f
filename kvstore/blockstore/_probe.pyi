"""Types of the C extension built from ``_probe.c``."""

from typing import Any

def find_rows(table: Any, column: Any, keys: Any, out: Any, multiplier: int, bits: int) -> None: ...
