"""`kvstore simulate`: size a fleet's block tier with a discrete-event model driven by a trace."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

from kvstore.commands.replay import parse_size
from kvstore.errors import InvalidArgument

NAME = "simulate"
HELP = "model the block tier at fleet scale from a request trace: hit rate, capacity, repair, loss"
DESCRIPTION = """A discrete-event model of kvstore's block tier on a fleet of machines, driven by
a Mooncake request trace (JSONL: timestamp ms, input_length, output_length, hash_ids). No Ray,
no disks: the machines are counters, and every decision is kvstore's own code (the hit rule and
hit query, rendezvous placement over the live machines, the GC pass with its watermarks, TTLs
and global LRU merge, the write quorum, the repair queue's order and rate).

Each request at its trace time does what an engine does: QueryHit, GetBlocks of the hit (k
shards per block from k machines), PutBlocks of the rest (12 shards to 12 machines); the GC
runs every --gc-interval seconds of simulated time; machines fail at --afr (and --fail injects
failures) and are repaired at kvstore's repair rate, bounded by --net-bw and --disk-bw.

Traffic: a trace of one cluster is far too little for 1,000 machines, so --copies R replays R
copies of it with disjoint keys, in step (R x the traffic). The default, one copy per machine,
gives every machine the trace's load: about 60k prompt tokens/s on the bundled trace, the
input rate of one busy 8-GPU prefill machine (DeepSeek reports 73.7k tokens/s per H800 node,
cache hits included): an upper bound for a fleet where some machines only decode. The copies
are alike, so the model follows one in full at 1/R of the capacity and repair rate and sums R
copies of it with the machines relabelled at random (see kvstore/trace/simulate.py).

Reports: token hit rate (and over time); bytes stored, written, evicted, expired per class;
network and disk bytes/s per machine (mean, p99, max); the capacity a machine needs for
--target-hit-rate (bisection, re-running the model); the repair time of a machine (detection
+ the bytes it held / the achievable repair rate); and the probability of losing a committed
block in a year at --afr, with the model stated.

  kvstore simulate --trace traces/mooncake_synthetic_trace.jsonl --machines 1000
  kvstore simulate --trace trace.jsonl --machines 1000 --target-hit-rate 0.6 --json
  kvstore simulate --trace trace.jsonl --machines 200 --machine-capacity 4TB --fail 3 --fail-at 300
  kvstore simulate --trace trace.jsonl --machines 14 --copies 1 --capacity-bytes 4.7GB --no-sizing

Sizes take units (4TB, 512GiB, 2e9); rates the same with or without /s (25GB/s); fractions
may be written as percentages (2%). Bad input prints one line naming the flag and exits 2."""

_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(%?)\s*$", re.IGNORECASE)


def parse_fraction(text: str, flag: str) -> float:
    """``0.02`` or ``2%``."""
    match = _PERCENT.match(text)
    if match is None:
        raise InvalidArgument(flag, f"expected a fraction such as 0.02 or 2%, got {text!r}")
    value = float(match.group(1)) / (100.0 if match.group(2) else 1.0)
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(flag, f"must be >= 0, got {text!r}")
    return value


def parse_rate(text: str, flag: str) -> int:
    """Bytes per second: ``25GB/s``, ``25GB``, ``1e9``."""
    return parse_size(re.sub(r"/s\s*$", "", text.strip(), flags=re.IGNORECASE), flag)


def parse_times(text: str, flag: str) -> list[float]:
    """Seconds: ``300`` or ``300,310,320``."""
    times = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise InvalidArgument(
                flag, f"expected seconds such as 300 or 300,310, got {text!r}"
            ) from None
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(flag, f"times must be >= 0 seconds, got {part!r}")
        times.append(value)
    return times


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, required=True, help="the trace file (JSONL)")
    parser.add_argument("--limit", type=int, help="model only the first N requests")
    parser.add_argument(
        "--machines", type=int, default=1000, help="machines in the fleet (default 1000)"
    )
    parser.add_argument(
        "--copies",
        type=int,
        help="copies of the trace's traffic (default: one per machine, see above)",
    )
    parser.add_argument(
        "--speed", type=float, default=1.0, help="trace time runs this many times faster"
    )
    parser.add_argument(
        "--capacity-bytes",
        help="block payload bytes the whole tier may hold (as kvstore replay); default unbounded",
    )
    parser.add_argument(
        "--machine-capacity",
        help="live bytes each machine may hold (as kvstore up --capacity-bytes), e.g. 4TB",
    )
    parser.add_argument(
        "--target-hit-rate",
        help="size the tier for this token hit rate (default: 90%% of the unbounded one)",
    )
    parser.add_argument("--no-sizing", action="store_true", help="skip the capacity search")
    parser.add_argument("--gc-high", type=float, default=0.97, help="GC high watermark (0.97)")
    parser.add_argument("--gc-low", type=float, default=0.94, help="GC low watermark (0.94)")
    parser.add_argument(
        "--gc-interval", type=float, default=1.0, help="seconds between GC passes (1)"
    )
    parser.add_argument(
        "--gc-every", type=int, help="a GC pass after every N requests instead of by time"
    )
    parser.add_argument(
        "--gc-at-end",
        action="store_true",
        help="one more GC pass after the last request: bytes stored as kvstore replay "
        "measures them (once its GC settled)",
    )
    parser.add_argument(
        "--mode",
        default="bounded-replay",
        help="hit rule: bounded-replay (default) or full-attention",
    )
    parser.add_argument(
        "--traffic-class", default="chatbot", help="class the blocks are stored as (chatbot)"
    )
    parser.add_argument(
        "--afr", default="2%", help="annual failure rate of a machine (default 2%%)"
    )
    parser.add_argument("--fail", type=int, default=0, help="inject N machine failures")
    parser.add_argument(
        "--fail-at",
        help="when, seconds of simulated time: one (all at once) or N comma-separated "
        "(default: spread over the trace)",
    )
    parser.add_argument("--net-bw", default="25GB/s", help="network bandwidth per machine (25GB/s)")
    parser.add_argument("--disk-bw", default="6GB/s", help="disk bandwidth per machine (6GB/s)")
    parser.add_argument(
        "--repair-rate",
        help="repair's cap in shard bytes/s (default kvstore's repair_bytes_per_s, 128MiB/s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of failures and relabelling")
    parser.add_argument(
        "--timeline", type=float, default=60.0, help="seconds per bucket of the timeline (60)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _fail_times(args: argparse.Namespace, duration_s: float) -> tuple[float, ...]:
    if args.fail < 0:
        raise InvalidArgument("--fail", f"must be >= 0, got {args.fail}")
    if args.fail_at is None:
        return tuple(duration_s * (i + 1) / (args.fail + 1) for i in range(args.fail))
    if args.fail == 0:
        raise InvalidArgument("--fail-at", "says when --fail N failures happen: give --fail N")
    times = parse_times(args.fail_at, "--fail-at")
    if len(times) == 1:
        return tuple(times * args.fail)
    if len(times) != args.fail:
        raise InvalidArgument(
            "--fail-at", f"gives {len(times)} times for --fail {args.fail} (one or {args.fail})"
        )
    return tuple(times)


def _check(args: argparse.Namespace) -> None:
    """What can be checked before the trace is read."""
    if args.limit is not None and args.limit < 1:
        raise InvalidArgument("--limit", f"must be >= 1, got {args.limit}")
    if not args.trace.is_file():
        raise InvalidArgument("--trace", f"no such file: {args.trace}")


def _config(args: argparse.Namespace, duration_s: float) -> Any:
    from kvstore.trace.simulate import SimConfig

    def size_or_none(text: str | None, flag: str) -> int | None:
        return None if text is None else parse_size(text, flag)

    return SimConfig(
        machines=args.machines,
        copies=args.machines if args.copies is None else args.copies,
        capacity_bytes=size_or_none(args.capacity_bytes, "--capacity-bytes"),
        machine_capacity=size_or_none(args.machine_capacity, "--machine-capacity"),
        gc_high=args.gc_high,
        gc_low=args.gc_low,
        gc_interval_s=args.gc_interval,
        gc_every_requests=args.gc_every,
        gc_at_end=args.gc_at_end,
        mode=args.mode,
        traffic_class=args.traffic_class,
        speed=args.speed,
        afr=parse_fraction(args.afr, "--afr"),
        fail_at=_fail_times(args, duration_s / args.speed if args.speed > 0 else duration_s),
        seed=args.seed,
        net_bw=parse_rate(args.net_bw, "--net-bw"),
        disk_bw=parse_rate(args.disk_bw, "--disk-bw"),
        repair_bytes_per_s=None
        if args.repair_rate is None
        else parse_rate(args.repair_rate, "--repair-rate"),
        timeline_s=args.timeline,
    )


def run(args: argparse.Namespace) -> int:
    _check(args)
    target = None
    if args.target_hit_rate is not None:
        target = parse_fraction(args.target_hit_rate, "--target-hit-rate")
        if not 0 < target <= 1:
            raise InvalidArgument("--target-hit-rate", f"must be in (0, 1], got {target}")
    from tqdm import tqdm

    from kvstore.commands._client import print_json
    from kvstore.trace.mooncake import load_trace
    from kvstore.trace.simreport import FleetReport
    from kvstore.trace.simulate import PreparedTrace, simulate
    from kvstore.trace.sizing import capacity_for

    started = time.perf_counter()
    requests = load_trace(args.trace, args.limit)
    config = _config(args, requests[-1].at_s - requests[0].at_s)

    def bar(total: int, desc: str, unit: str) -> Any:
        return tqdm(total=total, desc=desc, unit=unit, disable=args.no_progress, file=sys.stderr)

    with bar(len(requests), "block keys", "req") as progress:
        prepared = PreparedTrace.of(requests, progress=progress.update)
    placement = prepared.placement(config.machines)
    with bar(placement.missing(), f"placement on {config.machines:,} machines", "block") as p:
        placement.compute_all(progress=p.update)
    with bar(len(requests), "model", "req") as progress:
        result = simulate(requests, config, prepared=prepared, progress=progress.update)
    sizing = None
    if not args.no_sizing:
        best = result.token_hit_rate
        if config.capacity_payload_bytes() is not None:
            unbounded = dataclasses.replace(config, capacity_bytes=None, machine_capacity=None)
            best = simulate(requests, unbounded, prepared=prepared).token_hit_rate
        goal = 0.9 * best if target is None else target
        with bar(0, "capacity search (model runs)", "run") as progress:
            sizing = capacity_for(prepared, config, goal, best, progress=progress.update)
    report = FleetReport.of(args.trace.name, result, sizing, time.perf_counter() - started)
    if args.json:
        print_json(report.as_dict())
    else:
        print("\n".join(report.lines()))
    return 0
