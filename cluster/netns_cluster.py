#!/usr/bin/env python3
"""A multi-host kvstore testbed on this machine: hosts in network namespaces, for a person to
poke at (root only; needs iproute2).

    python3 cluster/netns_cluster.py up --kvstore        # head, s1..s7, client; kvstore up on head
    python3 cluster/netns_cluster.py status              # hosts, addresses, processes, links
    python3 cluster/netns_cluster.py exec client -- kvstore status   # gateway flags added for you
    python3 cluster/netns_cluster.py exec s3 -- ss -tnp  # any command on a host
    python3 cluster/netns_cluster.py link s3 down        # cut a host off (and `link s3 up`)
    python3 cluster/netns_cluster.py down                # every process, namespace and file gone
    python3 cluster/netns_cluster.py loop --runs 5       # up, check, down, check nothing is left

Hosts get addresses in 198.18.0.0/15 (a test range, never routed) on one bridge in a namespace
of its own; the machine's own network is not touched. Ray runs with token authentication on
every host; the gateway on the head serves TLS with a bearer token (both made for the testbed,
under its run directory /tmp/<name>-<random>, made fresh and private). `up` leaves the testbed
running and returns; Ctrl-C or a failure during `up` takes down what was made. See
kvstore/testbed/.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.errors import KVStoreError  # noqa: E402
from kvstore.testbed.testbed import (  # noqa: E402
    CLIENT,
    Gateway,
    Testbed,
    TestbedConfig,
    down_all,
    testbeds,
)

#: kvstore commands that take the gateway's flags (``exec`` adds them).
_CLIENT_COMMANDS = {"status", "stats", "hit", "put", "get", "replay"}


def _say(message: str) -> None:
    print(f"testbed: {message}", file=sys.stderr, flush=True)


def _one(name: str | None) -> Testbed:
    beds = testbeds()
    if name:
        beds = [b for b in beds if b.name == name]
    if not beds:
        raise SystemExit(f"netns_cluster: no testbed{' ' + name if name else ''} is up")
    if len(beds) > 1:
        names = ", ".join(b.name for b in beds)
        raise SystemExit(f"netns_cluster: several testbeds are up ({names}): give --name")
    return Testbed.attach(beds[0])


def _gateway(bed: Testbed) -> Gateway | None:
    path = bed.run_dir / "gateway.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return Gateway(data["address"], Path(data["token_file"]), Path(data["tls_root_cert"]))


def cmd_up(args: argparse.Namespace) -> int:
    config = TestbedConfig(storage_hosts=args.hosts, name=args.name or "")
    started = time.monotonic()
    bed = Testbed.up(config, progress=_say)
    try:
        if args.kvstore:
            _say("kvstore up --address on the head host ...")
            gateway = bed.kvstore_up(*shlex.split(args.kvstore_args))
            (bed.run_dir / "gateway.json").write_text(
                json.dumps(
                    {
                        "address": gateway.address,
                        "token_file": str(gateway.token_file),
                        "tls_root_cert": str(gateway.tls_root_cert),
                    }
                )
            )
            # The tier outlives this command: its process is on the head host.
            bed.tiers.clear()
    except BaseException:
        bed.down()
        raise
    _say(f"up in {time.monotonic() - started:.0f} s")
    print(json.dumps(bed.status(), indent=1))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    bed = _one(args.name)
    status = bed.status()
    gateway = _gateway(bed)
    if gateway is not None:
        status["gateway"] = gateway.flags()
    status["foreign_sockets"] = bed.foreign_sockets()
    print(json.dumps(status, indent=1))
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    bed = _one(args.name)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit("netns_cluster: exec needs a command after the host")
    gateway = _gateway(bed)
    if command[:1] == ["kvstore"] and len(command) > 1 and command[1] in _CLIENT_COMMANDS:
        address_flag = "--address" if command[1] == "replay" else "--server"
        if gateway is not None and address_flag not in command:
            command += gateway.flags(address_flag)
    process = bed.network.popen(args.host, command, env=bed.env())
    return process.wait()


def cmd_link(args: argparse.Namespace) -> int:
    bed = _one(args.name)
    (bed.network.link_down if args.state == "down" else bed.network.link_up)(args.host)
    print(f"{args.host}: link {args.state}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    if args.name:
        left = _one(args.name).down()
    else:
        left = down_all()
    if left:
        print(f"left behind: {left}", file=sys.stderr)
        return 1
    print("down: no namespace, process or run directory left")
    return 0


def cmd_loop(args: argparse.Namespace) -> int:
    """Up, check every host reaches the head, down, check nothing is left; ``--runs`` times."""
    failures = 0
    print("| run | up s | hosts | cross-host check | kvstore up s | down s | left behind |")
    print("|---|---|---|---|---|---|---|")
    for run in range(1, args.runs + 1):
        started = time.monotonic()
        bed = Testbed.up(TestbedConfig(storage_hosts=args.hosts))
        up_s = time.monotonic() - started
        tier_s = "-"
        try:
            head = bed.network.address("head")
            probe = f"import socket; socket.create_connection(({head!r}, 6379), 5).close()"
            reached = [
                h
                for h in bed.network.hosts
                if bed.run(h, [sys.executable, "-c", probe]).returncode == 0
            ]
            check = f"{len(reached)}/{len(bed.network.hosts)} reach the GCS"
            if args.kvstore:
                tier_started = time.monotonic()
                gateway = bed.kvstore_up()
                status = bed.run(CLIENT, ["kvstore", "status", *gateway.flags()])
                tier_s = f"{time.monotonic() - tier_started:.0f}"
                check += ", status " + ("SERVING" if "SERVING" in status.stdout else "FAILED")
        finally:
            down_started = time.monotonic()
            left = bed.down()
            down_s = time.monotonic() - down_started
        ok = not left and len(reached) == len(bed.network.hosts) and "FAILED" not in check
        failures += not ok
        print(
            f"| {run} | {up_s:.0f} | {len(bed.network.hosts)} | {check} | {tier_s} | "
            f"{down_s:.1f} | {', '.join(left) or 'nothing'} |",
            flush=True,
        )
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.epilog = __doc__.split("\n\n", 1)[1]
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="bring a testbed up and leave it running")
    up.add_argument("--hosts", type=int, default=7, help="storage hosts (default 7)")
    up.add_argument("--name", help="testbed name (kvtb + up to 6 letters/digits)")
    up.add_argument("--kvstore", action="store_true", help="also run kvstore up on the head")
    up.add_argument(
        "--kvstore-args",
        default="",
        metavar="ARGS",
        help='more flags for that kvstore up, e.g. "--fsync never" (as kvstore replay\'s '
        "embedded tier runs)",
    )
    status = sub.add_parser("status", help="hosts, addresses, processes, links, sockets")
    status.add_argument("--name")
    exe = sub.add_parser("exec", help="run a command on a host (kvstore client flags added)")
    exe.add_argument("--name")
    exe.add_argument("host", help="head, s1 ... sN, or client")
    exe.add_argument("command", nargs=argparse.REMAINDER)
    link = sub.add_parser("link", help="take a host's link down or up")
    link.add_argument("--name")
    link.add_argument("host")
    link.add_argument("state", choices=["up", "down"])
    down = sub.add_parser("down", help="take a testbed (default: every one) down")
    down.add_argument("--name")
    loop = sub.add_parser("loop", help="up and down RUNS times, checking nothing is left")
    loop.add_argument("--runs", type=int, default=5)
    loop.add_argument("--hosts", type=int, default=7)
    loop.add_argument("--kvstore", action="store_true", help="also start kvstore up each time")
    args = parser.parse_args(argv)
    if getattr(args, "runs", 1) < 1:
        parser.error("--runs must be >= 1")
    handlers = {
        "up": cmd_up,
        "status": cmd_status,
        "exec": cmd_exec,
        "link": cmd_link,
        "down": cmd_down,
        "loop": cmd_loop,
    }
    try:
        return handlers[args.action](args)
    except KVStoreError as error:
        print(f"netns_cluster: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("netns_cluster: interrupted (what was being made was taken down)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
