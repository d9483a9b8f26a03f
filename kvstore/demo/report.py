"""Summary figures and plots of a demo run (``demo-report/summary.json`` + PNGs)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.demo.engine import RequestOutcome


def _percentile_ms(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(np.asarray(values) * 1e3, q)), 2) if values else None


def summarize(outcomes: Sequence[RequestOutcome], extra: dict[str, Any]) -> dict[str, Any]:
    by_class: dict[str, dict[str, Any]] = {}
    for name in sorted({o.traffic_class for o in outcomes}):
        rows = [o for o in outcomes if o.traffic_class == name]
        prompt = sum(o.prompt_tokens for o in rows)
        hit = sum(o.hit_tokens for o in rows)
        by_class[name] = {
            "requests": len(rows),
            "prompt_tokens": prompt,
            "hit_tokens": hit,
            "token_hit_rate": round(hit / prompt, 4) if prompt else 0.0,
            "swa_hits": sum(o.swa_hit for o in rows),
        }
    query = [o.query_hit_s for o in outcomes]
    fetch = [o.fetch_s for o in outcomes if o.fetch_s is not None]
    return {
        "requests": len(outcomes),
        "classes": by_class,
        "prefill_tokens_saved": sum(o.hit_tokens for o in outcomes),
        "prompt_tokens": sum(o.prompt_tokens for o in outcomes),
        "blocks_fetched": sum(o.blocks_fetched for o in outcomes),
        "blocks_put": sum(o.blocks_put for o in outcomes),
        "load_errors": sum(o.load_errors for o in outcomes),
        "wrong_bytes_reads": sum(o.wrong_bytes for o in outcomes),
        "degraded_reads_seen": sum(o.degraded_reads for o in outcomes),
        "query_hit_ms": {"p50": _percentile_ms(query, 50), "p99": _percentile_ms(query, 99)},
        "block_fetch_ms": {"p50": _percentile_ms(fetch, 50), "p99": _percentile_ms(fetch, 99)},
        **extra,
    }


def write_report(
    directory: Path, summary: dict[str, Any], outcomes: Sequence[RequestOutcome]
) -> list[Path]:
    """Write summary.json and the plots; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")  # no screen here; a file is the product
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = [directory / "summary.json"]
    written[0].write_text(json.dumps(summary, indent=2, sort_keys=True))

    ordered = sorted(outcomes, key=lambda o: o.index)
    figure, axis = plt.subplots(figsize=(8, 4))
    for name in sorted({o.traffic_class for o in ordered}):
        rows = [o for o in ordered if o.traffic_class == name]
        hit = np.cumsum([o.hit_tokens for o in rows])
        prompt = np.cumsum([o.prompt_tokens for o in rows])
        axis.plot([o.at_s / 3600 for o in rows], hit / np.maximum(prompt, 1), label=name)
    failed = [o.at_s / 3600 for o in ordered if o.after_failure]
    if failed:
        axis.axvline(failed[0], color="red", linestyle="--", label="2 storage nodes killed")
    axis.set_xlabel("simulated hour of day")
    axis.set_ylabel("cumulative token hit rate")
    axis.set_ylim(0, 1)
    axis.legend()
    axis.set_title("kvstore demo: prefix hit rate over the day")
    figure.tight_layout()
    written.append(directory / "hit_rate.png")
    figure.savefig(written[-1], dpi=100)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(8, 4))
    axis.scatter(
        [o.index for o in ordered], [o.query_hit_s * 1e3 for o in ordered], s=6, label="QueryHit"
    )
    fetched = [o for o in ordered if o.fetch_s is not None]
    axis.scatter(
        [o.index for o in fetched],
        [(o.fetch_s or 0.0) * 1e3 for o in fetched],
        s=6,
        label="GetBlocks (block fetch)",
    )
    if failed:
        first = next(o.index for o in ordered if o.after_failure)
        axis.axvline(first, color="red", linestyle="--", label="2 storage nodes killed")
    axis.set_yscale("log")
    axis.set_xlabel("request")
    axis.set_ylabel("latency (ms)")
    axis.legend()
    axis.set_title("kvstore demo: latency per request")
    figure.tight_layout()
    written.append(directory / "latency.png")
    figure.savefig(written[-1], dpi=100)
    plt.close(figure)
    return written
