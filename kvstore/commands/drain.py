"""`kvstore drain NODE`: move every shard off a storage node before it is taken out of service,
and watch it happen."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from typing import Any

from kvstore.commands._client import print_json
from kvstore.errors import InvalidArgument
from kvstore.humanize import duration, rate, size

NAME = "drain"
HELP = "move every shard off a storage node so it can be stopped safely (resumable)"
DESCRIPTION = """\
Drain a storage node before taking it out of service (a disk swap, a machine retired): the
node stops taking new writes, and the repair loop moves every shard it holds to other nodes.
Each new shard is written and committed before the stripe's placement moves off the drained
node, so every stripe keeps all 12 of its shards (10 data + 2 parity) throughout, and a shard
stays readable on the node until it has moved. When no stripe references the node any more
it is safe to stop it: nothing loses redundancy. `kvstore undrain NODE` puts it back in service.

The drain is the cluster's work, not this command's: the mark is kept on the node, so it
survives restarts, and Ctrl-C here only stops watching (it prints how to resume). Running the
same command again picks the watch up where the drain is. A progress bar (stripes moved of
those there were, MB left, rate, ETA) goes to stderr; the result to stdout. Exit 0 when the
node is drained (or, with --no-wait, the drain started); 1 on --timeout; 130 on Ctrl-C.

A drain needs a place for every shard: with fewer than 13 storage nodes in service (12
shards per stripe on 12 different nodes) it is refused.

  kvstore drain 3                                 drain node 3, watch until done
  kvstore drain 3 --no-wait                       start it and return
  kvstore drain 3 --timeout 600 --json            wait at most 10 min, print JSON
  kvstore status --watch                          follow it (and any repair) from the gateway
  kvstore undrain 3                               put node 3 back in service
"""


def default_deployment() -> str:
    """The deployment `kvstore up` starts when not told otherwise (``ServiceConfig.from_env``:
    ``KVSTORE_BLOCKSTORE_DEPLOYMENT``, else ``kvstore``)."""
    return os.environ.get("KVSTORE_BLOCKSTORE_DEPLOYMENT", "").strip() or "kvstore"


def node_id(text: str) -> int:
    """argparse type of NODE: a storage node id."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a storage node id: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"storage node ids are >= 0, got {value}")
    return value


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """NODE, and how to reach the deployment's repair actor (drain and undrain)."""
    parser.add_argument("node", type=node_id, metavar="NODE", help="storage node id (0, 1, ...)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    live = parser.add_argument_group("running cluster")
    live.add_argument(
        "--address",
        default="auto",
        metavar="ADDR",
        help="Ray address of the kvstore cluster (default: auto, the one on this machine)",
    )
    live.add_argument(
        "--deployment",
        default=default_deployment(),
        metavar="NAME",
        help="deployment name given to `kvstore up` (default %(default)s)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cluster_arguments(parser)
    parser.add_argument(
        "--no-wait", action="store_true", help="start the drain and return without watching"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="stop watching after S seconds, exit 1 (the drain goes on; default: no limit)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def same_command(args: argparse.Namespace, command: str) -> str:
    """``kvstore <command> NODE`` with this invocation's cluster options."""
    words = ["kvstore", command, str(args.node)]
    if args.address != "auto":
        words += ["--address", args.address]
    if args.deployment != default_deployment():
        words += ["--deployment", args.deployment]
    return shlex.join(words)


class _Bar:
    """A tqdm bar of stripes moved, on stderr. Its total is the most stripes left seen (the
    drain's size when the watch started; it only shrinks after)."""

    def __init__(self, node: int, enabled: bool) -> None:
        self._node = node
        self._enabled = enabled
        self._bar: Any = None
        self._peak = 0

    def update(self, status: dict[str, Any]) -> None:
        left = status["stripes_left"]
        if not self._enabled or left is None:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(
                total=left,
                desc=f"draining node {self._node}",
                unit="stripe",
                file=sys.stderr,
                dynamic_ncols=True,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} stripes "
                "{postfix}",
            )
        self._peak = max(self._peak, left)
        self._bar.total = self._peak
        self._bar.n = self._peak - left
        self._bar.set_postfix_str(
            f"{size(status['bytes_left'])} left, {rate(status.get('rate_bytes_per_s'))}, "
            f"ETA {duration(status.get('eta_s'))}",
            refresh=True,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _report(status: dict[str, Any], args: argparse.Namespace) -> None:
    if args.json:
        print_json(status)
    elif status["done"]:
        print(
            f"node {args.node} drained: no stripe references it any more; it is safe to stop "
            f"(`{same_command(args, 'undrain')}` puts it back in service)"
        )
    else:
        stripes = status["stripes_left"]
        print(
            f"node {args.node} draining: {'n/a' if stripes is None else stripes} stripes, "
            f"{size(status['bytes_left'])} to move; watch it with `{same_command(args, NAME)}`"
        )


def run(args: argparse.Namespace) -> int:
    if args.timeout is not None:
        if not math.isfinite(args.timeout) or args.timeout <= 0:
            raise InvalidArgument("--timeout", f"must be > 0 seconds, got {args.timeout}")
        if args.no_wait:
            raise InvalidArgument("--timeout", "a limit on waiting; not with --no-wait")
    from kvstore.runtime import drain

    live = drain.attach(args.address, args.deployment)
    live.check_node(args.node)
    live.check_can_drain(args.node, drain.drain_status(live.actor))
    bar = _Bar(args.node, enabled=not args.no_progress and not args.no_wait)
    try:
        status = drain.drain_node(
            live.actor,
            args.node,
            wait=not args.no_wait,
            timeout_s=args.timeout,
            on_progress=bar.update,
            poll_s=drain.DRAIN_POLL_S,
        )
    except KeyboardInterrupt:
        bar.close()
        print(
            f"\nstopped watching; node {args.node} goes on draining in the background.\n"
            f"  watch it again:  {same_command(args, NAME)}\n"
            f"  cancel it:       {same_command(args, 'undrain')}",
            file=sys.stderr,
        )
        return 130
    except drain.DrainTimeout as error:
        bar.close()
        print(f"{getattr(args, '_prog', 'kvstore drain')}: {error}", file=sys.stderr)
        print(f"  watch it again:  {same_command(args, NAME)}", file=sys.stderr)
        if args.json:
            print_json(error.status)
        return 1
    finally:
        bar.close()
    _report(status, args)
    return 0
