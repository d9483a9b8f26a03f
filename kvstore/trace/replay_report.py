"""The report of a trace replay: the summary (``summary.json``), the table ``kvstore replay``
prints, and the plots (token hit rate over trace time against both oracles; latencies)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.demo.report import _percentile_ms as percentile_ms
from kvstore.humanize import size as human_bytes
from kvstore.tier.records import Stats
from kvstore.trace.oracle import OracleResult
from kvstore.trace.served import Served

#: Windows of trace time the hit rate is shown over.
TIME_WINDOWS = 40


def _rate(hit: float, prompt: float) -> float:
    return round(hit / prompt, 4) if prompt else 0.0


def _latencies(values: Sequence[float | None]) -> dict[str, float | None]:
    made = [value for value in values if value is not None]
    return {"p50": percentile_ms(made, 50), "p99": percentile_ms(made, 99), "calls": len(made)}


def _over_time(
    served: Sequence[Served], oracles: Mapping[str, OracleResult | None]
) -> dict[str, Any]:
    """Token hit rate per window of trace time: the replay's and each oracle's."""
    if not served:
        return {"window_s": 0.0, "start_s": [], "replay": []}
    at = np.array([s.at_s for s in served])
    prompt = np.array([s.prompt_tokens for s in served], np.float64)
    width = max(float(at.max()) / TIME_WINDOWS, 1e-9)
    window = np.minimum((at / width).astype(np.int64), TIME_WINDOWS - 1)
    prompts = np.bincount(window, prompt, TIME_WINDOWS)
    series: dict[str, Any] = {
        "window_s": round(width, 3),
        "start_s": [round(i * width, 1) for i in range(TIME_WINDOWS)],
    }
    hits = {"replay": np.array([s.hit_tokens for s in served], np.float64)}
    for name, oracle in oracles.items():
        if oracle is not None:
            hits[name] = oracle.hit_tokens[: len(served)].astype(np.float64)
    for name, tokens in hits.items():
        per = np.bincount(window, tokens, TIME_WINDOWS)
        series[name] = [_rate(h, p) for h, p in zip(per, prompts, strict=True)]
    return series


def _classes(stats: Stats, gc: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Per traffic class: bytes stored at the end, miss reasons (the tier's names), and what
    the GC evicted and expired over the run (None when the tier was reached over gRPC only)."""
    removed = (gc or {}).get("removed")
    out: dict[str, dict[str, Any]] = {}
    for name, figures in sorted(stats.classes.items()):
        row: dict[str, Any] = {
            "stored_bytes": int(figures.get("stored_bytes", 0)),
            "lookups": int(figures.get("lookups", 0)),
            "miss_reasons": dict(figures.get("miss_reasons", {})),
        }
        for reason in ("evicted", "expired"):
            tally = removed.get(reason, {}).get(name, {}) if removed is not None else None
            row[f"{reason}_blocks"] = None if tally is None else int(tally.get("blocks", 0))
            row[f"{reason}_bytes"] = None if tally is None else int(tally.get("bytes", 0))
        out[name] = row
    return out


def _removed_total(classes: Mapping[str, Mapping[str, Any]], reason: str) -> dict[str, int] | None:
    rows = [row for row in classes.values() if row[f"{reason}_blocks"] is not None]
    if not rows:
        return None
    return {
        "blocks": sum(row[f"{reason}_blocks"] for row in rows),
        "bytes": sum(row[f"{reason}_bytes"] for row in rows),
    }


def summarize(
    served: Sequence[Served],
    oracles: Mapping[str, OracleResult | None],
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The run in figures. ``extra``: the run's settings, plus ``stats`` (the tier's ``Stats``
    at the end) and ``gc`` (the GC worker's status, or None)."""
    extra = dict(extra)
    stats: Stats = extra.pop("stats")
    gc = extra.pop("gc")
    prompt = sum(s.prompt_tokens for s in served)
    hit = sum(s.hit_tokens for s in served)
    rate = _rate(hit, prompt)
    compared: dict[str, Any] = {}
    for name, oracle in oracles.items():
        if oracle is None:
            compared[name] = None
            continue
        theirs = oracle.token_hit_rate
        compared[name] = {
            "token_hit_rate": round(theirs, 4),
            "replay_ratio": round(hit / prompt / theirs, 4) if prompt and theirs else None,
            "blocks_written": oracle.blocks_written,
            "blocks_evicted": oracle.blocks_evicted,
        }
    classes = _classes(stats, gc)
    return {
        "requests": len(served),
        "prompt_tokens": prompt,
        "hit_tokens": hit,
        "token_hit_rate": rate,
        "planned_hit_tokens": sum(s.planned_hit_tokens for s in served),
        "oracles": compared,
        "full_blocks": sum(s.blocks for s in served),
        "blocks_fetched": sum(s.blocks_fetched for s in served),
        "blocks_put": sum(s.blocks_put for s in served),
        "load_errors": sum(s.load_errors for s in served),
        "put_failures": sum(s.put_failures for s in served),
        "wrong_bytes": sum(s.wrong_bytes for s in served),
        "latency_ms": {
            "query_hit": _latencies([s.query_hit_s for s in served]),
            "get_blocks": _latencies([s.get_blocks_s for s in served]),
            "put_blocks": _latencies([s.put_blocks_s for s in served]),
        },
        "classes": classes,
        "evicted": _removed_total(classes, "evicted"),
        "expired": _removed_total(classes, "expired"),
        "block_bytes_stored": stats.block_bytes_stored,
        "gc_passes": None if gc is None else gc.get("passes"),
        "gc_last_pass": None if gc is None else gc.get("last_pass"),
        "hit_rate_over_time": _over_time(served, oracles),
        **extra,
    }


# --- the table -------------------------------------------------------------------------------


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _ms(figures: Mapping[str, Any]) -> str:
    if figures["p50"] is None:
        return "— (no call)"
    return f"{figures['p50']} / {figures['p99']} ms ({figures['calls']:,} calls)"


def format_report(summary: Mapping[str, Any]) -> str:
    """The table ``kvstore replay`` prints."""
    s = summary
    lines = [f"kvstore replay — {s['trace']}" + ("  (INTERRUPTED)" if s["interrupted"] else "")]

    def row(label: str, text: str) -> None:
        lines.append(f"  {label:<27}{text}")

    facts = s.get("facts") or {}
    row(
        "requests",
        f"{s['requests']:,} of {s['requests_in_slice']:,}"
        + (f" (trace time {facts['seconds']:,.0f} s)" if facts else ""),
    )
    row(
        "prompt tokens",
        f"{s['prompt_tokens']:,} ({s['full_blocks']:,} full blocks, "
        f"{facts.get('unique_kv_blocks', 0):,} unique)",
    )
    row("mode / traffic class", f"{s['mode']} / {s['traffic_class']}")
    pace = "as fast as possible" if s["speed"] is None else f"trace time / {s['speed']:g}"
    row("engines", f"{s['engines']} ({pace}), {s['tier']} tier at {s['address']}")
    row(
        "payload",
        f"{s['block_bytes']:,} B a block (scale {s['payload_scale']:g} of the model's "
        f"{s['model_block_bytes']:,} B)",
    )
    if s["capacity_blocks"] is None:
        row("capacity", "unbounded")
    else:
        row(
            "capacity",
            f"{s['capacity_blocks']:,} blocks = {human_bytes(s['capacity_model_bytes'])} of "
            f"model block payload ({s['capacity_fraction']:.1%} of the unique blocks)",
        )
        if s["tier"] == "running gateway":
            row("", "sizes the LRU oracle only: the running tier's own capacity and GC apply")
        if s["node_capacity_bytes"] is not None:
            row(
                "",
                f"storage nodes {s['storage_nodes']} × {s['node_capacity_bytes']:,} B "
                f"({s['node_headroom']:g}× the capacity: room for the writes during a GC pass), "
                f"segments {s['segment_bytes']:,} B",
            )
    if s["gc_watermarks"] is not None:
        marks = s["gc_watermarks"]
        given = ""
        if s["node_capacity_bytes"] is not None and s["gc_node_watermarks"]:
            high, low = s["gc_node_watermarks"]
            given = f" of the capacity (the GC's: {high:.3f} / {low:.3f} of the nodes')"
        row(
            "GC watermarks",
            f"high {marks['high']:g} / low {marks['low']:g}{given}, a pass every "
            f"{s['gc_scan_interval_s']:g} s (deployment default 0.90 / 0.80, 60 s)",
        )
    else:
        row("GC", "the running tier's own")
    held = s.get("occupancy") or {}
    if held.get("samples"):
        if "mean_of_capacity_once_full" in held:
            text = (
                f"{held['mean_of_capacity_once_full']:.1%} of the capacity on average once "
                f"full, at most {held['max_of_capacity']:.1%}"
            )
        else:
            text = f"{held['mean_blocks']:,} blocks on average, at most {held['max_blocks']:,}"
        row("tier held", f"{text} ({held['samples']} samples)")
    lines.append("")
    row("token hit rate", _pct(s["token_hit_rate"]))
    for name, label in (("infinite", "infinite-cache oracle"), ("lru", "LRU oracle")):
        oracle = s["oracles"].get(name)
        if oracle is None:
            row(label, "— (unbounded capacity)")
            continue
        ratio = oracle["replay_ratio"]
        row(
            label,
            f"{_pct(oracle['token_hit_rate'])}  (replay = "
            f"{'n/a' if ratio is None else f'{ratio:.3f}'}×)",
        )
    row(
        "blocks fetched / put",
        f"{s['blocks_fetched']:,} / {s['blocks_put']:,} (hit promised "
        f"{s['planned_hit_tokens']:,} tokens, used {s['hit_tokens']:,})",
    )
    for name, figures in s["classes"].items():
        if not (figures["lookups"] or figures["stored_bytes"] or figures["evicted_blocks"]):
            continue
        evicted = (
            "n/a"
            if figures["evicted_blocks"] is None
            else f"{figures['evicted_blocks']:,} blocks, {human_bytes(figures['evicted_bytes'])}"
        )
        row(f"class {name}", f"stored {human_bytes(figures['stored_bytes'])}; evicted {evicted}")
        reasons = ", ".join(
            f"{reason} {count:,}" for reason, count in sorted(figures["miss_reasons"].items())
        )
        row("  miss reasons (blocks)", reasons or "none")
    total = s["evicted"]
    row(
        "evicted by the GC",
        "n/a (tier reached over gRPC only)"
        if total is None
        else f"{total['blocks']:,} blocks, {human_bytes(total['bytes'])} ({s['gc_passes']} passes)",
    )
    latency = s["latency_ms"]
    row("QueryHit p50 / p99", _ms(latency["query_hit"]))
    row("GetBlocks p50 / p99", _ms(latency["get_blocks"]))
    row("PutBlocks p50 / p99", _ms(latency["put_blocks"]))
    row("load errors (recomputed)", f"{s['load_errors']:,}")
    row("put failures", f"{s['put_failures']:,}")
    row("wrong bytes", f"{s['wrong_bytes']:,}")
    row("wall time", f"{s['wall_seconds']:,.1f} s (engines {s['traffic_seconds']:,.1f} s)")
    if s.get("report_files"):
        row("report", ", ".join(s["report_files"]))
    return "\n".join(lines)


# --- the files -------------------------------------------------------------------------------


def write_report(directory: Path, summary: dict[str, Any], served: Sequence[Served]) -> list[Path]:
    """``summary.json``, ``hit_rate.png`` and ``latency.png`` in ``directory``; returns them."""
    import matplotlib

    matplotlib.use("Agg")  # no screen here; a file is the product
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = [directory / "summary.json", directory / "hit_rate.png", directory / "latency.png"]
    summary["report_files"] = [str(path) for path in written]
    written[0].write_text(json.dumps(summary, indent=2, sort_keys=True, default=str))

    series = summary["hit_rate_over_time"]
    figure, axis = plt.subplots(figsize=(9, 4))
    starts = np.asarray(series["start_s"]) + series["window_s"] / 2
    for name, label, style in (
        ("replay", f"replay ({_pct(summary['token_hit_rate'])})", "-"),
        ("infinite", "infinite-cache oracle", "--"),
        ("lru", f"LRU oracle ({summary['capacity_blocks'] or 0:,} blocks)", ":"),
    ):
        if name in series and len(series[name]):
            oracle = summary["oracles"].get(name)
            if oracle is not None:
                label = f"{label} ({_pct(oracle['token_hit_rate'])})"
            axis.plot(starts, series[name], style, label=label)
    axis.set_xlabel("trace time (s)")
    axis.set_ylabel(f"token hit rate per {series['window_s']:.0f} s window")
    axis.set_ylim(0, 1)
    axis.legend()
    axis.set_title(f"kvstore replay: {summary['trace']}")
    figure.tight_layout()
    figure.savefig(written[1], dpi=100)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(9, 4))
    for attribute, label in (
        ("query_hit_s", "QueryHit"),
        ("get_blocks_s", "GetBlocks"),
        ("put_blocks_s", "PutBlocks"),
    ):
        made = [row for row in served if getattr(row, attribute) is not None]
        if made:
            axis.scatter(
                [row.at_s for row in made],
                [getattr(row, attribute) * 1e3 for row in made],
                s=4,
                label=label,
            )
    axis.set_yscale("log")
    axis.set_xlabel("trace time of the request (s)")
    axis.set_ylabel("latency (ms)")
    axis.legend()
    axis.set_title("kvstore replay: latency per request")
    figure.tight_layout()
    figure.savefig(written[2], dpi=100)
    plt.close(figure)
    return written
