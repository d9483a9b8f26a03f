"""The report of ``kvstore simulate``: a model run, the capacity a target hit rate needs, the
repair times and the loss model's figures, as one JSON object and as the table it prints."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvstore.humanize import duration
from kvstore.humanize import size as _size
from kvstore.trace.fleetrisk import LossEstimate, loss_estimate
from kvstore.trace.simulate import DATA_SHARDS, PARITY_SHARDS, SimResult
from kvstore.trace.sizing import Sizing

#: Width of the printed table.
LINE_WIDTH = 100
#: The model, as the report states it.
LOSS_MODEL = (
    "machines fail independently (Poisson, AFR per machine-year) and are lost with their "
    "shards; a stripe (12 shards on 12 distinct machines) is lost when 3 of its machines are "
    "down before it is repaired. After a failure its stripes are repaired over its repair time; "
    "a second failure meanwhile exposes the stripes the two share, which the repair does first "
    "(most shards lost first), so they stay exposed for detection plus their own bytes / rate; "
    "data is lost if a third failure hits one of them then. Naive: no order, every failed "
    "machine's stripes exposed for its whole repair time."
)


def size(value: float) -> str:
    """Bytes for a person, up to petabytes (a fleet's capacity is)."""
    return f"{value / 1e15:.2f} PB" if abs(value) >= 1e15 else _size(value)


def spread(values: np.ndarray) -> dict[str, float]:
    """Mean, p50, p99 and max over machines."""
    if values.size == 0:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0}
    return {
        "mean": float(values.mean()),
        "p50": float(np.percentile(values, 50)),
        "p99": float(np.percentile(values, 99)),
        "max": float(values.max()),
    }


@dataclass(frozen=True)
class FleetReport:
    """Everything ``kvstore simulate`` says about one run."""

    trace: str
    result: SimResult
    sizing: Sizing | None
    loss_now: LossEstimate  # with the stripes held at the end of the run
    loss_full: LossEstimate | None  # with every machine at the high watermark
    wall_s: float

    @classmethod
    def of(cls, trace: str, result: SimResult, sizing: Sizing | None, wall_s: float) -> FleetReport:
        config = result.config
        store = config.store_config()
        sizes = config.sizes
        live = ~result.machines.dead

        def loss(stripes: float) -> LossEstimate:
            return loss_estimate(
                int(live.sum()),
                stripes,
                sizes.live,
                result.repair,
                store.dead_after_s,
                config.afr,
                DATA_SHARDS + PARITY_SHARDS,
                PARITY_SHARDS,
            )

        capacity = config.capacity_payload_bytes()
        full = None
        if capacity is not None:
            full = loss(capacity * config.gc_high / sizes.block_bytes)
        return cls(trace, result, sizing, loss(result.blocks_stored), full, wall_s)

    # --- figures -----------------------------------------------------------------------------

    def network(self) -> dict[str, dict[str, float]]:
        """Bytes per second per live machine: network (in + out) and disk (read + write)."""
        machines = self.result.machines
        live = ~machines.dead
        seconds = max(self.result.duration_s, 1e-9)
        net = (machines.net_in + machines.net_out)[live] / seconds
        disk = (machines.disk_read + machines.disk_write)[live] / seconds
        return {"network": spread(net), "disk": spread(disk)}

    def repair_times(self) -> dict[str, float]:
        """Repair time of a machine holding the mean and the most bytes at the end."""
        machines = self.result.machines
        held = machines.held_bytes[~machines.dead]
        detect = self.result.config.store_config().dead_after_s
        rate = self.result.repair
        mean = float(held.mean()) if held.size else 0.0
        most = float(held.max()) if held.size else 0.0
        return {
            "mean_machine_bytes": mean,
            "mean_machine_s": rate.seconds(mean, detect),
            "fullest_machine_bytes": most,
            "fullest_machine_s": rate.seconds(most, detect),
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "trace": self.trace,
            **self.result.as_dict(),
            "per_machine_bytes_per_s": self.network(),
            "repair_time": self.repair_times(),
            "sizing": None if self.sizing is None else asdict(self.sizing),
            "loss_model": LOSS_MODEL,
            "loss_as_held": self.loss_now.as_dict(),
            "loss_at_capacity": None if self.loss_full is None else self.loss_full.as_dict(),
            "wall_s": round(self.wall_s, 1),
        }

    # --- the table ---------------------------------------------------------------------------

    def lines(self) -> list[str]:
        result, config = self.result, self.result.config
        sizes = config.sizes
        rows: list[tuple[str, str]] = []
        rate = result.prompt_tokens / max(result.duration_s, 1e-9) * config.copies
        rows.append(
            (
                "trace",
                f"{self.trace}: {result.requests:,} requests, {result.prompt_tokens:,} prompt "
                f"tokens over {result.duration_s:,.0f} s (speed {config.speed:g})",
            )
        )
        rows.append(
            (
                "fleet",
                f"{config.machines:,} machines; {config.copies:,} copies of the trace "
                f"(disjoint keys, in step) = {rate / 1e6:,.2f} M prompt tokens/s",
            )
        )
        capacity = config.capacity_payload_bytes()
        node = config.node_capacity()
        bound = (
            "unbounded"
            if capacity is None or node is None
            else f"{size(capacity)} payload = {size(node * config.copies)} a machine"
        )
        rows.append(
            (
                "tier",
                f"10+2 erasure coding, {size(sizes.block_bytes)} blocks; capacity {bound}; "
                f"GC {config.gc_high:g} / {config.gc_low:g}, "
                + (
                    f"a pass after every {config.gc_every_requests} requests"
                    if config.gc_every_requests
                    else f"a pass every {config.gc_interval_s:g} s"
                )
                + (" and one after the last request" if config.gc_at_end else ""),
            )
        )
        rows.append(("token hit rate", f"{result.token_hit_rate:.1%} of prompt tokens"))
        rows.append(("  over time", _over_time(result)))
        rows.append(
            (
                "stored",
                f"{size(result.bytes_stored)} payload at the end "
                f"({size(result.blocks_stored * sizes.disk * sizes.width)} on disk); "
                f"written {size(result.bytes_written)}, evicted {size(result.bytes_evicted)}, "
                f"expired {size(result.bytes_expired)}",
            )
        )
        for name, figures in result.by_class.items():
            rows.append(
                (
                    f"  {name}",
                    f"stored {size(figures.bytes_stored)}, written {size(figures.bytes_written)}"
                    f", evicted {size(figures.bytes_evicted)}, "
                    f"expired {size(figures.bytes_expired)}",
                )
            )
        if result.blocks_refused or result.blocks_under_redundant or result.blocks_lost:
            rows.append(
                (
                    "  puts",
                    f"{result.blocks_refused:,} blocks refused (tier full), "
                    f"{result.blocks_under_redundant:,} under-redundant, "
                    f"{result.blocks_lost:,} lost",
                )
            )
        rows.extend(self._network_rows())
        rows.extend(self._sizing_rows())
        rows.extend(self._repair_rows())
        rows.extend(self._loss_rows())
        rows.append(("wall time", f"{self.wall_s:.1f} s"))
        width = max(len(label) for label, _ in rows)
        lines = []
        for label, text in rows:
            wrapped = textwrap.wrap(text, LINE_WIDTH - width - 2) or [""]
            lines.append(f"{label.ljust(width)}  {wrapped[0]}")
            lines.extend(" " * (width + 2) + more for more in wrapped[1:])
        return lines

    def _network_rows(self) -> list[tuple[str, str]]:
        config = self.result.config
        figures = self.network()
        net, disk = figures["network"], figures["disk"]
        return [
            (
                "network / machine",
                f"mean {size(net['mean'])}/s, p99 {size(net['p99'])}/s, max "
                f"{size(net['max'])}/s ({_share(net['p99'] / config.net_bw)} of "
                f"{size(config.net_bw)}/s at p99)",
            ),
            (
                "disk / machine",
                f"mean {size(disk['mean'])}/s, p99 {size(disk['p99'])}/s "
                f"({_share(disk['p99'] / config.disk_bw)} of {size(config.disk_bw)}/s at p99)",
            ),
        ]

    def _sizing_rows(self) -> list[tuple[str, str]]:
        sizing = self.sizing
        if sizing is None:
            return []
        runs = len(sizing.evaluations)
        if not sizing.reachable:
            return [
                (
                    "capacity needed",
                    f"{sizing.target:.1%} token hit rate is out of reach: an unbounded tier "
                    f"gives {sizing.best_hit_rate:.1%} on this trace",
                )
            ]
        assert sizing.capacity_bytes is not None and sizing.machine_live_bytes is not None
        assert sizing.machine_disk_bytes is not None and sizing.hit_rate is not None
        return [
            (
                "capacity needed",
                f"for {sizing.target:.1%} token hit rate (unbounded: "
                f"{sizing.best_hit_rate:.1%}): {size(sizing.machine_live_bytes)} a machine "
                f"(`kvstore up --capacity-bytes`; {size(sizing.machine_disk_bytes)} on disk) "
                f"= {size(sizing.capacity_bytes)} payload in the fleet; the model gives "
                f"{sizing.hit_rate:.1%} there ({runs} runs of the model, bisection)",
            )
        ]

    def _repair_rows(self) -> list[tuple[str, str]]:
        result = self.result
        rate = result.repair
        times = self.repair_times()
        rows = [
            (
                "repair",
                f"{size(rate.bytes_per_s)}/s (bound: {rate.bound}); a machine holding the mean "
                f"{size(times['mean_machine_bytes'])}: {duration(times['mean_machine_s'])}, "
                f"the fullest {size(times['fullest_machine_bytes'])}: "
                f"{duration(times['fullest_machine_s'])} (detection + bytes / rate)",
            )
        ]
        expected = result.config.machines * result.config.afr * result.duration_s / (365.25 * 86400)
        if not result.failures:
            rows.append(
                (
                    "  failures",
                    f"none (AFR {result.config.afr:.1%}: {expected:.2g} expected in this run; "
                    "--fail N injects some)",
                )
            )
        for failure in result.failures:
            simulated = (
                "not done by the end"
                if failure.simulated_repair_s is None
                else duration(failure.simulated_repair_s)
            )
            rows.append(
                (
                    "  failure",
                    f"machine {failure.machine} at {failure.at_s:,.0f} s "
                    f"({'injected' if failure.injected else 'AFR'}): held "
                    f"{size(failure.live_bytes)}, repair {duration(failure.repair_s)} "
                    f"(the model's queue ran dry after {simulated})",
                )
            )
        return rows

    def _loss_rows(self) -> list[tuple[str, str]]:
        rows = [
            ("P(loss) / year", _loss_text(self.loss_now, "with the blocks held at the end")),
        ]
        if self.loss_full is not None:
            rows.append(("", _loss_text(self.loss_full, "with every machine at the high mark")))
        rows.append(("  model", LOSS_MODEL))
        return rows


def _share(fraction: float) -> str:
    """A percentage with two significant digits (0.47%, 0.0012%)."""
    return f"{fraction * 100:.2g}%"


def _loss_text(loss: LossEstimate, what: str) -> str:
    return (
        f"{loss.p_year:.3g} at AFR {loss.afr:.1%} {what} ({loss.stripes:,.0f} stripes, "
        f"machine repair {duration(loss.machine_repair_s)}, shared stripes exposed "
        f"{duration(loss.shared_repair_s)}); naive overlap model {loss.naive_p_year:.3g}"
    )


def _over_time(result: SimResult, buckets: int = 12) -> str:
    """The timeline as a few percentages (the buckets merged down to ``buckets``)."""
    timeline = result.timeline
    if not timeline:
        return "-"
    count = min(buckets, len(timeline))
    groups: Sequence[range] = [
        range(i * len(timeline) // count, (i + 1) * len(timeline) // count) for i in range(count)
    ]
    parts = []
    for group in groups:
        prompt = sum(timeline[i].prompt_tokens for i in group)
        hit = sum(timeline[i].hit_tokens for i in group)
        if group:
            parts.append(f"{hit / prompt:.0%}" if prompt else "-")
    span = result.duration_s / max(1, len(parts))
    return " ".join(parts) + f" ({len(parts)} spans of ~{duration(span)})"
