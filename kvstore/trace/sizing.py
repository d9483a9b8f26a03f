"""How much capacity a fleet needs to keep a target token hit rate: bisection over the tier's
capacity, each step a full run of the model (its GC, watermarks and refusals included), not an
LRU formula. The hit rate grows with the capacity (more is kept), which is what a bisection
needs; each step gives the hit rate at one capacity, and the answer is the smallest capacity
found that reaches the target, within ``tolerance`` of the largest that did not.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.trace.simulate import PreparedTrace, SimConfig, simulate


@dataclass(frozen=True)
class Sizing:
    """The answer: ``capacity_bytes`` (block payload, whole fleet) and what each machine must
    be given, or ``reachable`` False when even an unbounded tier stays below the target."""

    target: float
    best_hit_rate: float  # unbounded tier
    reachable: bool
    capacity_bytes: int | None
    machine_live_bytes: int | None  # per machine: `kvstore up --capacity-bytes`
    machine_disk_bytes: int | None  # per machine on disk
    hit_rate: float | None  # of the model at ``capacity_bytes``
    evaluations: tuple[tuple[int, float], ...]  # (capacity_bytes, hit rate) tried, in order


def capacity_for(
    prepared: PreparedTrace,
    config: SimConfig,
    target: float,
    best_hit_rate: float,
    tolerance: float = 0.01,
    progress: Callable[[int], None] | None = None,
) -> Sizing:
    """The smallest capacity (to ``tolerance``, relative) at which ``config``'s fleet keeps a
    token hit rate of ``target``; ``best_hit_rate`` is the unbounded tier's (the search's
    ceiling). Failures are left out: this sizes the tier for normal operation."""
    if not 0 < target <= 1:
        raise InvalidArgument("--target-hit-rate", f"must be in (0, 1], got {target}")
    if target > best_hit_rate:
        return Sizing(target, best_hit_rate, False, None, None, None, None, ())
    sizes = config.sizes
    copies = config.copies
    evaluations: list[tuple[int, float]] = []

    def hit_rate(blocks: int) -> float:
        """The model's hit rate with room for ``blocks`` blocks per copy of the traffic."""
        trial = dataclasses.replace(
            config,
            capacity_bytes=blocks * copies * sizes.block_bytes,
            machine_capacity=None,
            fail_at=(),
            afr=0.0,
        )
        rate = simulate(prepared.requests, trial, prepared=prepared).token_hit_rate
        evaluations.append((trial.capacity_bytes or 0, rate))
        if progress is not None:
            progress(1)
        return rate

    # Every block the trace writes fits under the high watermark: the unbounded tier's rate,
    # unless machines fill unevenly; then more, up to a few times over.
    high = math.ceil(prepared.unique_blocks / config.gc_high) + 1
    reached = hit_rate(high)
    while reached < target and high < 8 * prepared.unique_blocks:
        high *= 2
        reached = hit_rate(high)
    if reached < target:
        return Sizing(target, best_hit_rate, False, None, None, None, None, tuple(evaluations))
    low = 0  # holds nothing: hit rate 0
    while high - low > max(1, tolerance * high):
        middle = (low + high) // 2
        rate = hit_rate(max(1, middle))
        if rate >= target:
            high, reached = middle, rate
        else:
            low = middle
    capacity = high * copies * sizes.block_bytes
    live = -(-high * copies * sizes.live_per_block // config.machines)
    disk = -(-high * copies * sizes.disk * sizes.width // config.machines)
    return Sizing(target, best_hit_rate, True, capacity, live, disk, reached, tuple(evaluations))
