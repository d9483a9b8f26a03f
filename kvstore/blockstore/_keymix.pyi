"""Types of the C extension built from ``_keymix.c``."""

from typing import Any

def key_hash(words: Any, width: int, seed: int, out: Any) -> None: ...
