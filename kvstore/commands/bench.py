"""`kvstore bench`: run one of the benchmarks under benchmarks/ (each compares with its peer)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from kvstore.commands._output import print_document
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


class _Extra(argparse.Action):
    """The benchmark's arguments (everything after NAME). A ``--json`` among them is this
    command's own flag: ``kvstore bench gc --json`` lands here, not on ``--json``, and the CLI
    must know it (one JSON document on stdout); the benchmark gets it either way."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        extra = [str(value) for value in values] if isinstance(values, list) else []
        if "--json" in extra:
            namespace.json = True
        setattr(namespace, self.dest, [part for part in extra if part not in ("--", "--json")])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("--json", action="store_true", help="ask the benchmark for JSON")
    parser.add_argument(
        "extra", nargs=argparse.REMAINDER, action=_Extra, help="arguments for the benchmark"
    )


def run(args: argparse.Namespace) -> int:
    script = benchmarks_dir() / f"{args.name}.py"
    if not script.is_file():
        raise InvalidArgument(
            "name", f"{script} not found: benchmarks run from a source checkout of kvstore"
        )
    command = [sys.executable, str(script), *(["--json"] if args.json else []), *args.extra]
    if not args.json:
        return subprocess.call(command)
    # The benchmark's stdout is the document: taken whole, checked, and handed on as the one
    # JSON document of this command (its stderr, and the descriptor 1 its own children inherit
    # from it, are not stdout: see kvstore.commands._output).
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    try:
        json.loads(done.stdout)
    except ValueError:
        sys.stderr.write(done.stdout)
        print(
            f"kvstore bench: {args.name}'s --json output is not one JSON document (above)",
            file=sys.stderr,
        )
        return done.returncode or 1
    print_document(done.stdout.strip())
    return done.returncode
