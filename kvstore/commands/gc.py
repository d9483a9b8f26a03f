"""``kvstore gc``: what a GC pass expires and evicts, by traffic class (or run one)."""

from __future__ import annotations

import argparse
import json
import math
from datetime import UTC, datetime
from pathlib import Path

from kvstore.blockstore.config import BlockStoreConfig
from kvstore.clock import SystemClock
from kvstore.commands._output import print_document
from kvstore.errors import InvalidArgument, KVStoreError, StoreError
from kvstore.gc.config import DEFAULT_PATH, GCConfig
from kvstore.gc.planner import GCPlan, plan_index
from kvstore.traffic import DAY

NAME = "gc"
HELP = "show (--dry-run) or run one GC pass: TTL expiry per class, LRU eviction by watermark"
DESCRIPTION = """\
One GC pass: expire blocks idle past their traffic class's TTL (gc/gc.toml: agent 3 days,
chatbot 7 days), then, if the storage nodes are above the high watermark, evict the least
recently used unleased blocks until usage is at the low watermark. Leased blocks (reads in
progress) are never touched. Prints blocks and bytes per class.

Against a running kvstore (its Ray cluster):
  kvstore gc --dry-run --address 127.0.0.1:6379      what a pass would remove now
  kvstore gc --address 127.0.0.1:6379 --json         run one pass, report what it removed

Against an index snapshot (a parquet file of index_to_table(), e.g. from a meta shard),
without a cluster:
  kvstore gc --dry-run --index-snapshot shard0.parquet --in-days 3 --capacity-bytes 2e12
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dry-run", action="store_true", help="only show what would be removed; change nothing"
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_PATH,
        metavar="PATH",
        help="GC policy file (default: gc/gc.toml of this checkout)",
    )
    live = parser.add_argument_group("running cluster")
    live.add_argument(
        "--address",
        default="auto",
        metavar="ADDR",
        help="Ray address of the kvstore cluster (default: auto, the local one)",
    )
    live.add_argument(
        "--deployment",
        default=BlockStoreConfig().deployment,
        help="block tier deployment name (default %(default)s)",
    )
    snap = parser.add_argument_group("index snapshot (with --dry-run)")
    snap.add_argument("--index-snapshot", type=Path, metavar="FILE", help="parquet snapshot")
    when = snap.add_mutually_exclusive_group()
    when.add_argument("--now", metavar="ISO8601", help="plan at this time (naive = UTC)")
    when.add_argument("--in-days", type=float, metavar="N", help="plan N days from now")
    snap.add_argument(
        "--capacity-bytes",
        type=float,
        default=0,
        metavar="B",
        help="capacity in block bytes (0: plan no eviction)",
    )
    snap.add_argument(
        "--classes",
        default=",".join(BlockStoreConfig().traffic_classes),
        metavar="NAMES",
        help="class names by id, comma-separated (default %(default)s)",
    )


def _when(args: argparse.Namespace) -> float:
    if args.now is not None:
        try:
            moment = datetime.fromisoformat(args.now)
        except ValueError:
            raise InvalidArgument("--now", f"not an ISO 8601 time: {args.now!r}") from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        return moment.timestamp()
    now = SystemClock().now()
    if args.in_days is not None:
        if not math.isfinite(args.in_days) or args.in_days < 0:
            raise InvalidArgument("--in-days", f"must be >= 0, got {args.in_days}")
        now += args.in_days * DAY
    return now


def _print_plan(plan: GCPlan, as_json: bool, header: str) -> None:
    if as_json:
        print_document(json.dumps(plan.as_dict(), indent=2, sort_keys=True))
    else:
        print(header)
        print(plan.format_table())


def _snapshot_plan(args: argparse.Namespace, config: GCConfig) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kvstore.blockstore.indexsnapshot import index_from_table

    if not args.dry_run:
        raise InvalidArgument("--index-snapshot", "a snapshot can only be planned: add --dry-run")
    if not math.isfinite(args.capacity_bytes) or args.capacity_bytes < 0:
        raise InvalidArgument("--capacity-bytes", f"must be >= 0, got {args.capacity_bytes}")
    names = tuple(name.strip() for name in args.classes.split(","))
    if not all(names):
        raise InvalidArgument("--classes", f"empty class name in {args.classes!r}")
    path: Path = args.index_snapshot
    if not path.is_file():
        raise InvalidArgument("--index-snapshot", f"no such file: {path}")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as error:
        raise InvalidArgument("--index-snapshot", f"not a parquet file: {error}") from None
    try:
        index = index_from_table(table)
    except InvalidArgument as error:
        raise InvalidArgument("--index-snapshot", str(error)) from None
    now = _when(args)
    plan = plan_index(index, now, config, names, capacity_bytes=int(args.capacity_bytes))
    when = datetime.fromtimestamp(now, UTC).isoformat(timespec="seconds")
    _print_plan(plan, args.json, f"dry run: {len(index)} blocks in {path}, at {when}")
    return 0


def _live(args: argparse.Namespace, config: GCConfig) -> int:
    for flag, value in (("--now", args.now), ("--in-days", args.in_days)):
        if value is not None:
            raise InvalidArgument(flag, "only with --index-snapshot (a cluster runs at its now)")
    from kvstore.runtime import gc_actors

    try:
        tier = gc_actors.attach(args.address, args.deployment)
    except KVStoreError:
        raise
    except Exception as error:  # Ray raises plain exceptions for an unreachable address
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise StoreError(f"no kvstore cluster at {args.address} ({first_line})") from None
    try:
        if args.dry_run:
            plan = tier.plan(config)
            _print_plan(plan, args.json, f"dry run against {args.address}")
        else:
            report = tier.run_pass(config)
            if args.json:
                print_document(json.dumps(report.as_dict(), indent=2, sort_keys=True))
            else:
                print(f"GC pass against {args.address}")
                print(gc_actors.format_report(report))
    finally:
        tier.close()
    return 0


def run(args: argparse.Namespace) -> int:
    if args.config == DEFAULT_PATH and not DEFAULT_PATH.is_file():
        config = GCConfig()  # installed without a checkout: the defaults are gc/gc.toml's values
    else:
        config = GCConfig.from_file(args.config)
    if args.index_snapshot is not None:
        return _snapshot_plan(args, config)
    return _live(args, config)
