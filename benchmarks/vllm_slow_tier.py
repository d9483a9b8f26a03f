"""A slow tier never makes a request slower than cold (issue 32 item 4): time to first token of
fresh vLLM engines whose tier is behind a thin link, against cold engines in the same run.

    python benchmarks/vllm_slow_tier.py                 # ~6 min on 2 cores; needs root
    python benchmarks/vllm_slow_tier.py --runs 5 --mbytes-per-s 2 --json

The slow tier (``kvstore.testbed.distant``): ``kvstore up`` on one network-namespace host, the
measured engines on another, every byte between them through a token bucket of
``--mbytes-per-s`` each way (a distant tier or a thin link: its blocks, whichever path they
take, cross it). The model and prompt are ``vllm_ttft.py``'s (issue 32's random Llama, 8
layers, 12 KiB of KV per token; an 8,192-token prompt: 96 MiB to load), so that loading it
over the link takes longer than computing it.

- seed: an engine on the tier's own host (near it) serves a warm-up prompt, the prompt (cold,
  saving its blocks) and two short prompts: the last lookup carries its measured prefill
  rate, which the tier keeps for this model;
- per run, a **cold** engine (no connector, vLLM's prefix cache off) and a **fresh** engine
  on the far host, with kvstore's connector, each serve a warm-up prompt under a block (no
  lookup, no save) and then the prompt ``--requests`` times. The fresh
  engine has measured nothing of its own: it weighs one probed block against the tier's
  prefill figure and must recompute (``num_cached_tokens`` 0), say so in its log, and give
  the cold run's tokens;
- one fresh engine with ``load_only_if_faster: false`` (what every engine did before): its
  load over the link, for scale (``--no-always-load`` leaves it out);
- one fresh engine with the link uncapped: a healthy tier, which a fresh engine's first
  request must still load (the whole hit).

Prints one table (median TTFT, range, ratio to cold) and whether warm / cold <= 1.1, over all
the warm requests against all the cold ones, and over each warm engine's first (the one that
probes) against each cold engine's first (an engine's first long prompt is its slowest, cold
or warm); exit 1 if either is missed, if an engine loaded on the slow tier or did not on the
healthy one, if its log does not say it recomputed, or if tokens differ from the cold run's; 2
if something is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

from benchmarks.vllm_ttft import DTYPE_BYTES, progress  # noqa: E402
from kvstore.engine.tiny_model import TinyLlama, build_tiny_llama  # noqa: E402
from kvstore.engine.vllm_run import fresh_engine  # noqa: E402
from kvstore.testbed.distant import CLIENT, TIER, distant_tier  # noqa: E402

#: Issue 32 item 4: with the tier slow, warm TTFT at most this many times cold.
WARM_OVER_COLD = 1.1
#: What the connector logs when a slow tier's hit is recomputed (``kvstore.engine.scheduler``).
RECOMPUTED = "recomputed instead of loaded while the tier is this slow"

ROWS = {
    "cold": "cold (no connector)",
    "cold_first": "  of which each engine's first",
    "warm": "warm, slow tier (fresh engines)",
    "warm_first": "  of which each engine's first",
    "always": "warm, slow tier, always loading",
    "healthy": "warm, link uncapped (fresh engine)",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--runs", type=int, default=3, help="cold and fresh engines (>= 3)")
    parser.add_argument(
        "--requests", type=int, default=3, help="the prompt's requests per cold or warm engine"
    )
    parser.add_argument("--tokens", type=int, default=8192, help="prompt length (default 8192)")
    parser.add_argument(
        "--mbytes-per-s", type=float, default=6.0, help="the link's cap, MB/s each way (6)"
    )
    parser.add_argument(
        "--no-always-load", action="store_true", help="leave out the always-loading engine"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    for wrong, why in (
        (args.runs < 3, "--runs must be at least 3 (medians)"),
        (args.requests < 1, "--requests must be at least 1"),
        (args.tokens < 1024, "--tokens must be at least 1024"),
        (not args.mbytes_per_s > 0, "--mbytes-per-s must be > 0"),
    ):
        if wrong:
            parser.error(why)
    return args


def _has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = [
        why
        for why, lacking in (
            ("vLLM is not installed here: see the README's 'Use with vLLM'", not _has_vllm()),
            ("the slow tier is a network-namespace host: run as root", os.geteuid() != 0),
        )
        if lacking
    ]
    if missing:
        print("; ".join(missing), file=sys.stderr)
        return 2
    figures = measure(args)
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        report(figures)
    return 0 if not figures["failures"] else 1


def measure(args: argparse.Namespace) -> dict[str, Any]:
    # vllm_ttft's default model: 8 layers, hidden 768, 6 KV heads of 64, bfloat16.
    shape = TinyLlama(
        layers=8, hidden=768, heads=12, kv_heads=6, intermediate=1536,
        max_positions=args.tokens + 512,
    )  # fmt: skip
    block_bytes = 2 * shape.kv_heads * 64 * 128 * DTYPE_BYTES["bfloat16"] * shape.layers
    rng = np.random.default_rng(32)
    prompt = [int(t) for t in rng.integers(2, shape.vocab, args.tokens)]

    def short(tokens: int = 100) -> list[int]:
        """A short prompt of its own. The measured engines warm up on one under a block: no
        lookup and no save of it, so the prompt's lookup is the engine's first (its probe is
        in the prompt's TTFT) and no save of the warm-up shares the link with it."""
        return [int(t) for t in rng.integers(2, shape.vocab, tokens)]

    hit = (args.tokens - 1) // 128 * 128
    served: dict[str, list[dict[str, Any]]] = {name: [] for name in ROWS}
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="vllm-slow-tier-") as scratch_dir:
        scratch = Path(scratch_dir)
        print(f"building the model ({shape}, bfloat16) ...", file=sys.stderr)
        model = build_tiny_llama(scratch / "model", shape)
        print("starting kvstore up behind the link ...", file=sys.stderr)
        link = args.mbytes_per_s * 1e6
        up = ("--fsync", "never", "--no-gc")
        with distant_tier(scratch / "tier", bytes_per_s=link, up_args=up) as distant:
            base = {
                "model": str(model),
                "max_tokens": 1,
                "dtype": "bfloat16",
                "kv_cache_bytes": max(256 << 20, 3 * (args.tokens // 128 + 8) * block_bytes),
                "max_model_len": args.tokens + 64,
            }
            connector = {"address": distant.address, "lookup_timeout_s": 20.0}

            def run(
                label: str, host: str | None, conn: dict[str, Any] | None, requests: int
            ) -> list[dict[str, Any]]:
                """The prompt's ``requests`` answers of a fresh engine (its log with each)."""
                spec = {**base, "prompts": [short()] + [prompt] * requests, "connector": conn}
                prefix = distant.on(host) if host else ()
                env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
                done = fresh_engine(spec, scratch, env=env, prefix=prefix)
                if done.result is None:
                    raise RuntimeError(f"engine {label} failed:\n{done.stderr[-3000:]}")
                answer = progress(label, done.result)
                for line in said(done.stderr):
                    print(f"    {line}", file=sys.stderr)
                return [{**r, "stderr": done.stderr} for r in answer["results"][1:]]

            # Its prompt's prefill is timed when the next step is planned, and reported with
            # the lookup after that: two short prompts after the prompt.
            seed_prompts = [short(), prompt, short(300), short(300)]
            seed_spec = {**base, "prompts": seed_prompts, "connector": connector}
            done = fresh_engine(seed_spec, scratch, prefix=distant.on(TIER))
            if done.result is None:
                raise RuntimeError(f"the seed engine failed:\n{done.stderr[-3000:]}")
            progress("seed (on the tier's host)", done.result)
            for i in range(args.runs):
                cold = run(f"cold{i}", None, None, args.requests)
                served["cold"] += cold
                served["cold_first"].append(cold[0])
                warm = run(f"warm{i}", CLIENT, connector, args.requests)
                served["warm"] += warm
                served["warm_first"].append(warm[0])
                loaded = [r["num_cached_tokens"] for r in warm if r["num_cached_tokens"]]
                if loaded:
                    failures.append(f"warm{i} loaded {loaded} tokens")
                if RECOMPUTED not in warm[0]["stderr"]:
                    failures.append(f"warm{i}'s log does not say it recomputed")
            if not args.no_always_load:
                always = {**connector, "load_only_if_faster": False}
                served["always"] += run("always", CLIENT, always, 1)
            distant.shape(None)
            healthy = run("healthy", CLIENT, connector, 1)
            served["healthy"] += healthy
            if healthy[0]["num_cached_tokens"] != hit:
                failures.append(f"on the uncapped link: {healthy[0]['num_cached_tokens']} tokens")
    return figures_of(args, served, failures, hit)


def said(stderr: str) -> list[str]:
    """What the connector's scheduler side said of its hits (``kvstore: <request>: ...``)."""
    return [line for line in stderr.splitlines() if "tokens cached in the tier" in line]


def figures_of(
    args: argparse.Namespace,
    served: dict[str, list[dict[str, Any]]],
    failures: list[str],
    hit: int,
) -> dict[str, Any]:
    seconds = {name: [r["seconds"] for r in rows] for name, rows in served.items() if rows}
    median = {name: statistics.median(values) for name, values in seconds.items()}
    reference = served["cold"][0]["tokens"]
    for name, rows in served.items():
        if any(r["tokens"] != reference for r in rows):
            failures.append(f"{ROWS[name]}: not the cold run's tokens")
    ratio = median["warm"] / median["cold"]
    # An engine's first long prompt is its slowest, cold or warm: firsts against firsts.
    first = median["warm_first"] / median["cold_first"]
    for what, value in (("warm / cold", ratio), ("first warm / cold", first)):
        if value > WARM_OVER_COLD:
            failures.append(f"{what} {value:.3f} > {WARM_OVER_COLD}")
    lines = [line for line in said(served["warm"][0]["stderr"]) if RECOMPUTED in line]
    return {
        "prompt_tokens": args.tokens,
        "tokens_cached": hit,
        "link_mbytes_per_s": args.mbytes_per_s,
        "runs": args.runs,
        "seconds": seconds,
        "median_s": median,
        "cached_tokens": {
            name: [r["num_cached_tokens"] for r in rows] for name, rows in served.items() if rows
        },
        "warm_over_cold": ratio,
        "first_warm_over_cold": first,
        "requests": args.requests,
        "target": WARM_OVER_COLD,
        "log_line": lines[0] if lines else None,
        "failures": failures,
    }


def report(figures: dict[str, Any]) -> None:
    median, seconds, cached = figures["median_s"], figures["seconds"], figures["cached_tokens"]
    print(
        f"vLLM TTFT, tier behind a {figures['link_mbytes_per_s']:g} MB/s link; "
        f"{figures['prompt_tokens']}-token prompt ({figures['tokens_cached']} cached in the "
        f"tier); {figures['runs']} fresh engines x {figures['requests']} requests, medians"
    )
    print(f"{'':38}{'TTFT s':>8}{'min-max (n)':>20}{'/ cold':>8}  tokens from kvstore")
    for name, title in ROWS.items():
        if name not in seconds:
            continue
        values = seconds[name]
        spread = f"{min(values):.3f}-{max(values):.3f} ({len(values)})"
        print(
            f"{title:38}{median[name]:>8.3f}{spread:>20}{median[name] / median['cold']:>8.3f}"
            f"  {', '.join(str(c) for c in cached[name])}"
        )
    for what, key in (("warm", "warm_over_cold"), ("first warm", "first_warm_over_cold")):
        met = "met" if figures[key] <= figures["target"] else "NOT met"
        print(
            f"{what} / cold on the slow tier  {figures[key]:.3f}  "
            f"(target <= {figures['target']}: {met})"
        )
    print(f"the connector's log: {figures['log_line']}")
    for failure in figures["failures"]:
        print(f"FAILED: {failure}")


if __name__ == "__main__":
    raise SystemExit(main())
