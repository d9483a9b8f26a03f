"""`kvstore replay`: a Mooncake request trace through the tier, against its oracles."""

from __future__ import annotations

import argparse
import math
import re
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from kvstore.errors import InvalidArgument

if TYPE_CHECKING:
    from kvstore.trace.replay import ReplayConfig

NAME = "replay"
HELP = "replay a Mooncake request trace through the tier and compare its hit rate to oracles"
DESCRIPTION = """Replays a Mooncake request trace (JSONL: timestamp ms, input_length,
output_length, hash_ids of 512-token prefix blocks) through the block tier the way engines
would, and reports the token hit rate next to the trace's oracles: an infinite cache, and an
exact LRU cache of the same capacity.

Hash id h stands for 512 tokens of its own, so each id is 4 kvstore blocks of 128 tokens keyed
by the canonical chained prefix keys; a request's last, partial id gives only its full blocks.
N engines (threads with their own gRPC client, no prefix cache of their own) take the requests
in timestamp order from one queue: QueryHit (lease), GetBlocks of the hit (every byte checked;
a block that fails to load is recomputed from there), PutBlocks of the rest.

The tier is an embedded one (14 storage nodes, like `kvstore demo`) unless --address names a
running gateway. Capacities are block payload bytes at the model's block size (114,048 B for
v4.1-flash), i.e. a number of blocks, whatever --payload-scale: the LRU oracle gets that many
blocks, and the embedded tier's storage nodes that many blocks' worth of shard bytes, with a GC
pass every second between --gc-high and --gc-low (the deployment default is 0.90 / 0.80). With
--address the running tier's own capacity and GC apply, and --capacity-bytes only sizes the
LRU oracle.

Prints a table (--json: the summary as JSON) and writes summary.json, hit_rate.png and
latency.png to --report-dir. Ctrl-C stops dispatching, lets the requests in flight finish and
reports what was done (exit 130). Exit 1 if a read returned wrong bytes.

  kvstore replay --trace tests/data/mooncake_synthetic_head700.jsonl
  kvstore replay --trace trace.jsonl --capacity-fraction 0.25
  kvstore replay --trace trace.jsonl --limit 500 --payload-scale 0.125 --capacity-bytes 2GB
  kvstore replay --trace trace.jsonl --speed 10 --engines 8 --mode full-attention
  kvstore replay --trace trace.jsonl --address 127.0.0.1:50051 --capacity-bytes 20GiB"""

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str, flag: str) -> int:
    """Bytes from ``20GB``, ``512MiB``, ``2e9`` or a plain integer (decimal and binary units)."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise InvalidArgument(flag, f"expected bytes such as 20GB, 512MiB or 1000000, got {text!r}")
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise InvalidArgument(flag, f"must be at least 1 byte, got {text!r}")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, required=True, help="the trace file (JSONL)")
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--engines", type=int, default=4, help="simulated engines (default 4)")
    parser.add_argument(
        "--speed",
        type=float,
        help="pace dispatch by the trace's timestamps, F times faster than real time "
        "(default: as fast as the engines go)",
    )
    parser.add_argument(
        "--mode",
        default="bounded-replay",
        help="hit rule: bounded-replay (default) or full-attention",
    )
    parser.add_argument(
        "--traffic-class", default="chatbot", help="traffic class of every request (chatbot)"
    )
    parser.add_argument(
        "--payload-scale",
        default="auto",
        help="share of the model's block bytes each payload carries, in (0, 1] (default auto: "
        "the largest of 1, 1/2, ... 1/64 whose unique blocks fit in half the free disk and "
        "whose run is expected within 10 minutes here)",
    )
    parser.add_argument(
        "--capacity-bytes",
        help="block payload bytes (at the model's block size) the tier may hold, e.g. 20GB, "
        "512MiB (default unbounded)",
    )
    parser.add_argument(
        "--capacity-fraction",
        type=float,
        help="capacity as this share of the slice's unique blocks (instead of --capacity-bytes)",
    )
    parser.add_argument(
        "--gc-high", type=float, default=0.97, help="GC high watermark (default 0.97)"
    )
    parser.add_argument("--gc-low", type=float, default=0.94, help="GC low watermark (0.94)")
    parser.add_argument(
        "--address", metavar="HOST:PORT", help="replay against this running gateway instead"
    )
    parser.add_argument("--token-file", type=Path, help="bearer token for --address (mode 0600)")
    parser.add_argument(
        "--tls-root-cert", type=Path, help="PEM root certificate of a TLS gateway at --address"
    )
    parser.add_argument(
        "--data-dir", type=Path, help="the embedded tier's data dir (default: a temporary one)"
    )
    parser.add_argument(
        "--report-dir",
        type=Path,
        default=Path("replay-report"),
        help="where summary.json and the plots go (default replay-report/)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def _config(args: argparse.Namespace) -> ReplayConfig:
    from kvstore.trace.replay import ReplayConfig

    if args.limit is not None and args.limit < 1:
        raise InvalidArgument("--limit", f"must be >= 1, got {args.limit}")
    scale: float | None = None
    if args.payload_scale != "auto":
        try:
            scale = float(args.payload_scale)
        except ValueError:
            raise InvalidArgument(
                "--payload-scale", f"must be a number in (0, 1] or auto, got {args.payload_scale!r}"
            ) from None
    token = None
    if args.token_file is not None:
        from kvstore.api.server import read_token_file
        from kvstore.errors import ConfigError

        try:
            token = read_token_file(args.token_file)
        except ConfigError as error:
            raise InvalidArgument("--token-file", error.detail) from None
    if args.tls_root_cert is not None and not args.tls_root_cert.is_file():
        raise InvalidArgument("--tls-root-cert", f"{args.tls_root_cert} is not a file")
    if args.address is not None:
        from kvstore.runtime.gc_actors import check_address

        if args.address == "auto" or check_address(args.address) is None:
            raise InvalidArgument("--address", f"expected HOST:PORT, got {args.address!r}")
    return ReplayConfig(
        engines=args.engines,
        speed=args.speed,
        mode=args.mode,
        traffic_class=args.traffic_class,
        payload_scale=scale,
        capacity_bytes=None
        if args.capacity_bytes is None
        else parse_size(args.capacity_bytes, "--capacity-bytes"),
        capacity_fraction=args.capacity_fraction,
        gc_high=args.gc_high,
        gc_low=args.gc_low,
        address=args.address,
        token=token,
        tls_root_cert=None if args.tls_root_cert is None else str(args.tls_root_cert),
        data_dir=args.data_dir,
        progress=not args.no_progress,
    )


class _StopOnInterrupt:
    """The first Ctrl-C asks the replay to stop (it finishes what is in flight and reports);
    a second one interrupts for good."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._previous: object = None

    def __enter__(self) -> _StopOnInterrupt:
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *_: object) -> None:
        signal.signal(signal.SIGINT, self._previous)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        print(
            "\nkvstore replay: stopping — finishing the requests in flight "
            "(Ctrl-C again to abandon them)",
            file=sys.stderr,
            flush=True,
        )
        self.event.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)


def run(args: argparse.Namespace) -> int:
    config = _config(args)
    from kvstore.commands._client import print_json
    from kvstore.trace.mooncake import load_trace
    from kvstore.trace.replay import run_replay
    from kvstore.trace.replay_report import format_report, write_report

    requests = load_trace(args.trace, args.limit)

    def say(line: str) -> None:
        print(line, flush=True)

    # With --json, stdout is the summary alone: the CLI sends the lines said here and what Ray
    # prints on the driver's stdout (raylet warnings) to stderr (kvstore.commands._output).
    with _StopOnInterrupt() as interrupt:
        say(f"trace: {len(requests):,} requests from {args.trace}")
        summary, served, _ = run_replay(
            config, requests, trace_name=args.trace.name, stop=interrupt.event, say=say
        )
        write_report(args.report_dir, summary, served)
    if args.json:
        print_json(summary)
    else:
        print()
        print(format_report(summary))
    if summary["wrong_bytes"]:
        print("kvstore replay: FAILED — a read returned wrong bytes", file=sys.stderr)
        return 1
    return 130 if interrupt.event.is_set() else 0
