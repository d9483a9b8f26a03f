"""What one request of a trace replay got from the tier: the per-request record the replay's
engines produce (``replay``) and its report reads (``replay_report``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Served:
    """What one request got from the tier (latencies in seconds; None: call not made)."""

    index: int
    at_s: float  # trace time since the first request
    prompt_tokens: int
    blocks: int  # full blocks of the prompt
    planned_hit_tokens: int  # what QueryHit promised
    hit_tokens: int  # what the engine could use (every byte checked)
    blocks_fetched: int
    blocks_put: int
    load_errors: int  # hit blocks that did not load (recomputed)
    wrong_bytes: int  # hit blocks whose bytes were wrong (never used; must be 0)
    put_failures: int  # blocks the tier did not store
    query_hit_s: float | None
    get_blocks_s: float | None
    put_blocks_s: float | None
