"""Time to first token of a real vLLM engine: cold, warm from kvstore, and vLLM's own cache.

    python benchmarks/vllm_ttft.py              # ~6 min on 2 cores: 8K-token prompt, 3 runs
    python benchmarks/vllm_ttft.py --runs 5 --tokens 12288 --json
    python benchmarks/vllm_ttft.py --model gemma3  # a hybrid model: sliding + full layers

Needs vLLM (the README's "Use with vLLM" venv). Builds a small random Llama (4 layers, hidden
512, 4 KV heads of 64: one 128-token block is 1 MiB of float32 KV) or, with ``--model gemma3``,
a Gemma-3 of the same shape whose layers alternate a 128-token sliding window and full attention
(vLLM's hybrid KV-cache manager on: the full layers' blocks come from the block tier, the sliding
layers' window state from the SWA tier), starts a real `kvstore up`
(its own process, gRPC on 127.0.0.1, no GC) and runs every engine in a fresh process
(``python -m kvstore.engine.vllm_run``, one process per engine), each first serving a
short unrelated prompt so that start-up costs are not in any figure:

- seed: an engine with the connector serves the prompt once (cold, and saving every block);
- per run, engine X (no connector, vLLM's prefix cache on) serves the prompt twice: the first
  is **cold** (everything computed), the second is **local** (vLLM's own prefix cache, in
  memory: the upper bound of any external cache);
- per run, engine Y (**fresh**, connector on, vLLM's prefix cache off) serves it once: **warm**,
  every block but the last loaded from kvstore.

Reported: medians over the runs, the ratios warm/cold and warm/local, the bytes loaded per
KV-cache group (for the hybrid model: the sliding layers load one window, not the prefix), the
load's GB/s (bytes over the time from the load's start to its last layer staged), the time
until the tier's answer (the read), and how much of the load overlapped the engine's own work
(1 − the time the forward waited on it / the load's time). Warm TTFT minus the forward's wait
is what the warm request cost besides the load: compare it with the local TTFT.

Every shard is read through its storage node, as in a multi-machine deployment (the tier has
no same-machine shortcut), although all 12 nodes share this machine here.
"""

from __future__ import annotations

import argparse
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

from kvstore.engine.tiny_gemma import TinyGemma3, build_tiny_gemma3  # noqa: E402
from kvstore.engine.tiny_model import TinyLlama, build_tiny_llama  # noqa: E402
from kvstore.engine.vllm_run import fresh_engine  # noqa: E402
from kvstore.runtime.upprocess import TierProcess  # noqa: E402

#: Targets of issue 16.
WARM_OVER_COLD = 0.25
WARM_OVER_LOCAL = 2.0


def engine(spec: dict[str, Any], scratch: Path, label: str) -> dict[str, Any]:
    """One engine in a fresh process; its ``vllm_run`` answer."""
    done = fresh_engine(spec, scratch, env=dict(os.environ, VLLM_LOGGING_LEVEL="WARNING"))
    if done.result is None:
        raise RuntimeError(f"engine {label} failed:\n{done.stderr[-3000:]}")
    took = ", ".join(f"{r['seconds']:.2f} s" for r in done.result["results"])
    print(f"  engine {label}: {took}", file=sys.stderr)
    return done.result


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0) for k in after}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs to take medians of (>= 3)")
    parser.add_argument("--tokens", type=int, default=8192, help="prompt length (default 8192)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument(
        "--model",
        choices=("llama", "gemma3"),
        default="llama",
        help="dense Llama (default) or hybrid Gemma-3 (sliding-window + full layers)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.runs < 3:
        parser.error("--runs must be at least 3 (medians)")
    if args.tokens < 1024:
        parser.error("--tokens must be at least 1024")
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vLLM is not installed here: see the README's 'Use with vLLM'", file=sys.stderr)
        return 2

    kv_heads = max(args.hidden // 128, 1)
    shape: TinyLlama | TinyGemma3
    if args.model == "llama":
        shape = TinyLlama(
            layers=args.layers,
            hidden=args.hidden,
            heads=args.hidden // 64,
            kv_heads=kv_heads,
            intermediate=2 * args.hidden,
            max_positions=args.tokens + 512,
        )
    else:
        shape = TinyGemma3(
            layers=args.layers,
            hidden=args.hidden,
            heads=args.hidden // 64,
            kv_heads=kv_heads,
            head_dim=64,
            intermediate=2 * args.hidden,
            max_positions=args.tokens + 512,
        )
    # One 128-token block of one layer's float32 KV (K and V), and of all layers.
    page_bytes = 2 * kv_heads * 64 * 128 * 4
    block_bytes = page_bytes * args.layers
    rng = np.random.default_rng(16)
    prompt = [int(t) for t in rng.integers(2, shape.vocab, args.tokens)]
    warmup = [int(t) for t in rng.integers(2, shape.vocab, 300)]
    expected_hit = (args.tokens - 1) // 128 * 128
    with tempfile.TemporaryDirectory(prefix="vllm-ttft-") as scratch_dir:
        scratch = Path(scratch_dir)
        print(f"building the model ({shape}) ...", file=sys.stderr)
        if isinstance(shape, TinyLlama):
            model = build_tiny_llama(scratch / "model", shape)
        else:
            model = build_tiny_gemma3(scratch / "model", shape)
        print("starting kvstore up ...", file=sys.stderr)
        # No size flag: the engine's connector names its model's layout.
        with TierProcess.start(scratch / "tier", "--fsync", "never", "--no-gc") as tier:
            base = {
                "model": str(model),
                "max_tokens": 1,
                "kv_cache_bytes": max(256 << 20, 3 * (args.tokens // 128 + 8) * block_bytes),
                "max_model_len": args.tokens + 64,
            }
            connector = {"address": tier.address, "lookup_timeout_s": 10.0}
            seed = engine(
                {**base, "prompts": [warmup, prompt], "connector": connector}, scratch, "seed"
            )
            rows: dict[str, list[float]] = {"cold": [], "local": [], "warm": []}
            loads: list[dict[str, float]] = []
            for run in range(args.runs):
                x = engine(
                    {**base, "prompts": [warmup, prompt, prompt], "prefix_caching": True},
                    scratch,
                    f"x{run}",
                )
                rows["cold"].append(x["results"][1]["seconds"])
                rows["local"].append(x["results"][2]["seconds"])
                y = engine(
                    {**base, "prompts": [warmup, prompt], "connector": connector},
                    scratch,
                    f"y{run}",
                )
                measured = y["results"][1]
                if measured["num_cached_tokens"] != expected_hit:
                    raise RuntimeError(
                        f"run {run}: warm engine took {measured['num_cached_tokens']} tokens "
                        f"from kvstore, expected {expected_hit}"
                    )
                rows["warm"].append(measured["seconds"])
                loads.append(delta(measured["worker"], y["results"][0]["worker"]))
    median = {name: statistics.median(values) for name, values in rows.items()}
    bytes_loaded = statistics.median(x["bytes_loaded"] for x in loads)
    state_bytes = statistics.median(x.get("state_bytes_loaded", 0) for x in loads)
    groups = seed.get("groups") or []
    sliding_layers = sum(len(layers) for kind, layers, _ in groups if kind == "sliding")
    # What the sliding layers would have loaded had they taken the whole prefix, as full
    # attention does: the window rule is what saves it.
    sliding_prefix_bytes = expected_hit // 128 * sliding_layers * page_bytes
    load_s = statistics.median(x["load_seconds"] for x in loads)
    wait_s = statistics.median(x["wait_seconds"] for x in loads)
    read_s = statistics.median(x["read_seconds"] for x in loads)
    staged_s = statistics.median(x["staged_seconds"] for x in loads)
    figures = {
        "prompt_tokens": args.tokens,
        "model": {
            "kind": args.model,
            "layers": shape.layers,
            "hidden": shape.hidden,
            "kv_heads": shape.kv_heads,
            "groups": groups,
        },
        "block_bytes": block_bytes,
        "runs": args.runs,
        "seconds": rows,
        "median_s": median,
        "seed_cold_with_connector_s": seed["results"][1]["seconds"],
        "warm_over_cold": median["warm"] / median["cold"],
        "warm_over_local": median["warm"] / median["local"],
        "tokens_from_kvstore": expected_hit,
        "bytes_loaded": bytes_loaded,
        "bytes_loaded_by_group": {
            "full_attention_blocks": bytes_loaded,
            "sliding_window_states": state_bytes,
            "sliding_layers_whole_prefix_would_be": sliding_prefix_bytes,
        },
        "load_seconds": load_s,
        "tier_read_seconds": read_s,
        "staged_seconds": staged_s,
        "load_gb_per_s": bytes_loaded / staged_s / 1e9 if staged_s else 0.0,
        "forward_waited_s": wait_s,
        "load_overlapped_compute": 1 - wait_s / staged_s if staged_s else 0.0,
        "targets": {"warm_over_cold": WARM_OVER_COLD, "warm_over_local": WARM_OVER_LOCAL},
    }
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"vLLM TTFT, {args.model}, {args.tokens}-token prompt, medians of {args.runs}")
    print(f"{'':34}{'TTFT s':>10}{'runs':>30}")
    names = {
        "cold": "cold (no cache)",
        "warm": "warm from kvstore (fresh engine)",
        "local": "vLLM local prefix cache",
    }
    for name in ("cold", "warm", "local"):
        runs = " ".join(f"{v:.3f}" for v in rows[name])
        print(f"{names[name]:34}{median[name]:>10.3f}{runs:>30}")
    print(f"{'seed: cold with connector (saves)':34}{figures['seed_cold_with_connector_s']:>10.3f}")
    verdict = {
        True: "met",
        False: "NOT met",
    }
    print(
        f"warm / cold   {figures['warm_over_cold']:.3f}  (target <= {WARM_OVER_COLD}: "
        f"{verdict[figures['warm_over_cold'] <= WARM_OVER_COLD]})"
    )
    print(
        f"warm / local  {figures['warm_over_local']:.3f}  (target <= {WARM_OVER_LOCAL}: "
        f"{verdict[figures['warm_over_local'] <= WARM_OVER_LOCAL]})"
    )
    print(
        f"load: {bytes_loaded / 1e6:.1f} MB ({expected_hit} tokens) staged in {staged_s:.3f} s = "
        f"{figures['load_gb_per_s']:.3f} GB/s; of that, {read_s:.3f} s until the tier's answer "
        f"(GetBlocks through the gateway: every block is read before layer 0 is published)"
    )
    if sliding_layers:
        print(
            f"by group: full attention {bytes_loaded / 1e6:.1f} MB of blocks; sliding window "
            f"{state_bytes / 1e6:.3f} MB of window state ({sliding_layers} layers; their whole "
            f"prefix would be {sliding_prefix_bytes / 1e6:.1f} MB)"
        )
    print(
        f"the forward waited {wait_s:.3f} s on the load "
        f"({figures['load_overlapped_compute']:.0%} of it overlapped the engine's own work); "
        f"warm TTFT - that wait = {median['warm'] - wait_s:.3f} s (local TTFT "
        f"{median['local']:.3f} s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
