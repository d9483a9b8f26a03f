"""Repair, drain and scrub figures (the repair actor's ``stats()``, handed on as
``Stats.extra["repair"]``) in Prometheus and in the one-line views `kvstore stats` / `status`
print; figures the actor does not report are left out (Prometheus) or shown as n/a."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.api.metrics import ApiMetrics
from kvstore.commands import _repair
from kvstore.tier.records import Stats

REPAIR: dict[str, Any] = {
    "stripes": 40,
    "shards": 48,
    "bytes": 6_000_000,
    "seconds": 2.0,
    "unrecoverable": 0,
    "dead_nodes": [],
    "failing_nodes": [],
    "ticks": 9,
    "errors": 0,
    "progress": {
        "stripes_left": 120,
        "bytes_left": 1_200_000_000,
        "lost_2": 3,
        "lost_1": 9,
        "moving": 108,
        "rate_bytes_per_s": 80e6,
        "eta_s": 15.0,
    },
    "draining": {
        "3": {"stripes_left": 108, "bytes_left": 1_100_000_000, "done": False},
        "11": {"stripes_left": 0, "bytes_left": 0, "done": True},
    },
    "scrub": {"shards": 8123, "bytes": 1_100_000_000, "corrupt": 2, "rate_bytes_per_s": 30e6},
}


def samples(repair: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    stats = Stats(repairs_done=4, storage_nodes=13, live_storage_nodes=13, extra={"repair": repair})
    metrics = ApiMetrics(lambda: stats)
    text = generate_latest(metrics.registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_every_repair_figure_is_exported() -> None:
    got = samples(REPAIR)
    assert got[("kvstore_repair_bytes_left", ())] == 1.2e9
    assert got[("kvstore_repair_stripes_left", (("lost", "2"),))] == 3
    assert got[("kvstore_repair_stripes_left", (("lost", "1"),))] == 9
    assert got[("kvstore_repair_stripes_left", (("lost", "moving"),))] == 108
    assert got[("kvstore_repair_rate_bytes_per_second", ())] == 80e6
    assert got[("kvstore_repair_eta_seconds", ())] == 15.0
    assert got[("kvstore_scrub_bytes_total", ())] == 1.1e9
    assert got[("kvstore_scrub_corrupt_shards_total", ())] == 2
    assert got[("kvstore_draining_stripes_left", (("node", "3"),))] == 108
    assert got[("kvstore_draining_stripes_left", (("node", "11"),))] == 0
    # The gauge that was there before stays.
    assert got[("kvstore_repair_stripes", (("state", "done"),))] == 4


def test_figures_the_repair_actor_does_not_report_are_not_exported() -> None:
    old = {key: REPAIR[key] for key in ("stripes", "shards", "bytes", "dead_nodes", "ticks")}
    partial = {**old, "progress": {"stripes_left": 5, "lost_1": 5, "eta_s": None}}
    for repair in ({}, None, old, partial):
        names = {name for name, _ in samples(repair)}
        assert "kvstore_repair_stripes" in names  # the existing gauge is always there
        new = {n for n in names if n.startswith(("kvstore_repair_", "kvstore_scrub", "kvstore_dr"))}
        if repair is partial:
            assert new == {"kvstore_repair_stripes", "kvstore_repair_stripes_left"}
            got = samples(repair)
            assert ("kvstore_repair_stripes_left", (("lost", "2"),)) not in got
            assert got[("kvstore_repair_stripes_left", (("lost", "1"),))] == 5
        else:
            assert new == {"kvstore_repair_stripes"}, repair


def test_one_line_views() -> None:
    assert _repair.progress_line(REPAIR) == (
        "120 stripes / 1.20 GB left (lost 2: 3, lost 1: 9, moving: 108), 80.0 MB/s, ETA 15 s"
    )
    assert _repair.drain_line(REPAIR) == (
        "node 3: 108 stripes / 1.10 GB left; node 11: done, safe to stop"
    )
    assert _repair.scrub_line(REPAIR) == "8123 shards / 1.10 GB verified, 2 corrupt, 30.0 MB/s"
    nothing = {"progress": {"stripes_left": 0, "bytes_left": 0}}
    assert _repair.progress_line(nothing) == "nothing to restore or move"
    assert _repair.drain_line(nothing) is None


def test_missing_figures_read_n_a() -> None:
    assert _repair.progress_line({}) == "n/a"
    assert _repair.scrub_line({"scrub": "junk"}) == "n/a"
    line = _repair.progress_line({"progress": {"stripes_left": 7}})
    assert line.startswith("7 stripes / n/a left (lost 2: n/a") and line.endswith("ETA n/a")
    assert _repair.drain_line({"draining": {"4": {}}}) == "node 4: n/a stripes / n/a left"
    assert _repair.repair_of({"repair": None}) == {}


def test_human_units() -> None:
    assert _repair.size(999) == "999 B"
    assert _repair.size(1_500) == "1.5 kB"
    assert _repair.size(2.5e12) == "2.50 TB"
    assert _repair.duration(59.4) == "59 s"
    assert _repair.duration(185) == "3m05s"
    assert _repair.duration(7620) == "2h07m"
    assert _repair.bar(5, 10, width=10) == "[#####-----]  50%"
    assert _repair.bar(0, 0, width=4) == "[####] 100%"
