"""`kvstore bench`: run one of the benchmarks under benchmarks/ (each compares with its peer)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from kvstore.errors import InvalidArgument

NAME = "bench"
HELP = "run a benchmark (ec, blockstore, gc, swa, grpc, swapin) and print its table"
DESCRIPTION = """Run one benchmark of benchmarks/ in a fresh process. Each prints a table with
medians and, in the same run, the peer a user would otherwise pick (zfec/reedsolo for the codec,
Redis for the block tier and the gRPC API, a dict for the GC index). Extra arguments after `--`
go to the benchmark (see `kvstore bench NAME -- --help`).

  kvstore bench ec
  kvstore bench grpc -- --server 127.0.0.1:50051 --seconds 10
  kvstore bench blockstore --json"""

BENCHMARKS = {
    "ec": "erasure coding 10+2 vs zfec and reedsolo",
    "blockstore": "block tier put/get vs Redis pipelined SET/GET",
    "gc": "index memory per block and GC scan rate vs a dict",
    "swa": "SWA directory lookups, state fetch, query_hit",
    "grpc": "QueryHit QPS and p50/p99 vs Redis pipelined EXISTS",
    "swapin": "layer-wise swap-in overlapped with compute",
}


def benchmarks_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "benchmarks"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("--json", action="store_true", help="ask the benchmark for JSON")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="arguments for the benchmark")


def run(args: argparse.Namespace) -> int:
    script = benchmarks_dir() / f"{args.name}.py"
    if not script.is_file():
        raise InvalidArgument(
            "name", f"{script} not found: benchmarks run from a source checkout of kvstore"
        )
    extra = [part for part in args.extra if part != "--"]
    command = [sys.executable, str(script), *(["--json"] if args.json else []), *extra]
    return subprocess.call(command)
