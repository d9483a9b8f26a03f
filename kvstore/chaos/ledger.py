"""The chaos runs' record of truth: which blocks were committed and what their bytes hash to.

Payloads are a pure function of the key (``payload_for``), so a writer anywhere (a driver thread,
a writer actor that gets killed) produces the same bytes the checker expects, and the ledger only
keeps a 16-byte digest per block. A read is classified against it as OK (bit-exact), a miss
(None) or WRONG (any other bytes) — the one outcome no scenario may ever see.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey


def payload_for(key: bytes, size: int) -> np.ndarray:
    """The bytes every chaos writer stores under ``key`` (deterministic, incompressible)."""
    if size <= 0:
        raise InvalidArgument("size", f"must be > 0, got {size}")
    seed = int.from_bytes(bytes(key)[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def digest_of(data: object) -> bytes:
    return xxhash.xxh3_128_digest(memoryview(data).cast("B"))  # type: ignore[arg-type]


@dataclass(frozen=True)
class ReadCheck:
    """Outcome counts of reading some committed blocks."""

    ok: int
    misses: int
    wrong: int
    missed_keys: tuple[BlockKey, ...] = ()
    wrong_keys: tuple[BlockKey, ...] = ()


class Ledger:
    """Committed blocks: key -> (digest, size, traffic class). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: dict[BlockKey, tuple[bytes, int, str]] = {}
        self._order: list[BlockKey] = []

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._blocks

    def add(self, keys: Iterable[bytes], size: int, traffic_class: str = "default") -> None:
        """Record blocks whose put was acknowledged (``payload_for(key, size)`` each)."""
        entries = [(BlockKey(bytes(k)), digest_of(payload_for(k, size))) for k in keys]
        with self._lock:
            for key, digest in entries:
                if key not in self._blocks:
                    self._order.append(key)
                self._blocks[key] = (digest, size, traffic_class)

    def forget(self, keys: Iterable[bytes]) -> int:
        """Drop blocks that left the tier legitimately (expired, evicted); returns how many."""
        dropped = 0
        with self._lock:
            for key in keys:
                if self._blocks.pop(BlockKey(bytes(key)), None) is not None:
                    dropped += 1
            if dropped:
                self._order = [k for k in self._order if k in self._blocks]
        return dropped

    def keys(self, traffic_class: str | None = None) -> list[BlockKey]:
        with self._lock:
            return [
                k
                for k in self._order
                if traffic_class is None or self._blocks[k][2] == traffic_class
            ]

    def sample(self, count: int, rng: random.Random) -> list[BlockKey]:
        with self._lock:
            if not self._order:
                return []
            return rng.sample(self._order, min(count, len(self._order)))

    def size_of(self, key: bytes) -> int:
        with self._lock:
            return self._blocks[BlockKey(bytes(key))][1]

    def classify(self, key: bytes, data: np.ndarray | bytes | None) -> str:
        """``"ok"``, ``"miss"`` or ``"wrong"`` for one read of a committed block."""
        if data is None:
            return "miss"
        with self._lock:
            digest, size, _ = self._blocks[BlockKey(bytes(key))]
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
        if len(view) == size and digest_of(view) == digest:
            return "ok"
        return "wrong"

    def check(self, keys: Sequence[bytes], reads: Sequence[np.ndarray | bytes | None]) -> ReadCheck:
        if len(keys) != len(reads):
            raise InvalidArgument("reads", f"{len(reads)} reads for {len(keys)} keys")
        ok = 0
        missed: list[BlockKey] = []
        wrong: list[BlockKey] = []
        for key, data in zip(keys, reads, strict=True):
            verdict = self.classify(key, data)
            if verdict == "ok":
                ok += 1
            elif verdict == "miss":
                missed.append(BlockKey(bytes(key)))
            else:
                wrong.append(BlockKey(bytes(key)))
        return ReadCheck(ok, len(missed), len(wrong), tuple(missed), tuple(wrong))
