"""`kvstore undrain NODE`: put a draining (or drained) storage node back in service."""

from __future__ import annotations

import argparse

from kvstore.commands._client import print_json
from kvstore.commands.drain import add_cluster_arguments, same_command

NAME = "undrain"
HELP = "put a drained or draining storage node back in service"
DESCRIPTION = """\
End a drain (`kvstore drain NODE`) and put the node back in service: it takes new writes
again and the repair loop stops moving its shards. Shards already moved off it stay where
they went (their stripes are whole on the other nodes); new writes fill the node again.
Harmless on a node that is not draining.

  kvstore undrain 3
  kvstore undrain 3 --address 10.0.0.5:6379 --deployment kvstore --json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cluster_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvstore.runtime import drain

    live = drain.attach(args.address, args.deployment)
    live.check_node(args.node)
    status = drain.undrain_node(live.actor, args.node)
    if args.json:
        print_json(status)
    else:
        print(
            f"node {args.node} back in service: it takes new writes again "
            f"(`{same_command(args, 'drain')}` drains it again)"
        )
    return 0
