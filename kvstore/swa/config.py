"""Configuration of the SWA KVCache tier: one frozen, validated dataclass.

Every number that shapes the tier's behaviour lives here: the per-machine pool bound (docs/rules.md
§7: about 10% of host DRAM), the TTL (minutes), how fast a lost machine's states drop out of the
directory, the timeout of every remote call, and the default costs the fetch-or-replay advice uses
before it has measured anything. Environment variables are read only in ``from_env``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvstore import envconfig  # the one environment loader
from kvstore.errors import ConfigError

_ENV_PREFIX = "KVSTORE_SWA_"


def host_memory_bytes() -> int:
    """Physical memory of the host this process runs on (what the 10% default is a share of)."""
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def _positive_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(name, f"must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(name, f"must be a positive finite number, got {value!r}")
    return float(value)


#: What an actor-name prefix may hold (a block tier deployment's name fits).
_ACTOR_PREFIX = re.compile(r"[A-Za-z0-9_-]+")


def deployment_swa_name(deployment: str) -> str:
    """The SWA actors' name prefix of a deployment: two deployments on one Ray cluster must
    not answer to each other's names (the block tier's actors carry the deployment's name too)."""
    return f"{deployment}-swa"


@dataclass(frozen=True)
class SWAConfig:
    """How the SWA tier of one deployment behaves.

    ``name`` prefixes every Ray actor name of the deployment, so several deployments (tests,
    benchmarks) can share one cluster without colliding.
    """

    name: str = "swa"
    #: Bound of each machine's state pool in bytes; ``None`` = ``capacity_fraction`` of the host
    #: memory of the machine the store runs on, resolved there.
    capacity_bytes: int | None = None
    capacity_fraction: float = 0.10
    #: A state not read or written for this long is dropped (docs/rules.md §7: minutes).
    ttl_s: float = 300.0
    #: Directory shards (entrypoint actors); ``None`` = one per machine at deploy time.
    num_entrypoints: int | None = None
    #: Each store tells every entrypoint it is alive (and syncs its registrations) this often.
    heartbeat_interval_s: float = 1.0
    #: A store not heard from for this long counts as lost: its states answer miss. This is the
    #: "configured time" within which a lost machine's states leave the directory.
    owner_timeout_s: float = 5.0
    #: Upper bound of every remote call (lookup, fetch, sync, put): nothing waits forever.
    call_timeout_s: float = 2.0
    #: Fetch cost model before any fetch to a machine has been measured.
    default_fetch_latency_s: float = 0.002
    default_fetch_bandwidth_bps: float = 1.0e9
    #: Replay cost of one token through one stored SWA layer (seconds); ``calibrate`` replaces it.
    replay_cost_per_token_layer_s: float = 1.0e-6
    #: Weight of a new sample in the per-machine moving estimates of latency and bandwidth.
    estimate_alpha: float = 0.2

    def __post_init__(self) -> None:
        # A prefix of Ray actor names, like a block tier deployment's (which it follows).
        if not isinstance(self.name, str) or not _ACTOR_PREFIX.fullmatch(self.name):
            raise ConfigError("name", f"must be letters, digits, '-' and '_', got {self.name!r}")
        if self.capacity_bytes is not None and (
            isinstance(self.capacity_bytes, bool)
            or not isinstance(self.capacity_bytes, int)
            or self.capacity_bytes <= 0
        ):
            raise ConfigError(
                "capacity_bytes", f"must be a positive integer or None, got {self.capacity_bytes!r}"
            )
        fraction = _positive_number("capacity_fraction", self.capacity_fraction)
        if fraction > 1:
            raise ConfigError("capacity_fraction", f"must be in (0, 1], got {fraction}")
        if self.num_entrypoints is not None and (
            isinstance(self.num_entrypoints, bool)
            or not isinstance(self.num_entrypoints, int)
            or self.num_entrypoints <= 0
        ):
            raise ConfigError(
                "num_entrypoints",
                f"must be a positive integer or None, got {self.num_entrypoints!r}",
            )
        for name in (
            "ttl_s",
            "heartbeat_interval_s",
            "owner_timeout_s",
            "call_timeout_s",
            "default_fetch_latency_s",
            "default_fetch_bandwidth_bps",
            "replay_cost_per_token_layer_s",
            "estimate_alpha",
        ):
            _positive_number(name, getattr(self, name))
        if self.estimate_alpha > 1:
            raise ConfigError("estimate_alpha", f"must be in (0, 1], got {self.estimate_alpha}")
        # A live store must be able to miss one heartbeat without being declared lost.
        if self.owner_timeout_s < 2 * self.heartbeat_interval_s:
            raise ConfigError(
                "owner_timeout_s",
                f"must be at least twice heartbeat_interval_s ({self.heartbeat_interval_s}), "
                f"got {self.owner_timeout_s}",
            )

    def resolved_capacity_bytes(self, host_bytes: int | None = None) -> int:
        """The pool bound on this host: ``capacity_bytes`` or the configured share of memory."""
        if self.capacity_bytes is not None:
            return self.capacity_bytes
        total = host_memory_bytes() if host_bytes is None else host_bytes
        return int(total * self.capacity_fraction)

    def with_changes(self, **changes: Any) -> SWAConfig:
        return replace(self, **changes)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SWAConfig:
        """Read ``KVSTORE_SWA_<FIELD>`` variables (e.g. ``KVSTORE_SWA_TTL_S=120``;
        ``auto`` for the optional sizes)."""
        return envconfig.from_env(cls, _ENV_PREFIX, env)
