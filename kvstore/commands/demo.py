"""`kvstore demo`: the main job — kvstore under a synthetic day of traffic, with failures."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvstore.errors import InvalidArgument

NAME = "demo"
HELP = "run kvstore on an embedded cluster under a day of traffic, kill 2 nodes, report"
DESCRIPTION = """The main job. Starts kvstore on an embedded local Ray cluster (12 storage
nodes with 10+2 erasure coding, meta shards, repair, the SWA tier, GC, the gRPC gateway), replays a
synthetic day of traffic through the gRPC API — agent loops and chatbot sessions sharing system
prompts and growing histories, both traffic classes, four simulated engines — kills 2 storage
nodes half-way and keeps serving, then prints a summary (hit rate per class, prefill tokens saved,
GB stored, p50/p99 of QueryHit and block fetch, degraded reads, repairs) and writes
demo-report/summary.json with PNG plots of hit rate and latency.

Every byte read back is checked against what was written; the exit status is 1 if any read
returned wrong bytes. Takes about 2-3 minutes on a 2-core machine.

  kvstore demo
  kvstore demo --report-dir /tmp/report --sessions 20 --agents 6"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--report-dir", type=Path, default=Path("demo-report"), help="where to write the report"
    )
    parser.add_argument("--sessions", type=int, default=40, help="chatbot sessions (default 40)")
    parser.add_argument("--agents", type=int, default=12, help="agent loops (default 12)")
    parser.add_argument("--engines", type=int, default=4, help="simulated engines (default 4)")
    parser.add_argument("--seed", type=int, default=7, help="workload seed")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def _print_summary(summary: dict[str, Any]) -> None:
    print()
    print("kvstore demo — summary")
    print(f"  requests                 {summary['requests']}")
    for name, figures in summary["classes"].items():
        print(
            f"  hit rate {name:<9}       {figures['token_hit_rate']:.1%} of prompt tokens "
            f"({figures['requests']} requests, {figures['swa_hits']} SWA hits)"
        )
    saved, prompt = summary["prefill_tokens_saved"], summary["prompt_tokens"]
    print(f"  prefill tokens saved     {saved:,} of {prompt:,} ({saved / max(prompt, 1):.1%})")
    print(f"  GB stored (block tier)   {summary['gb_stored']:.3f}")
    print(f"  blocks put / fetched     {summary['blocks_put']:,} / {summary['blocks_fetched']:,}")
    q, f = summary["query_hit_ms"], summary["block_fetch_ms"]
    print(f"  QueryHit p50 / p99       {q['p50']} / {q['p99']} ms")
    print(f"  block fetch p50 / p99    {f['p50']} / {f['p99']} ms")
    print(
        f"  storage nodes            {summary['live_storage_nodes_at_end']} live of "
        f"{summary['storage_nodes']} (killed {summary['killed_storage_nodes']} half-way)"
    )
    print(f"  degraded reads           {summary['degraded_reads']}")
    print(f"  repairs (stripes)        {summary['repairs']}")
    print(f"  load errors (recomputed) {summary['load_errors']}")
    print(f"  wrong bytes              {summary['wrong_bytes_reads']}")
    print(f"  time                     {summary['total_seconds']} s")
    print(f"  report                   {', '.join(summary['report_files'])}")


def run(args: argparse.Namespace) -> int:
    for flag in ("sessions", "agents"):
        if getattr(args, flag) < 0:
            raise InvalidArgument(f"--{flag}", f"must be ≥ 0, got {getattr(args, flag)}")
    if args.engines < 1:
        raise InvalidArgument("--engines", f"must be ≥ 1, got {args.engines}")
    if args.sessions + args.agents == 0:
        raise InvalidArgument("--sessions", "the demo needs at least one session")
    from kvstore.commands._client import print_json
    from kvstore.demo.runner import DemoConfig, run_demo
    from kvstore.demo.workload import WorkloadConfig

    config = DemoConfig(
        report_dir=args.report_dir,
        engines=args.engines,
        workload=WorkloadConfig(
            seed=args.seed, chatbot_sessions=args.sessions, agent_sessions=args.agents
        ),
        progress=not args.no_progress,
    )
    summary = run_demo(config)
    if args.json:
        print_json(summary)
    else:
        _print_summary(summary)
    if summary["wrong_bytes_reads"]:
        print("kvstore demo: FAILED — a read returned wrong bytes")
        return 1
    return 0
