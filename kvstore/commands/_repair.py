"""Repair, drain and scrub figures as one line each, for ``kvstore stats``, ``kvstore status``
and ``kvstore drain``.

The figures are the repair actor's ``stats()`` (a gateway hands them on as
``Stats.extra["repair"]``). Every key may be missing — an older repair actor, a tenant's view,
a repair actor that did not answer — and a missing figure is shown as ``n/a``, never guessed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvstore.humanize import NA, duration, rate, size
from kvstore.tier.records import stat_number as number


def count(value: float | None) -> str:
    return NA if value is None else str(int(value))


def bar(done: float, total: float, width: int = 20) -> str:
    """``[########------------]  40%``; full when there is nothing to do."""
    fraction = 1.0 if total <= 0 else min(1.0, max(0.0, done / total))
    filled = int(round(fraction * width))
    return f"[{'#' * filled}{'-' * (width - filled)}] {fraction:4.0%}"


def repair_of(extra: Any) -> Mapping[str, Any]:
    """The repair actor's figures in a Stats' ``extra`` (empty when it has none)."""
    repair = extra.get("repair") if isinstance(extra, Mapping) else None
    return repair if isinstance(repair, Mapping) else {}


def progress_line(repair: Mapping[str, Any]) -> str:
    """What repair has left: ``120 stripes / 1.20 GB left (lost 2: 0, lost 1: 12, moving:
    108), 85.0 MB/s, ETA 15 s``."""
    progress = repair.get("progress")
    if not isinstance(progress, Mapping):
        return NA
    stripes = number(progress, "stripes_left")
    left = number(progress, "bytes_left")
    if stripes == 0:
        return "nothing to restore or move"
    parts = ", ".join(
        f"{label}: {count(number(progress, key))}"
        for label, key in (("lost 2", "lost_2"), ("lost 1", "lost_1"), ("moving", "moving"))
    )
    return (
        f"{count(stripes)} stripes / {size(left)} left ({parts}), "
        f"{rate(number(progress, 'rate_bytes_per_s'))}, "
        f"ETA {duration(number(progress, 'eta_s'))}"
    )


def draining_of(repair: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
    """The drains the repair actor reports, by node id."""
    draining = repair.get("draining")
    if not isinstance(draining, Mapping):
        return {}
    out: dict[int, Mapping[str, Any]] = {}
    for key, entry in draining.items():
        try:
            out[int(key)] = entry if isinstance(entry, Mapping) else {}
        except (TypeError, ValueError):
            continue
    return dict(sorted(out.items()))


def drain_line(repair: Mapping[str, Any]) -> str | None:
    """``node 3: 108 stripes / 1.10 GB left; node 5: done, safe to stop``; None: no drain."""
    drains = draining_of(repair)
    if not drains:
        return None
    parts = []
    for node, entry in drains.items():
        if entry.get("done"):
            parts.append(f"node {node}: done, safe to stop")
        else:
            stripes = count(number(entry, "stripes_left"))
            parts.append(
                f"node {node}: {stripes} stripes / {size(number(entry, 'bytes_left'))} left"
            )
    return "; ".join(parts)


def scrub_line(repair: Mapping[str, Any]) -> str:
    """``8123 shards / 1.10 GB verified, 0 corrupt, 30.0 MB/s``."""
    scrub = repair.get("scrub")
    if not isinstance(scrub, Mapping):
        return NA
    return (
        f"{count(number(scrub, 'shards'))} shards / {size(number(scrub, 'bytes'))} verified, "
        f"{count(number(scrub, 'corrupt'))} corrupt, {rate(number(scrub, 'rate_bytes_per_s'))}"
    )
