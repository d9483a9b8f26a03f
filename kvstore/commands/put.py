"""`kvstore put`: store files as blocks in a running kvstore."""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import grpc

from kvstore.commands._client import add_client_arguments, connect, print_json, rpc_error
from kvstore.errors import InvalidArgument
from kvstore.keys import KEY_BYTES

NAME = "put"
HELP = "store files as blocks (erasure coded 10+2); prints each block key"
DESCRIPTION = """Store each FILE as one block of the block tier. The key is the BLAKE2b-256 of the
file's bytes (content addressed) unless --key HEX gives it (one file only). A block is visible
only once its whole stripe is durable; the command prints the key of each committed block and
exits 1 if any could not be stored.

  kvstore put layer0.bin layer1.bin --class agent
  kvstore get 3f9a...e1 -o restored.bin"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(parser)
    parser.add_argument(
        "files",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="files to store, each exactly one block of the served model (block_bytes in "
        "`kvstore geometry`; any other size is refused)",
    )
    parser.add_argument("--key", help=f"the block key as {KEY_BYTES * 2} hex digits (one file)")
    parser.add_argument("--class", dest="traffic_class", default="", help="traffic class")
    parser.add_argument("--json", action="store_true", help="print JSON")


def parse_key(text: str, argument: str) -> bytes:
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise InvalidArgument(argument, f"{text!r} is not hex") from None
    if len(key) != KEY_BYTES:
        raise InvalidArgument(argument, f"must be {KEY_BYTES * 2} hex digits, got {len(text)}")
    return key


def run(args: argparse.Namespace) -> int:
    if args.key is not None and len(args.files) != 1:
        raise InvalidArgument("--key", "can name only one FILE")
    payloads = []
    for path in args.files:
        try:
            payload = path.read_bytes()
        except OSError as error:
            raise InvalidArgument("FILE", f"cannot read {path}: {error.strerror}") from None
        if not payload:
            raise InvalidArgument("FILE", f"{path} is empty")
        payloads.append(payload)
    if args.key is not None:
        keys = [parse_key(args.key, "--key")]
    else:
        keys = [hashlib.blake2b(payload, digest_size=KEY_BYTES).digest() for payload in payloads]
    with connect(args) as client:
        try:
            answer = client.put_blocks(keys, payloads, args.traffic_class)
        except grpc.RpcError as error:
            raise rpc_error(error, args.server) from None
    failed = {bytes(key) for key in answer.failed_keys}
    rows = [
        {"file": str(path), "key": key.hex(), "bytes": len(payload), "stored": key not in failed}
        for path, key, payload in zip(args.files, keys, payloads, strict=True)
    ]
    if args.json:
        print_json({"committed": answer.committed, "blocks": rows})
    else:
        for row in rows:
            state = "stored" if row["stored"] else "FAILED"
            print(f"{row['key']}  {row['bytes']:>10} B  {state}  {row['file']}")
    return 0 if not failed else 1
