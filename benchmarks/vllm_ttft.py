"""Time to first token of a real vLLM engine: cold, vLLM's own cache, warm from kvstore and, in
the same run, warm from Mooncake Store.

    python benchmarks/vllm_ttft.py              # ~6 min on 2 cores: 8K-token prompt, 3 x 3
    python benchmarks/vllm_ttft.py --peers none --runs 5 --tokens 12288 --json
    python benchmarks/vllm_ttft.py --model gemma3  # a hybrid model: sliding + full layers

Needs vLLM (the README's "Use with vLLM" venv); the Mooncake peer needs Mooncake in that venv
and root (``--peers``). By default the model is issue 32's: a random Llama of 8 layers, hidden
768, 6 KV heads of 64, in bfloat16 (12 KiB of KV per token; one 128-token block 1.5 MiB), the
prompt 8,192 tokens. ``--model gemma3`` builds a Gemma-3 of the same shape whose layers
alternate a 128-token sliding window and full attention (vLLM's hybrid KV-cache manager on: the
full layers' blocks come from the block tier, the sliding layers' window state from the SWA
tier). ``--layers 4 --hidden 512 --dtype float32 --requests 1 --peers none`` is this
benchmark's shape before issue 32 (1 MiB float32 blocks).

It starts a real `kvstore up` (its own process, gRPC on 127.0.0.1, no GC) and, with the peer,
Mooncake's master and a standalone 2 GB pool (``benchmarks/mooncake_peer.py``: they and every
Mooncake engine run in a private network namespace, since Mooncake binds 0.0.0.0). Every engine
runs in a fresh process (``python -m kvstore.engine.vllm_run``, the same code for both peers)
and first serves a short unrelated prompt, so that start-up costs are not in any figure:

- seeds: an engine with kvstore's connector, and one with Mooncake's, serve the prompt once
  (cold, and saving every block into their store);
- per run, engine X (no connector, vLLM's prefix cache on) serves the prompt 1 + ``--requests``
  times: the first is **cold** (everything computed), the others are **local** (vLLM's own
  prefix cache, in memory: the upper bound of any external cache);
- per run, a **fresh** engine with kvstore's connector and one with Mooncake's (vLLM's prefix
  cache off in both) serve it ``--requests`` times each: **warm**, every block but the last
  loaded from the store (both load whole blocks and compute the last 128 tokens).

Reported: one table of every setup's median TTFT over all its requests (and range), its ratio to
local and to cold, and whether it gave the cold run's exact tokens; then kvstore / Mooncake,
Mooncake / local, the targets of issues 16 and 32 for kvstore, kvstore's load (bytes per
KV-cache group; for the hybrid model the sliding layers load one window, not the prefix), its
GB/s (bytes over the time from the load's start to its last layer staged), the time until its
layer 0 was staged, and how much of the load overlapped the engine's own work (1 − the
time the forward waited on it / the load's time). Warm TTFT minus the forward's wait is what the
warm request cost besides the load: compare it with the local TTFT. Exit status 1 if a setup's
tokens differ from the cold run's.

Every kvstore shard is read through its storage node, as in a multi-machine deployment (the
tier has no same-machine shortcut), although all 12 nodes share this machine here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

from benchmarks.mooncake_peer import INSTALL, MooncakeStore  # noqa: E402
from benchmarks.mooncake_peer import missing as mooncake_missing  # noqa: E402
from kvstore.engine.tiny_gemma import TinyGemma3, build_tiny_gemma3  # noqa: E402
from kvstore.engine.tiny_model import TinyLlama, build_tiny_llama  # noqa: E402
from kvstore.engine.vllm_run import fresh_engine  # noqa: E402
from kvstore.runtime.upprocess import TierProcess  # noqa: E402

#: Targets (issues 16 and 32).
WARM_OVER_COLD = 0.25  # issue 16
WARM_OVER_LOCAL = 1.5  # issue 32 (issue 16's was 2.0)
OVER_MOONCAKE = 1.0  # issue 32: at least as fast as Mooncake Store, same run
LOAD_GB_PER_S = 1.0  # issue 32: the load's bytes into staging

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

#: The setups, in the table's order, and their names there.
SETUPS = {
    "cold": "cold (no cache)",
    "local": "vLLM local prefix cache",
    "warm": "warm from kvstore (fresh engine)",
    "warm_staged": "the same, loads copied from staging",
    "mooncake": "warm from Mooncake (fresh engine)",
    "seed": "seed, kvstore: cold, saves",
    "mooncake_seed": "seed, Mooncake: cold, saves",
}

#: Setups measured only when asked for (``--also-staged``).
OPTIONAL = ("warm_staged",)

EPILOG = f"""\
defaults: issue 32's setup (Llama, 8 layers, hidden 768, bfloat16: 12 KiB of KV per token;
an 8,192-token prompt; 3 fresh engines x 3 requests each, medians over the 9).

peers: --peers auto (the default) measures Mooncake Store when it can run here, and otherwise
measures the rest and says that the peer was skipped and why; --peers mooncake requires it
(exit 2 if it cannot run); --peers none leaves it out. To install it: {INSTALL}.
Mooncake's master, its pool and its engines run in a private network namespace (only loopback
up: Mooncake binds 0.0.0.0), all stopped on exit.

exit status: 1 if a setup's tokens differ from the cold run's, 2 if something is missing."""


def engine(spec: dict[str, Any], scratch: Path, label: str) -> dict[str, Any]:
    """One engine in a fresh process; its ``vllm_run`` answer."""
    done = fresh_engine(spec, scratch, env=dict(os.environ, VLLM_LOGGING_LEVEL="WARNING"))
    if done.result is None:
        raise RuntimeError(f"engine {label} failed:\n{done.stderr[-3000:]}")
    return progress(label, done.result)


def progress(label: str, answer: dict[str, Any]) -> dict[str, Any]:
    took = ", ".join(f"{r['seconds']:.2f} s" for r in answer["results"])
    print(f"  engine {label}: {took}", file=sys.stderr)
    return answer


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0) for k in after}


def hits(answer: dict[str, Any], expected: int, label: str) -> list[dict[str, Any]]:
    """The prompt's requests of a warm engine (all but the warm-up), each checked to have
    taken ``expected`` tokens from its store: a shorter hit would time something else."""
    served = answer["results"][1:]
    for i, measured in enumerate(served):
        if measured["num_cached_tokens"] != expected:
            raise RuntimeError(
                f"engine {label}, request {i}: {measured['num_cached_tokens']} tokens from its "
                f"store, expected {expected}"
            )
    return served


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--runs", type=int, default=3, help="fresh engines per setup (>= 3)")
    parser.add_argument(
        "--requests",
        type=int,
        default=3,
        help="requests of the prompt per warm or local engine (medians over runs x requests)",
    )
    parser.add_argument("--tokens", type=int, default=8192, help="prompt length (default 8192)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    parser.add_argument("--hidden", type=int, default=768, help="heads of 64, KV heads hidden/128")
    parser.add_argument(
        "--dtype", choices=tuple(DTYPE_BYTES), default="bfloat16", help="of weights and KV"
    )
    parser.add_argument(
        "--model",
        choices=("llama", "gemma3"),
        default="llama",
        help="dense Llama (default) or hybrid Gemma-3 (sliding-window + full layers)",
    )
    parser.add_argument(
        "--peers",
        choices=("auto", "mooncake", "none"),
        default="auto",
        help="Mooncake Store in the same run: if it can run here (default), required, or not",
    )
    parser.add_argument(
        "--also-staged",
        action="store_true",
        help="also a fresh kvstore engine per run whose loads land in staging and are copied "
        "into the KV rows (loads_in_place false: what a CPU engine did before loads landed in "
        "place), to compare in the same run",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.runs < 3:
        parser.error("--runs must be at least 3 (medians)")
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    if args.tokens < 1024:
        parser.error("--tokens must be at least 1024")
    return args


def mooncake_skipped(args: argparse.Namespace) -> str | None:
    """Why Mooncake is left out of this run (None: it is measured)."""
    if args.peers == "none":
        return "left out (--peers none)"
    why = mooncake_missing()
    return None if why is None else f"cannot run here: {why}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vLLM is not installed here: see the README's 'Use with vLLM'", file=sys.stderr)
        return 2
    skipped = mooncake_skipped(args)
    if skipped is not None:
        if args.peers == "mooncake":
            print(f"Mooncake Store {skipped}; to install: {INSTALL}", file=sys.stderr)
            return 2
        print(f"Mooncake Store peer skipped: {skipped}", file=sys.stderr)
    figures = measure(args, mooncake=skipped is None)
    figures["peers"] = {"mooncake": "measured" if skipped is None else f"skipped: {skipped}"}
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        report(figures)
    return 0 if all(o["same_tokens"] for o in figures["outputs"].values()) else 1


def measure(args: argparse.Namespace, *, mooncake: bool) -> dict[str, Any]:
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
    # One 128-token block of one layer's KV (K and V), and of all layers.
    page_bytes = 2 * kv_heads * 64 * 128 * DTYPE_BYTES[args.dtype]
    block_bytes = page_bytes * args.layers
    rng = np.random.default_rng(16)
    prompt = [int(t) for t in rng.integers(2, shape.vocab, args.tokens)]
    warmup = [int(t) for t in rng.integers(2, shape.vocab, 300)]
    expected_hit = (args.tokens - 1) // 128 * 128
    # Per setup, every measured request's answer (tokens, logprobs, seconds, ...).
    served: dict[str, list[dict[str, Any]]] = {name: [] for name in SETUPS}
    loads: list[dict[str, float]] = []
    staged_loads: list[dict[str, float]] = []  # --also-staged's engines
    with tempfile.TemporaryDirectory(prefix="vllm-ttft-") as scratch_dir, ExitStack() as stack:
        scratch = Path(scratch_dir)
        print(f"building the model ({shape}, {args.dtype}) ...", file=sys.stderr)
        if isinstance(shape, TinyLlama):
            model = build_tiny_llama(scratch / "model", shape)
        else:
            model = build_tiny_gemma3(scratch / "model", shape)
        print("starting kvstore up ...", file=sys.stderr)
        # No size flag: the engine's connector names its model's layout.
        tier = stack.enter_context(
            TierProcess.start(scratch / "tier", "--fsync", "never", "--no-gc")
        )
        store = None
        if mooncake:
            print("starting Mooncake's master and pool ...", file=sys.stderr)
            store = stack.enter_context(MooncakeStore.start(scratch / "mooncake"))
        base = {
            "model": str(model),
            "max_tokens": 1,
            "dtype": args.dtype,
            "kv_cache_bytes": max(256 << 20, 3 * (args.tokens // 128 + 8) * block_bytes),
            "max_model_len": args.tokens + 64,
        }
        connector = {"address": tier.address, "lookup_timeout_s": 10.0}
        warm_prompts = [warmup] + [prompt] * args.requests
        seed = engine(
            {**base, "prompts": [warmup, prompt], "connector": connector}, scratch, "seed"
        )
        served["seed"].append(seed["results"][1])
        if store is not None:
            answer = progress("mooncake-seed", store.engine({**base, "prompts": [warmup, prompt]}))
            served["mooncake_seed"].append(answer["results"][1])
        for run in range(args.runs):
            x = engine(
                {
                    **base,
                    "prompts": [warmup] + [prompt] * (1 + args.requests),
                    "prefix_caching": True,
                },
                scratch,
                f"x{run}",
            )
            served["cold"].append(x["results"][1])
            served["local"] += x["results"][2:]
            label = f"y{run}"
            y = engine({**base, "prompts": warm_prompts, "connector": connector}, scratch, label)
            served["warm"] += hits(y, expected_hit, label)
            for before, after in zip(y["results"], y["results"][1:], strict=False):
                loads.append(delta(after["worker"], before["worker"]))
            if args.also_staged:
                label = f"s{run}"
                staged_connector = {**connector, "loads_in_place": False}
                answer = engine(
                    {**base, "prompts": warm_prompts, "connector": staged_connector}, scratch, label
                )
                served["warm_staged"] += hits(answer, expected_hit, label)
                results = answer["results"]
                for before, after in zip(results, results[1:], strict=False):
                    staged_loads.append(delta(after["worker"], before["worker"]))
            if store is not None:
                label = f"m{run}"
                answer = progress(label, store.engine({**base, "prompts": warm_prompts}))
                served["mooncake"] += hits(answer, expected_hit, label)
    groups = seed.get("groups") or []
    figures = figures_of(args, shape, served, loads, groups, page_bytes, expected_hit)
    if staged_loads:
        figures["forward_waited_s_staged"] = statistics.median(
            x["wait_seconds"] for x in staged_loads
        )
    return figures


def figures_of(
    args: argparse.Namespace,
    shape: TinyLlama | TinyGemma3,
    served: dict[str, list[dict[str, Any]]],
    loads: list[dict[str, float]],
    groups: list[Any],
    page_bytes: int,
    expected_hit: int,
) -> dict[str, Any]:
    rows = {name: [r["seconds"] for r in results] for name, results in served.items() if results}
    median = {name: statistics.median(values) for name, values in rows.items()}
    reference = served["cold"][0]
    outputs = {}
    for name, results in served.items():
        if results:
            outputs[name] = {
                "same_tokens": all(r["tokens"] == reference["tokens"] for r in results),
                "max_abs_logprob_diff": max(
                    (
                        abs(a - b)
                        for r in results
                        for a, b in zip(r["logprobs"], reference["logprobs"], strict=False)
                    ),
                    default=0.0,
                ),
            }
    bytes_loaded = statistics.median(x["bytes_loaded"] for x in loads)
    state_bytes = statistics.median(x.get("state_bytes_loaded", 0) for x in loads)
    sliding_layers = sum(len(layers) for kind, layers, _ in groups if kind == "sliding")
    # What the sliding layers would have loaded had they taken the whole prefix, as full
    # attention does: the window rule is what saves it.
    sliding_prefix_bytes = expected_hit // 128 * sliding_layers * page_bytes
    staged_s = statistics.median(x["staged_seconds"] for x in loads)
    wait_s = statistics.median(x["wait_seconds"] for x in loads)
    mooncake = median.get("mooncake")
    return {
        "prompt_tokens": args.tokens,
        "model": {
            "kind": args.model,
            "layers": shape.layers,
            "hidden": shape.hidden,
            "kv_heads": shape.kv_heads,
            "dtype": args.dtype,
            "kv_bytes_per_token": page_bytes // 128 * shape.layers,
            "groups": groups,
        },
        "block_bytes": page_bytes * shape.layers,
        "runs": args.runs,
        "requests_per_engine": args.requests,
        "seconds": rows,
        "median_s": median,
        "seed_cold_with_connector_s": median["seed"],
        "warm_over_cold": median["warm"] / median["cold"],
        "warm_over_local": median["warm"] / median["local"],
        "kvstore_over_mooncake": median["warm"] / mooncake if mooncake else None,
        "mooncake_over_local": mooncake / median["local"] if mooncake else None,
        "mooncake_over_cold": mooncake / median["cold"] if mooncake else None,
        "outputs": outputs,
        "tokens_from_cache": expected_hit,
        "bytes_loaded": bytes_loaded,
        "bytes_loaded_by_group": {
            "full_attention_blocks": bytes_loaded,
            "sliding_window_states": state_bytes,
            "sliding_layers_whole_prefix_would_be": sliding_prefix_bytes,
        },
        "load_seconds": statistics.median(x["load_seconds"] for x in loads),
        "tier_read_seconds": statistics.median(x["read_seconds"] for x in loads),
        "staged_seconds": staged_s,
        "load_gb_per_s": bytes_loaded / staged_s / 1e9 if staged_s else 0.0,
        "forward_waited_s": wait_s,
        "load_overlapped_compute": 1 - wait_s / staged_s if staged_s else 0.0,
        "targets": {
            "warm_over_cold": WARM_OVER_COLD,
            "warm_over_local": WARM_OVER_LOCAL,
            "kvstore_over_mooncake": OVER_MOONCAKE,
            "load_gb_per_s": LOAD_GB_PER_S,
        },
    }


def report(figures: dict[str, Any]) -> None:
    model = figures["model"]
    median, rows, outputs = figures["median_s"], figures["seconds"], figures["outputs"]
    print(
        f"vLLM TTFT, {model['kind']} ({model['layers']} layers, hidden {model['hidden']}, "
        f"{model['dtype']}, {model['kv_bytes_per_token'] / 1024:.1f} KiB of KV per token), "
        f"{figures['prompt_tokens']}-token prompt ({figures['tokens_from_cache']} from a cache); "
        f"{figures['runs']} fresh engines x {figures['requests_per_engine']} requests, medians"
    )
    print(
        f"{'':36}{'TTFT s':>8}{'min-max (n)':>20}{'/ local':>9}{'/ cold':>8}  same tokens as cold"
    )
    for name, title in SETUPS.items():
        if name not in rows:
            if name not in OPTIONAL:
                print(f"{title:36}{'-':>8}  skipped (below)")
            continue
        values = rows[name]
        spread = f"{min(values):.3f}-{max(values):.3f} ({len(values)})"
        same = outputs[name]
        check = "yes" if same["same_tokens"] else "NO: differs"
        print(
            f"{title:36}{median[name]:>8.3f}{spread:>20}{median[name] / median['local']:>9.2f}"
            f"{median[name] / median['cold']:>8.3f}  {check} "
            f"(max |d logprob| {same['max_abs_logprob_diff']:.2g})"
        )
    if figures["kvstore_over_mooncake"] is not None:
        print(
            f"kvstore / Mooncake  {figures['kvstore_over_mooncake']:.2f}   "
            f"Mooncake / local  {figures['mooncake_over_local']:.2f}   "
            f"kvstore / local  {figures['warm_over_local']:.2f}"
        )
    else:
        why = figures["peers"]["mooncake"]
        install = f"; to install: {INSTALL}" if "cannot run here" in why else ""
        print(f"Mooncake Store {why}{install}")
    if "warm_staged" in median:
        print(
            f"kvstore, loads in place / copied from staging: TTFT "
            f"{median['warm'] / median['warm_staged']:.2f}, the forward's wait on the load "
            f"{figures['forward_waited_s']:.3f} / {figures['forward_waited_s_staged']:.3f} s"
        )
    differ = [SETUPS[name] for name, o in outputs.items() if not o["same_tokens"]]
    print(
        "outputs: every setup gave the cold run's tokens"
        if not differ
        else f"outputs: NOT the cold run's tokens: {', '.join(differ)}"
    )
    verdict = {True: "met", False: "NOT met"}
    print(
        f"kvstore warm / cold   {figures['warm_over_cold']:.3f}  (target <= {WARM_OVER_COLD}: "
        f"{verdict[figures['warm_over_cold'] <= WARM_OVER_COLD]})"
    )
    print(
        f"kvstore warm / local  {figures['warm_over_local']:.3f}  (target <= {WARM_OVER_LOCAL}: "
        f"{verdict[figures['warm_over_local'] <= WARM_OVER_LOCAL]})"
    )
    if figures["kvstore_over_mooncake"] is not None:
        print(
            f"kvstore / Mooncake    {figures['kvstore_over_mooncake']:.3f}  (target <= "
            f"{OVER_MOONCAKE}: {verdict[figures['kvstore_over_mooncake'] <= OVER_MOONCAKE]})"
        )
    print(
        f"kvstore load          {figures['load_gb_per_s']:.3f} GB/s  (target >= {LOAD_GB_PER_S}: "
        f"{verdict[figures['load_gb_per_s'] >= LOAD_GB_PER_S]})"
    )
    loaded, staged_s = figures["bytes_loaded"], figures["staged_seconds"]
    print(
        f"kvstore load: {loaded / 1e6:.1f} MB ({figures['tokens_from_cache']} tokens) landed in "
        f"{staged_s:.3f} s = {figures['load_gb_per_s']:.3f} GB/s; of that, "
        f"{figures['tier_read_seconds']:.3f} s until layer 0 had landed (read straight from "
        f"the storage nodes with the lease's read grant, or through the gateway where the "
        f"engine reaches no node; a CPU engine's blocks land in its KV rows themselves, every "
        f"block before layer 0 is handed on; a GPU engine's land in staging, and its direct "
        f"read hands layers on as they arrive)"
    )
    by_group = figures["bytes_loaded_by_group"]
    sliding_layers = sum(len(layers) for kind, layers, _ in model["groups"] if kind == "sliding")
    if sliding_layers:
        print(
            f"by group: full attention {loaded / 1e6:.1f} MB of blocks; sliding window "
            f"{by_group['sliding_window_states'] / 1e6:.3f} MB of window state ({sliding_layers} "
            f"layers; their whole prefix would be "
            f"{by_group['sliding_layers_whole_prefix_would_be'] / 1e6:.1f} MB)"
        )
    wait_s = figures["forward_waited_s"]
    print(
        f"the forward waited {wait_s:.3f} s on kvstore's load "
        f"({figures['load_overlapped_compute']:.0%} of it overlapped the engine's own work); "
        f"warm TTFT - that wait = {median['warm'] - wait_s:.3f} s (local TTFT "
        f"{median['local']:.3f} s)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
