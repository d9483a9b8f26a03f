"""The hit figures of a tier: one set, per tenant and traffic class.

Every QueryHit is counted once, by the layer that answers its caller: the tier for its own
callers, a tenant's view (``kvstore.tier.tenancy``) for a tenant, whose one question may be two
or three lookups in the tier (its shared and own namespaces) — those parts are asked with
``HitRequest.counted`` False. The tier's figures per class are the sums over its tenants; a
tenant's are its own.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict

from kvstore.hitplan import HitPlan

#: What is counted for each lookup.
FIGURES = ("lookups", "hit_blocks", "miss_blocks", "swa_state_missing")


class HitCounters:
    """Thread-safe counters of lookups, blocks hit and missed, and window states missing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: defaultdict[tuple[str, str], Counter[str]] = defaultdict(Counter)

    def count(self, tenant: str, traffic_class: str, plan: HitPlan, keys: int) -> None:
        """One lookup of a prompt with ``keys`` full blocks, answered by ``plan``: the blocks
        inside the cap that were not in the hit run are missed ones."""
        block = plan.block_tokens
        hit_blocks = plan.block_hit_tokens // block
        looked_up = min(keys, plan.cap // block)
        # The block run was there but the window state was not (never stored, expired, or its
        # machine lost): the hit backed off, replayed or (exact-window) went lower.
        state_missing = plan.swa_position is not None and not plan.swa_hit
        with self._lock:
            figures = self._counts[(tenant, traffic_class or "default")]
            figures["lookups"] += 1
            figures["hit_blocks"] += hit_blocks
            figures["miss_blocks"] += looked_up - hit_blocks
            figures["swa_state_missing"] += int(state_missing)

    def by_class(self, tenant: str | None = None) -> dict[str, dict[str, int]]:
        """Class → figures: of ``tenant`` only, or of everyone (None)."""
        out: dict[str, Counter[str]] = defaultdict(Counter)
        with self._lock:
            for (who, name), figures in self._counts.items():
                if tenant is None or who == tenant:
                    out[name].update(figures)
        return {name: {f: figures[f] for f in FIGURES} for name, figures in out.items()}


def class_stats(figures: dict[str, int]) -> dict[str, object]:
    """One class's counted figures in the shape of ``Stats.classes`` (its stored bytes and the
    block tier's own miss reasons are the tier's to add)."""
    missing = figures.get("swa_state_missing", 0)
    return {
        "lookups": figures.get("lookups", 0),
        "hit_blocks": figures.get("hit_blocks", 0),
        "miss_blocks": figures.get("miss_blocks", 0),
        "miss_reasons": {"swa_state_missing": missing} if missing else {},
        "stored_bytes": 0,
    }
