"""`kvstore get`: read a block from a running kvstore into a file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc

from kvstore.commands._client import add_client_arguments, connect, print_json, rpc_error
from kvstore.commands.put import parse_key

NAME = "get"
HELP = "read a block by key into a file (or stdout); a miss exits 1 with its reason"
DESCRIPTION = """Read one block by its key (hex, as printed by `kvstore put`). The bytes are
rebuilt from any 10 of the 12 shards; a block that cannot be read is a miss (exit 1, with the
reason: never_written, evicted, expired, unreadable), never wrong bytes.

  kvstore get 3f9a...e1 -o restored.bin"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(parser)
    parser.add_argument("key", help="block key (64 hex digits)")
    parser.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")
    parser.add_argument("--json", action="store_true", help="print what was read as JSON")


def run(args: argparse.Namespace) -> int:
    key = parse_key(args.key, "key")
    with connect(args) as client:
        try:
            (read,) = client.get_blocks([key])
        except grpc.RpcError as error:
            raise rpc_error(error, args.server) from None
    if read.payload is None:
        if args.json:
            print_json({"key": args.key, "found": False, "miss_reason": read.miss_reason})
        else:
            print(
                f"kvstore get: miss: {args.key} ({read.miss_reason or 'unknown'})", file=sys.stderr
            )
        return 1
    if args.output is not None:
        args.output.write_bytes(read.payload)
    elif not args.json:
        sys.stdout.buffer.write(read.payload)
    if args.json:
        print_json(
            {
                "key": args.key,
                "found": True,
                "bytes": len(read.payload),
                "degraded": read.degraded,
                "output": str(args.output) if args.output else None,
            }
        )
    return 0
