"""How long a lost machine takes to repair, and how likely the fleet is to lose a committed block
in a year: the failure model of ``kvstore simulate``, in closed form.

**Repair rate.** One repair process per deployment (``RepairActor``) restores shards at
``repair_bytes_per_s`` at most; for each shard it restores it receives k shards of the stripe
(so its machine's network must carry k times the rate) and the sources' disks read as much,
spread over the fleet. The achievable rate is the smallest of the three.

**Repair time** of a machine = detection (``dead_after_s``) + the shard bytes it held / rate.

**Loss.** Machines fail independently, as a Poisson process at ``afr`` per machine-year; a failed
machine is lost with its shards and repaired onto the others. A stripe of ``width = k + m``
shards on ``width`` distinct machines (uniformly placed: rendezvous hashing) is lost when
``m + 1`` of its machines are down before it is repaired. Two models:

- *kvstore's repair order* (``repairqueue``: most shards lost first). After the first failure
  its stripes are repaired over its repair time; a second failure in that window exposes the
  stripes the two share (``S · w(w-1) / N(N-1)`` of them, minus those already repaired), and
  those are repaired first: they stay exposed only for detection plus their own (small) bytes
  over the rate. Data is lost if a third failure lands on one of them meanwhile. Written for
  any ``m``: each further failure needs the stripes exposed at the stage before.
- *naive overlap*: every failure keeps all its stripes exposed for its whole repair time and no
  stripe goes first; data is lost when ``m + 1`` failures overlap and share a stripe.

Both count stripes as they are now (the bytes held), and treat the expected number of shared
stripes as exact (good when it is large or small, which is where the fleet is).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

YEAR_S = 365.25 * 86400.0
#: Grid points per stage of the loss integral (relative error well under 1 %).
_GRID = 512


@dataclass(frozen=True)
class RepairRate:
    """The shard bytes per second a repair achieves, and what bounds it."""

    bytes_per_s: float
    bound: str
    bounds: dict[str, float]

    def seconds(self, shard_bytes: float, detect_s: float) -> float:
        """Repair time of a machine that held ``shard_bytes``: detection, then the bytes."""
        return detect_s + shard_bytes / self.bytes_per_s


def repair_rate(
    repair_bytes_per_s: float, net_bw: float, disk_bw: float, machines: int, data_shards: int
) -> RepairRate:
    """See the module doc: the cap, the repair machine's network (k shards in per shard
    restored), the other machines' disks (k reads per shard restored, spread over them)."""
    bounds = {
        "repair_bytes_per_s": float(repair_bytes_per_s),
        "repair machine network / k": net_bw / data_shards,
        "source disks / k": max(1, machines - 1) * disk_bw / data_shards,
    }
    bound = min(bounds, key=lambda name: bounds[name])
    return RepairRate(bounds[bound], bound, bounds)


@dataclass(frozen=True)
class LossEstimate:
    """Committed-block loss per year at ``afr``, with both models (module doc)."""

    machines: int
    stripes: float
    width: int
    parity: int
    afr: float
    machine_repair_s: float
    shared_repair_s: float  # how long stripes two failed machines share stay exposed
    events_per_year: float
    naive_events_per_year: float

    @property
    def p_year(self) -> float:
        """Probability of losing at least one committed block in a year (kvstore's order)."""
        return -math.expm1(-self.events_per_year)

    @property
    def naive_p_year(self) -> float:
        return -math.expm1(-self.naive_events_per_year)

    @property
    def mttdl_years(self) -> float:
        """Mean time to data loss."""
        return math.inf if self.events_per_year <= 0 else 1.0 / self.events_per_year

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "p_year": self.p_year,
            "naive_p_year": self.naive_p_year,
            "mttdl_years": None if math.isinf(self.mttdl_years) else self.mttdl_years,
        }


def _p_in(n: np.ndarray, q: float) -> np.ndarray:
    """Probability that a failed machine holds a shard of at least one of ``n`` stripes, each
    holding one with probability ``q``."""
    if q >= 1:
        return (n > 0).astype(np.float64)
    return -np.expm1(n * math.log1p(-q))


def _last_stage(
    n0: np.ndarray, rate: float, q: float, detect_s: float, repair_s: np.ndarray
) -> np.ndarray:
    """Expected failures landing on one of ``n0`` exposed stripes while they are exposed:
    ``n0`` for ``detect_s``, then falling linearly to 0 over ``repair_s`` (closed form)."""
    if q >= 1:  # every machine holds a shard of every stripe (a fleet as wide as a stripe)
        exposed = (n0 > 0).astype(np.float64)
        return rate * (detect_s + repair_s) * exposed
    log_keep = math.log1p(-q)
    x = n0 * log_keep  # <= 0
    with np.errstate(divide="ignore", invalid="ignore"):
        # Mean of 1 - (1 - q)^n over n falling linearly from n0 to 0; for tiny n0 the
        # probability is linear in n and its mean is half its start.
        mean_p = np.where(x < -1e-9, 1.0 - np.expm1(x) / x, n0 * q / 2.0)
    return rate * (detect_s * _p_in(n0, q) + repair_s * mean_p)


def _chain(
    stage: int,
    n0: np.ndarray,
    machines: int,
    width: int,
    parity: int,
    per_machine_rate: float,
    detect_s: float,
    stripe_shard_s: float,
) -> np.ndarray:
    """Probability that, with ``stage`` machines down and ``n0`` stripes missing ``stage``
    shards (exposed, repaired first), failures go on to lose a stripe."""
    rate = (machines - stage) * per_machine_rate
    q = (width - stage) / (machines - stage)
    repair_s = n0 * stage * stripe_shard_s
    if stage == parity:
        return _last_stage(n0, rate, q, detect_s, repair_s)
    # The next failure at time t (rate), sharing n(t) * q of the exposed stripes.
    later = (np.arange(_GRID) + 0.5) / _GRID  # midpoints of the linear fall
    during = _chain(
        stage + 1, n0 * q, machines, width, parity, per_machine_rate, detect_s, stripe_shard_s
    )
    falling = _chain(
        stage + 1,
        (n0[..., None] * (1.0 - later)) * q,
        machines,
        width,
        parity,
        per_machine_rate,
        detect_s,
        stripe_shard_s,
    ).mean(axis=-1)
    return rate * (detect_s * during + repair_s * falling)


def loss_estimate(
    machines: int,
    stripes: float,
    shard_bytes: float,
    rate: RepairRate,
    detect_s: float,
    afr: float,
    width: int = 12,
    parity: int = 2,
) -> LossEstimate:
    """Loss per year of a fleet of ``machines`` holding ``stripes`` stripes of ``width`` shards
    of ``shard_bytes`` each (``parity`` may be lost), failing at ``afr`` a machine-year."""
    per_machine = afr / YEAR_S
    stripe_shard_s = shard_bytes / rate.bytes_per_s
    per_machine_stripes = stripes * width / machines
    machine_repair_s = detect_s + per_machine_stripes * stripe_shard_s
    shared = stripes * width * (width - 1) / (machines * (machines - 1))
    shared_repair_s = detect_s + shared * 2 * stripe_shard_s
    if stripes <= 0 or afr <= 0 or machines <= parity + 1:
        return LossEstimate(
            machines, stripes, width, parity, afr, machine_repair_s, shared_repair_s, 0.0, 0.0
        )
    # The first failure's stripes stay exposed for its whole repair (stage 1 of the chain).
    first = _chain(
        1,
        np.asarray(per_machine_stripes, dtype=np.float64),
        machines,
        width,
        parity,
        per_machine,
        detect_s,
        stripe_shard_s,
    )
    events = machines * per_machine * float(first) * YEAR_S
    # Naive: m later failures, each within the first one's repair window, sharing a stripe.
    overlap = math.prod(
        (machines - j) * per_machine * machine_repair_s for j in range(1, parity + 1)
    )
    share = math.comb(width, parity + 1) / math.comb(machines, parity + 1)
    p_share = -math.expm1(stripes * math.log1p(-share))
    naive = machines * per_machine * overlap / math.factorial(parity) * p_share * YEAR_S
    return LossEstimate(
        machines,
        stripes,
        width,
        parity,
        afr,
        machine_repair_s,
        shared_repair_s,
        events,
        naive,
    )
