"""`kvstore stats`: the figures of a running kvstore, for a person (or --json for tools)."""

from __future__ import annotations

import argparse
from dataclasses import asdict

import grpc

from kvstore.commands._client import add_client_arguments, connect, print_json, rpc_error
from kvstore.commands._repair import drain_line, progress_line, repair_of, scrub_line

NAME = "stats"
HELP = "show hit rates, miss reasons, bytes stored, degraded reads and repairs"
DESCRIPTION = """Show the figures of a running kvstore (the same ones its Prometheus endpoint
exports): per traffic class the blocks looked up, hit and missed (with the miss reasons:
never_written, evicted, expired, unreadable, lease_expired), bytes stored per tier, degraded
reads, repair progress (stripes and bytes still to restore or move off a draining node, the
rate, the time left), drains under way, the background scrub, and live storage nodes. A figure
the cluster does not report shows as n/a.

  kvstore stats --server 127.0.0.1:50051
  kvstore stats --json"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON")


def _gb(value: float) -> str:
    return f"{value / 1e9:.3f} GB"


def run(args: argparse.Namespace) -> int:
    with connect(args) as client:
        try:
            stats = client.stats()
        except grpc.RpcError as error:
            raise rpc_error(error, args.server) from None
    if args.json:
        print_json(asdict(stats))
        return 0
    print(f"storage nodes      {stats.live_storage_nodes} live of {stats.storage_nodes}")
    print(f"block tier stored  {_gb(stats.block_bytes_stored)}")
    print(f"SWA tier stored    {_gb(stats.swa_bytes_stored)}")
    print(f"degraded reads     {stats.degraded_reads}")
    print(f"repairs            {stats.repairs_done} done, {stats.repairs_pending} pending")
    repair = repair_of(stats.extra)
    print(f"repair progress    {progress_line(repair)}")
    draining = drain_line(repair)
    if draining is not None:
        print(f"draining           {draining}")
    print(f"scrub              {scrub_line(repair)}")
    print()
    header = f"{'class':<10} {'lookups':>8} {'hit blk':>8} {'miss blk':>8} {'hit rate':>8}"
    print(f"{header}  misses by reason")
    for name, figures in sorted(stats.classes.items()):
        hits, misses = int(figures.get("hit_blocks", 0)), int(figures.get("miss_blocks", 0))
        rate = f"{hits / (hits + misses):.1%}" if hits + misses else "-"
        reasons = ", ".join(
            f"{reason}={count}" for reason, count in sorted(figures.get("miss_reasons", {}).items())
        )
        print(
            f"{name:<10} {int(figures.get('lookups', 0)):>8} {hits:>8} {misses:>8} {rate:>8}  "
            f"{reasons or '-'}"
        )
    return 0
