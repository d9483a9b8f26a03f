"""`kvstore status`: is the gateway up, and how many storage nodes are live."""

from __future__ import annotations

import argparse

import grpc

from kvstore.commands._client import add_client_arguments, connect, print_json, rpc_error

NAME = "status"
HELP = "check that a kvstore gateway is serving and its storage nodes are live"
DESCRIPTION = """Ask a running gateway (started by `kvstore up`) whether it is serving (the
standard grpc.health.v1 check) and how many storage nodes are live. Exit 0 when serving with at
least k=10 live storage nodes, 1 otherwise.

  kvstore status --server 127.0.0.1:50051"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    with connect(args) as client:
        try:
            serving = client.serving()
            stats = client.stats()
        except grpc.RpcError as error:
            raise rpc_error(error, args.server) from None
    healthy = serving and stats.live_storage_nodes >= 10
    figures = {
        "server": args.server,
        "serving": serving,
        "live_storage_nodes": stats.live_storage_nodes,
        "storage_nodes": stats.storage_nodes,
        "healthy": healthy,
    }
    if args.json:
        print_json(figures)
    else:
        state = "SERVING" if serving else "NOT SERVING"
        print(
            f"{args.server}: {state}, {stats.live_storage_nodes}/{stats.storage_nodes} storage "
            f"nodes live{'' if healthy else ' (DEGRADED: fewer than 10 live)'}"
        )
    return 0 if healthy else 1
