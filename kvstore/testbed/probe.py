"""A tiny engine for testbed checks: put blocks through a gateway, read them back, judge bytes.

Runs on a testbed host (``ip netns exec``), talks only gRPC to the gateway, prints one JSON line:

    python3 -m kvstore.testbed.probe put   --keys FILE --count 40 GATEWAY_FLAGS...
    python3 -m kvstore.testbed.probe check --keys FILE GATEWAY_FLAGS...

``put`` writes ``--count`` fresh blocks (bytes a pure function of the key: ``payload_for``) and
records the committed keys in ``--keys``; ``check`` reads those keys and counts bit-exact reads,
misses and wrong bytes; a gateway that does not answer is ``{"error": ...}`` (exit 3), never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import grpc

from kvstore.api.client import KVStoreClient
from kvstore.api.server import read_token_file
from kvstore.chaos.ledger import payload_for
from kvstore.geometry import GeometryConfig
from kvstore.keys import BlockKey


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["put", "check"])
    parser.add_argument("--keys", type=Path, required=True, help="the keys file")
    parser.add_argument("--count", type=int, default=40, help="blocks to put")
    parser.add_argument("--server", required=True, metavar="HOST:PORT", help="the gateway")
    parser.add_argument("--token-file", type=Path, required=True)
    parser.add_argument("--tls-root-cert", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    size = GeometryConfig.default().block_bytes
    client = KVStoreClient(
        args.server,
        token=read_token_file(args.token_file),
        tls_root_cert=args.tls_root_cert,
        timeout_s=args.timeout,
    )
    try:
        if args.action == "put":
            keys = [BlockKey(os.urandom(32)) for _ in range(args.count)]
            payloads = [payload_for(key, size).tobytes() for key in keys]
            answer = client.put_blocks(keys, payloads, "chatbot")
            stored = [bytes(k).hex() for k in answer.committed_keys(keys)]
            args.keys.write_text(json.dumps(stored))
            print(json.dumps({"stored": len(stored), "asked": len(keys)}))
            return 0
        keys = [BlockKey(bytes.fromhex(k)) for k in json.loads(args.keys.read_text())]
        reads = client.get_blocks(keys)
        ok = misses = wrong = 0
        for key, read in zip(keys, reads, strict=True):
            if read.payload is None:
                misses += 1
            elif bytes(read.payload) == payload_for(key, size).tobytes():
                ok += 1
            else:
                wrong += 1
        print(json.dumps({"blocks": len(keys), "ok": ok, "misses": misses, "wrong": wrong}))
        return 0
    except grpc.RpcError as error:
        print(json.dumps({"error": f"{error.code().name}: {error.details()}"}))
        return 3
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
