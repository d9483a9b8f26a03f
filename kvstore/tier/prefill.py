"""The prefill rates engines report, kept by the tier per tenant and layout, so that a fresh
engine knows what computing a hit costs before it has computed anything itself.

Why the tier keeps them: an engine judges each hit by load seconds against compute seconds
(``kvstore.engine.worth``). A fresh engine has measured neither, and loading blind is what makes
its first request on a slow tier slower than cold. Its compute rate is a property of the model
and the accelerator, which every engine of that model shares, and the tier already sees every
engine's lookups: each QueryHit carries the asking engine's own measured rate
(``prefill_tokens_per_s``, 0 when it has none), and each answer carries the median of the
recent reports for that layout (0 when none). The key is the layout's fingerprint, which names
the model, its dtype, KV shape and the platform (``kvstore.engine.settings``), so a CPU
engine's rate never stands for a GPU engine's; and the tenant, so one tenant cannot steer
another's engines into loading or recomputing.

The median of the last ``samples`` reports younger than ``max_age_s``: one odd engine does not
swing it, and a fleet that changed hardware is followed within minutes. At most ``max_keys``
(tenant, layout) pairs are kept, the least recently reported dropped first.

Not thread-safe: the gateway's asyncio loop is its one caller. Injected clock.
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from kvstore.errors import ConfigError
from kvstore.tier.records import check_rate


class PrefillRates:
    """Recent prefill rates (tokens per second) per (tenant, layout fingerprint)."""

    def __init__(
        self,
        *,
        samples: int = 16,
        max_age_s: float = 600.0,
        max_keys: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if samples < 1 or max_age_s <= 0 or max_keys < 1:
            raise ConfigError(
                "prefill_rates",
                f"need samples ≥ 1, max_age_s > 0, max_keys ≥ 1; got {samples}, {max_age_s}, "
                f"{max_keys}",
            )
        self._samples = samples
        self._max_age_s = max_age_s
        self._max_keys = max_keys
        self._clock = clock
        self._rates: OrderedDict[tuple[str, bytes], deque[tuple[float, float]]] = OrderedDict()

    def report(self, tenant: str, fingerprint: bytes, tokens_per_s: float) -> None:
        """An engine of ``tenant`` measured ``tokens_per_s`` for the layout ``fingerprint``
        (0: it has no figure, nothing is kept)."""
        check_rate("prefill_tokens_per_s", tokens_per_s)
        if not tokens_per_s:
            return
        key = (tenant, bytes(fingerprint))
        kept = self._rates.pop(key, None)
        if kept is None:
            kept = deque(maxlen=self._samples)
        kept.append((self._clock(), float(tokens_per_s)))
        self._rates[key] = kept  # now the most recently reported
        while len(self._rates) > self._max_keys:
            self._rates.popitem(last=False)

    def rate(self, tenant: str, fingerprint: bytes) -> float:
        """The median of the recent reports for ``tenant``'s layout ``fingerprint`` (0: none)."""
        key = (tenant, bytes(fingerprint))
        kept = self._rates.get(key)
        if kept is None:
            return 0.0
        now = self._clock()
        while kept and now - kept[0][0] > self._max_age_s:
            kept.popleft()
        if not kept:
            del self._rates[key]
            return 0.0
        return statistics.median(rate for _, rate in kept)
