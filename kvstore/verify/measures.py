"""Error measures of the verify checks: how far a result is from its reference (``Diff``), and
the wall time of a run (``best_wall``). The checks import these; ``report`` renders them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Diff:
    """How far ``a`` is from the reference ``b``: relative L2 and largest absolute difference."""

    rel_l2: float
    max_abs: float

    def as_dict(self) -> dict[str, float]:
        return {"rel_l2": self.rel_l2, "max_abs": self.max_abs}


def diff(a: torch.Tensor, b: torch.Tensor) -> Diff:
    """Compared in float64 so the measure adds no rounding of its own."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    a64, b64 = a.double(), b.double()
    delta = a64 - b64
    norm = float(b64.norm())
    rel = float(delta.norm()) / norm if norm > 0 else float(delta.norm())
    max_abs = float(delta.abs().max()) if delta.numel() else 0.0
    return Diff(rel, max_abs)


R = TypeVar("R")

#: Runs up to this many token-layers are timed best-of-3: the machine is shared, and the
#: smallest of a few walls is the least disturbed one. Longer runs are timed once.
CHEAP_TOKEN_LAYERS = 100_000


def best_wall(token_layers: int, run: Callable[[], R]) -> tuple[float, R]:
    """Wall seconds of ``run`` (best of 3 when cheap, else one run) and its last result."""
    repeats = 3 if token_layers <= CHEAP_TOKEN_LAYERS else 1
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - t0)
    return best, result
