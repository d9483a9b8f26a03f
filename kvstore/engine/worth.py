"""Load or recompute: whether a tier hit is faster to load than to compute, by this engine's
own measurements, or, until it has them, by a probe of its load path and the tier's figure of
its model's prefill rate.

A storage hit is not always a win: on a slow or distant tier, loading a prefix can take longer
than the engine takes to compute it (users of other tiers report an L3 hit of 2.45 s against a
1.7 s recompute). So before it accepts a hit, the connector's scheduler side compares

- the load's seconds: the hit's bytes over the fastest rate this engine's recent loads ran
  at, from their start to their last layer staged (reported by the worker side). The fastest,
  not the median: a small load's fixed latency makes its rate look low, and an estimate that
  errs must err towards loading (what a healthy tier deserves); on a slow tier every load is
  slow, the fastest too;
- the compute's seconds: the hit's tokens over the median rate this engine's recent prefill
  steps ran at (steps of at least ``min_step_tokens`` tokens and no load in them, timed from
  one step's plan to the next's),

and recomputes when loading would be slower. Both costs grow with the tokens, so the answer
holds for the whole hit: load all of it or none. Figures older than ``max_age_s`` are
forgotten, so a tier that was slow once is tried again later rather than never.

A fresh engine has measured neither rate, and loading blind is what made its first request on
a slow tier slower than cold (issue 32 item 4). So until it has its own figures:

- compute: the tier's figure for this model (``tier_prefill_rate``: the median prefill rate
  this tenant's engines of the same layout reported with their lookups,
  ``kvstore.tier.prefill``). It is the same model on the same kind of accelerator, so it is
  the best prior there is; it does not depend on where the engine is;
- load: a probe (``probed``): one block of the hit read over the path the load would take,
  timed (``kvstore.engine.probe``). Only the engine can measure its own path: the tier does
  not see the link between itself and a distant engine. One block costs little on any tier (a
  few ms on a healthy one; on one so slow that loading loses, 1/N of the load it saves), and
  errs towards recomputing (its fixed latency is counted per block), which costs at most the
  cold time a request would have taken anyway.

``probe_budget`` says when a probe is worth its block (no load rate yet, and a compute rate to
compare it with) and how long it may take: two blocks' compute. A probe still running then is
given up (the hit is recomputed), so on a tier too slow to load from, the probe costs the
request at most two blocks' compute over cold. Without any compute figure (a model the tier
has not heard of) the hit is loaded, as a healthy tier deserves: the common case.
``prefill_rate`` is what the engine reports to the tier with its lookups.

Pure logic with an injected clock: no torch, no vLLM.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.keys import BLOCK_TOKENS


@dataclass(frozen=True)
class Verdict:
    """The decision for one hit, with the estimates it came from (None: not known yet)."""

    load: bool
    load_s: float | None
    compute_s: float | None
    #: Where the load figure came from: "measured" (this engine's loads) or "probed".
    load_from: str = "measured"
    #: Where the compute figure came from: "measured" (this engine's steps) or "the tier".
    compute_from: str = "measured"

    def describe(self) -> str:
        if self.load_s is None or self.compute_s is None:
            return "no load and prefill rates yet: loading"
        verb = "loading" if self.load else "recomputing"
        return (
            f"{verb}: load ≈ {self.load_s:.3f} s ({self.load_from}), compute ≈ "
            f"{self.compute_s:.3f} s ({self.compute_from})"
        )


class _Rate:
    """Units per second over the last few samples, each kept ``max_age_s``, summed up by
    ``pick`` (the median: one odd sample does not swing it; max: the most optimistic)."""

    def __init__(
        self, samples: int, max_age_s: float, pick: Callable[[list[float]], float]
    ) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=samples)
        self._max_age_s = max_age_s
        self._pick = pick

    def add(self, when: float, amount: float, seconds: float) -> None:
        if amount > 0 and seconds > 0:
            self._samples.append((when, amount / seconds))

    def per_second(self, now: float) -> float | None:
        while self._samples and now - self._samples[0][0] > self._max_age_s:
            self._samples.popleft()
        if not self._samples:
            return None
        return self._pick([rate for _, rate in self._samples])


class LoadWorth:
    """Measures this engine's load and prefill rates and judges each hit (not thread-safe:
    the engine's scheduler loop is its one caller)."""

    def __init__(
        self,
        *,
        min_step_tokens: int = 512,
        samples: int = 8,
        max_age_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min_step_tokens < 1 or samples < 1 or max_age_s <= 0:
            raise ConfigError(
                "load_worth",
                f"need min_step_tokens ≥ 1, samples ≥ 1, max_age_s > 0; got {min_step_tokens}, "
                f"{samples}, {max_age_s}",
            )
        self.min_step_tokens = min_step_tokens
        self._clock = clock
        self._loads = _Rate(samples, max_age_s, max)  # bytes per second
        #: Probes of the load path (one block each), kept apart: a real load's figure wins.
        self._probes = _Rate(samples, max_age_s, max)
        self._compute = _Rate(samples, max_age_s, statistics.median)  # tokens per second
        #: The step planned last: when, its tokens, whether a load ran in it.
        self._last_step: tuple[float, int, bool] | None = None

    def step_planned(self, tokens: int, with_loads: bool) -> None:
        """A step of ``tokens`` scheduled tokens was planned now: the one planned before it
        has run, so its duration is known (a step a load ran in is not a compute figure: the
        forward may have waited on the load)."""
        now = self._clock()
        last = self._last_step
        if last is not None:
            when, last_tokens, last_loaded = last
            if last_tokens >= self.min_step_tokens and not last_loaded:
                self._compute.add(now, last_tokens, now - when)
        self._last_step = (now, tokens, with_loads)

    def loaded(self, nbytes: int, seconds: float) -> None:
        """A load of ``nbytes`` took ``seconds`` from its start to its last layer staged."""
        self._loads.add(self._clock(), nbytes, seconds)

    def probed(self, nbytes: int, seconds: float) -> None:
        """A probe read ``nbytes`` of a hit over the load path in ``seconds``."""
        self._probes.add(self._clock(), nbytes, seconds)

    def prefill_rate(self) -> float:
        """This engine's own measured prefill rate, tokens per second (0: none yet)."""
        return self._compute.per_second(self._clock()) or 0.0

    def probe_budget(self, tier_prefill_rate: float = 0.0) -> float | None:
        """Seconds a probe of one block may take, or None when no probe would decide anything
        (a load figure is known, measured or probed; or there is no compute figure, own or
        the tier's, to weigh it against). The budget is what computing two blocks takes: a
        block that does not arrive within it loads at under half the compute's speed, so
        the hit is recomputed (``probed`` with the budget), and the probe costs a request at
        most that much more than cold."""
        now = self._clock()
        if self._loads.per_second(now) is not None or self._probes.per_second(now) is not None:
            return None
        compute_rate = self._compute.per_second(now) or tier_prefill_rate
        return 2 * BLOCK_TOKENS / compute_rate if compute_rate > 0 else None

    def verdict(self, tokens: int, nbytes: int, tier_prefill_rate: float = 0.0) -> Verdict:
        """Load a hit of ``tokens`` tokens and ``nbytes`` bytes, or recompute it?
        ``tier_prefill_rate``: the tier's figure for this model (0: none), used while this
        engine has measured no prefill of its own."""
        now = self._clock()
        load_rate, load_from = self._loads.per_second(now), "measured"
        if load_rate is None:
            load_rate, load_from = self._probes.per_second(now), "probed"
        compute_rate, compute_from = self._compute.per_second(now), "measured"
        if compute_rate is None and tier_prefill_rate > 0:
            compute_rate, compute_from = tier_prefill_rate, "the tier's figure for this model"
        if load_rate is None or compute_rate is None:
            return Verdict(True, None, None)
        load_s, compute_s = nbytes / load_rate, tokens / compute_rate
        return Verdict(load_s <= compute_s, load_s, compute_s, load_from, compute_from)
