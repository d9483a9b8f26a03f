"""Fetch-or-replay advice: is it cheaper to fetch an SWA state from its owner or to rebuild it?

docs/rules.md §7 (our addition): fetching ~1.4 MB across machines and replaying 128 tokens over the
stored SWA layers cost different things on different days. Both sides are estimated:

    fetch_s  = latency(owner) + state_bytes / bandwidth(owner)
    replay_s = replay_tokens × stored_layers × cost_per_token_layer

Latency and bandwidth are per-owner-machine moving estimates fed by real transfers (configured
defaults until the first measurement). The replay cost is configured, or measured by
``calibrate_replay`` with a callable that really runs a replay (on a GPU engine: the model's own
replay kernel). The advice carries both numbers, so an engine or an operator can see why.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvstore.errors import InvalidArgument
from kvstore.swa.config import SWAConfig

FETCH = "fetch"
REPLAY = "replay"


@dataclass(frozen=True)
class LinkEstimate:
    latency_s: float
    bandwidth_bps: float
    #: Measurements behind each number (0: still the configured default).
    latency_samples: int
    fetch_samples: int


@dataclass(frozen=True)
class Advice:
    choice: str  # "fetch" or "replay"
    fetch_s: float
    replay_s: float
    owner_machine: str
    local: bool
    state_bytes: int
    replay_tokens: int
    stored_layers: int
    measured: bool  # the bandwidth estimate comes from real fetches from this owner

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class FetchReplayAdvisor:
    """Per-machine link estimates plus the replay cost model. One per client process."""

    def __init__(
        self,
        *,
        config: SWAConfig,
        state_bytes: int,
        stored_layers: int,
        replay_tokens: int,
    ) -> None:
        for name, value in (
            ("state_bytes", state_bytes),
            ("stored_layers", stored_layers),
            ("replay_tokens", replay_tokens),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgument(name, f"must be a positive integer, got {value!r}")
        self._alpha = config.estimate_alpha
        self._default = LinkEstimate(
            config.default_fetch_latency_s, config.default_fetch_bandwidth_bps, 0, 0
        )
        self._links: dict[str, LinkEstimate] = {}
        self.state_bytes = state_bytes
        self.stored_layers = stored_layers
        self.replay_tokens = replay_tokens
        self.cost_per_token_layer_s = config.replay_cost_per_token_layer_s

    # --- measurements -----------------------------------------------------------------

    def link(self, machine_id: str) -> LinkEstimate:
        return self._links.get(machine_id, self._default)

    def observe_latency(self, machine_id: str, seconds: float) -> None:
        """A round trip with a negligible payload to ``machine_id`` took ``seconds``."""
        _check_duration("seconds", seconds)
        current = self.link(machine_id)
        alpha = 1.0 if current.latency_samples == 0 else self._alpha
        self._links[machine_id] = LinkEstimate(
            _mix(current.latency_s, seconds, alpha),
            current.bandwidth_bps,
            current.latency_samples + 1,
            current.fetch_samples,
        )

    def observe_fetch(self, machine_id: str, nbytes: int, seconds: float) -> None:
        """A fetch of ``nbytes`` from ``machine_id`` took ``seconds`` end to end.

        The part above the latency estimate is charged to bandwidth; a fetch faster than the
        latency estimate lowers the latency instead (it was evidently too high).
        """
        _check_duration("seconds", seconds)
        if nbytes <= 0:
            raise InvalidArgument("nbytes", f"must be positive, got {nbytes}")
        current = self.link(machine_id)
        alpha = 1.0 if current.fetch_samples == 0 else self._alpha
        latency = current.latency_s
        transfer = seconds - latency
        if transfer <= seconds * 0.1:
            # Latency dominates this sample: keep at least 10% for the transfer so bandwidth
            # stays finite, and pull latency down towards what we saw.
            latency = _mix(latency, seconds * 0.9, alpha)
            transfer = seconds * 0.1
        bandwidth = _mix(current.bandwidth_bps, nbytes / transfer, alpha)
        self._links[machine_id] = LinkEstimate(
            latency, bandwidth, current.latency_samples, current.fetch_samples + 1
        )

    def calibrate_replay(
        self,
        run_replay: Callable[[int, int], object],
        *,
        repeats: int = 3,
        timer: Callable[[], float] = time.perf_counter,
    ) -> float:
        """Time ``run_replay(tokens, layers)`` (the real replay: must block until done) and set
        the per-token-layer cost to the best of ``repeats`` runs. Returns the new cost."""
        if repeats <= 0:
            raise InvalidArgument("repeats", f"must be positive, got {repeats}")
        best = float("inf")
        for _ in range(repeats):
            start = timer()
            run_replay(self.replay_tokens, self.stored_layers)
            best = min(best, timer() - start)
        _check_duration("replay time", best)
        self.cost_per_token_layer_s = best / (self.replay_tokens * self.stored_layers)
        return self.cost_per_token_layer_s

    # --- the estimate -----------------------------------------------------------------

    def fetch_seconds(self, machine_id: str) -> float:
        link = self.link(machine_id)
        return link.latency_s + self.state_bytes / link.bandwidth_bps

    def replay_seconds(self) -> float:
        return self.replay_tokens * self.stored_layers * self.cost_per_token_layer_s

    def advise(self, owner_machine: str, local_machine: str | None = None) -> Advice:
        fetch_s = self.fetch_seconds(owner_machine)
        replay_s = self.replay_seconds()
        return Advice(
            choice=FETCH if fetch_s <= replay_s else REPLAY,
            fetch_s=fetch_s,
            replay_s=replay_s,
            owner_machine=owner_machine,
            local=local_machine is not None and owner_machine == local_machine,
            state_bytes=self.state_bytes,
            replay_tokens=self.replay_tokens,
            stored_layers=self.stored_layers,
            measured=self.link(owner_machine).fetch_samples > 0,
        )


def _mix(old: float, new: float, alpha: float) -> float:
    return (1 - alpha) * old + alpha * new


def _check_duration(name: str, seconds: float) -> None:
    if not (seconds > 0 and seconds != float("inf")):
        raise InvalidArgument(name, f"must be a positive finite duration, got {seconds}")
