"""What a trace's hit rate could be, from the trace alone: the yardsticks a replay is held to.

- The **infinite-cache oracle** keeps every block ever written.
- The **LRU oracle** keeps the ``capacity_blocks`` most recently used blocks, evicting the
  least recently used the moment a write would exceed it (no watermarks, no delay).

Both apply kvstore's own hit rule (``kvstore.hitplan.plan_hit``) to each request, in trace
order, and then do what an engine does: every block of the prompt is used (the hit ones read,
the others written), so each becomes the most recently used, in prompt order. They model block
KV only: in ``bounded-replay`` mode (the default of ``kvstore replay``) and ``full-attention``
mode the hit does not depend on an SWA state.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.hitplan import BOUNDED_REPLAY, FULL_ATTENTION, plan_hit
from kvstore.keys import BLOCK_TOKENS
from kvstore.trace.mooncake import TraceRequest

#: Hit-rule modes a trace can be replayed in: the others need SWA states a trace cannot give.
TRACE_MODES = (BOUNDED_REPLAY, FULL_ATTENTION)


@dataclass(frozen=True)
class OracleResult:
    """Per request (trace order): tokens hit; and blocks written and evicted in all."""

    hit_tokens: np.ndarray  # int64, one per request
    prompt_tokens: np.ndarray  # int64
    blocks_written: int
    blocks_evicted: int

    @property
    def token_hit_rate(self) -> float:
        total = int(self.prompt_tokens.sum())
        return float(self.hit_tokens.sum()) / total if total else 0.0


def check_mode(mode: str) -> str:
    if mode not in TRACE_MODES:
        raise InvalidArgument(
            "--mode",
            f"must be one of {', '.join(TRACE_MODES)}, got {mode!r} (a trace carries no SWA "
            "states, which the standard rule looks for)",
        )
    return mode


def oracle_hits(
    requests: Sequence[TraceRequest],
    key_words: Sequence[np.ndarray],
    capacity_blocks: int | None = None,
    mode: str = BOUNDED_REPLAY,
) -> OracleResult:
    """Replay the trace against an ideal cache: infinite when ``capacity_blocks`` is None,
    else an exact LRU of that many blocks. ``key_words``: each request's keys (n, 4) words."""
    check_mode(mode)
    if capacity_blocks is not None and capacity_blocks < 0:
        raise InvalidArgument("capacity_blocks", f"must be >= 0, got {capacity_blocks}")
    if len(requests) != len(key_words):
        raise InvalidArgument("key_words", f"{len(key_words)} lists for {len(requests)} requests")
    cache: OrderedDict[bytes, None] = OrderedDict()
    hits = np.zeros(len(requests), np.int64)
    written = evicted = 0
    for index, (request, words) in enumerate(zip(requests, key_words, strict=True)):
        raw = np.ascontiguousarray(words).tobytes()
        keys = [raw[at : at + 32] for at in range(0, len(raw), 32)]
        run = 0
        for key in keys:
            if key not in cache:
                break
            run += 1
        plan = plan_hit(request.input_length, run * BLOCK_TOKENS, None, mode=mode)
        hits[index] = plan.hit_tokens
        for key in keys:
            if key in cache:
                cache.move_to_end(key)
            else:
                cache[key] = None
                written += 1
        if capacity_blocks is not None:
            while len(cache) > capacity_blocks:
                cache.popitem(last=False)
                evicted += 1
    prompts = np.array([r.input_length for r in requests], np.int64)
    return OracleResult(hits, prompts, written, evicted)
