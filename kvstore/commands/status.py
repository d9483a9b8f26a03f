"""`kvstore status`: is the gateway up, how many storage nodes are live, how far repair is
(once, or every few seconds with --watch)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import grpc

from kvstore.commands._client import add_client_arguments, connect, print_json, rpc_error
from kvstore.commands._output import print_json_line
from kvstore.commands._repair import bar, drain_line, number, progress_line, repair_of
from kvstore.errors import InvalidArgument, StoreError

NAME = "status"
HELP = "check that a kvstore gateway is serving and its storage nodes are live (--watch: live)"
DESCRIPTION = """Ask a running gateway (started by `kvstore up`) whether it is serving (the
standard grpc.health.v1 check), how many storage nodes are live, and how far repair is:
stripes and bytes still to restore (stripes missing 2 or 1 shards) or to move off draining
nodes, the rate and the time left. Exit 0 when serving with at least k=10 live storage nodes,
1 otherwise.

With --watch it asks again every --interval seconds and prints one line each time, with a
repair progress bar (of the stripes left when the watch started or since grew to), until
Ctrl-C or --count updates; the exit status is that of the last update. A gateway that stops
answering mid-watch is shown as such and asked again.

  kvstore status --server 127.0.0.1:50051
  kvstore status --watch --interval 5          follow a repair or a drain
  kvstore status --watch --count 3 --json      three JSON lines, one per update"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON (one line per update)")
    watch = parser.add_argument_group("watching")
    watch.add_argument(
        "--watch", action="store_true", help="ask again every --interval seconds until Ctrl-C"
    )
    watch.add_argument(
        "--interval",
        type=float,
        metavar="S",
        help="seconds between updates with --watch (default 2)",
    )
    watch.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N updates")


def _check(args: argparse.Namespace) -> None:
    if not args.watch:
        for flag, value in (("--interval", args.interval), ("--count", args.count)):
            if value is not None:
                raise InvalidArgument(flag, "only with --watch")
        return
    if args.interval is None:
        args.interval = 2.0
    if not math.isfinite(args.interval) or args.interval <= 0:
        raise InvalidArgument("--interval", f"must be > 0 seconds, got {args.interval}")
    if args.count is not None and args.count < 1:
        raise InvalidArgument("--count", f"must be >= 1, got {args.count}")


def _figures(server: str, serving: bool, stats: Any) -> dict[str, Any]:
    repair = repair_of(stats.extra)
    progress = repair.get("progress")
    return {
        "server": server,
        "serving": serving,
        "live_storage_nodes": stats.live_storage_nodes,
        "storage_nodes": stats.storage_nodes,
        "healthy": serving and stats.live_storage_nodes >= 10,
        "repair": dict(progress) if isinstance(progress, Mapping) else None,
        "draining": repair.get("draining") if isinstance(repair.get("draining"), Mapping) else {},
    }


def _ask(client: Any, server: str) -> tuple[dict[str, Any], Mapping[str, Any]]:
    try:
        serving = client.serving()
        stats = client.stats()
    except grpc.RpcError as error:
        raise rpc_error(error, server) from None
    return _figures(server, serving, stats), repair_of(stats.extra)


def _nodes_text(figures: Mapping[str, Any]) -> str:
    state = "SERVING" if figures["serving"] else "NOT SERVING"
    degraded = "" if figures["healthy"] else " (DEGRADED: fewer than 10 live)"
    return (
        f"{figures['server']}: {state}, {figures['live_storage_nodes']}/"
        f"{figures['storage_nodes']} storage nodes live{degraded}"
    )


def run(args: argparse.Namespace) -> int:
    _check(args)
    with connect(args) as client:
        if args.watch:
            return _watch(client, args)
        figures, repair = _ask(client, args.server)
    if args.json:
        print_json(figures)
    else:
        print(_nodes_text(figures))
        print(f"repair: {progress_line(repair)}")
        draining = drain_line(repair)
        if draining is not None:
            print(f"draining: {draining}")
    return 0 if figures["healthy"] else 1


def _watch(client: Any, args: argparse.Namespace) -> int:
    """One line per update until Ctrl-C or ``--count``. The first update must succeed (a wrong
    --server is an error, not a line every interval); later failures are shown and retried."""
    updates, healthy = 0, False
    peak = 0.0  # most stripes left seen: the bar's 100%
    try:
        while True:
            stamp = datetime.now().strftime("%H:%M:%S")
            try:
                figures, repair = _ask(client, args.server)
            except StoreError as error:
                if updates == 0:
                    raise
                healthy = False
                if args.json:
                    print_json_line(
                        {
                            "time": stamp,
                            "server": args.server,
                            "serving": False,
                            "healthy": False,
                            "error": f"not answering ({error})",
                        }
                    )
                else:
                    print(f"{stamp}  {args.server}: not answering ({error})", flush=True)
            else:
                healthy = bool(figures["healthy"])
                left = number(repair.get("progress"), "stripes_left")
                peak = max(peak, left or 0.0)
                if args.json:
                    print_json_line({"time": stamp, **figures})
                else:
                    line = f"{stamp}  {_nodes_text(figures)}  repair "
                    if left is not None:
                        line += f"{bar(peak - left, peak)} "
                    line += progress_line(repair)
                    draining = drain_line(repair)
                    if draining is not None:
                        line += f"  draining {draining}"
                    print(line, flush=True)
            updates += 1
            if args.count is not None and updates >= args.count:
                break
            time.sleep(args.interval)
    except KeyboardInterrupt:
        print(file=sys.stderr)  # end the line the terminal echoed ^C on
    return 0 if healthy else 1
