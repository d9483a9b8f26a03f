"""``kvstore chaos``: run failure-injection scenarios on a local multi-machine cluster."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore.chaos.catalog import (
    HOST_SCENARIO_NAMES,
    OWN_DEPLOYMENT,
    OWN_DEPLOYMENT_CONFIG,
    SCENARIO_NAMES,
)
from kvstore.commands._output import print_document
from kvstore.errors import InvalidArgument

if TYPE_CHECKING:
    from kvstore.chaos.scenarios import Scenario
    from kvstore.chaos.table import ScenarioResult

NAME = "chaos"
HELP = "inject failures (node kills, disk corruption, slow nodes, ...) and check every promise"
DESCRIPTION = """\
Starts its own local cluster (one Ray node per simulated machine, loopback only), deploys the
whole tier on it (a storage node per machine, meta shards, repair, the SWA tier), runs the
chosen scenario(s) and prints one row per scenario: faults injected, operations, reads OK,
failed reads, wrong bytes (must be 0), expected misses, committed blocks lost (must be 0),
time to detect and time to repair. Exits 1 when any promise was broken.

{names}

{hosts}

  kvstore chaos --scenario kill-two
  kvstore chaos --scenario all --json > chaos.json
  sudo kvstore chaos --scenario partition
""".format(
    names=textwrap.fill(
        f"Scenarios: {', '.join(SCENARIO_NAMES)} (see cluster/chaos/README.md), or all.",
        96,
        break_on_hyphens=False,
    ),
    hosts=textwrap.fill(
        f"On a multi-host testbed instead (root: hosts in network namespaces on a bridge, "
        f"kvstore.testbed; brought up and taken down by the run): {', '.join(HOST_SCENARIO_NAMES)}"
        ", or hosts for all three.",
        96,
        break_on_hyphens=False,
    ),
)

_CHOICES = [*SCENARIO_NAMES, "all", *HOST_SCENARIO_NAMES, "hosts"]

_MIN_MACHINES = 13


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scenario",
        required=True,
        choices=_CHOICES,
        metavar="NAME",
        help=f"one of {', '.join(_CHOICES)}",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--machines",
        type=int,
        default=_MIN_MACHINES,
        help=f"simulated machines, one storage node each (>= {_MIN_MACHINES}; default %(default)s)",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        help="where the storage nodes keep their files (default: a temporary directory)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of keys, victims and damage")


def run(args: argparse.Namespace) -> int:
    if args.scenario in (*HOST_SCENARIO_NAMES, "hosts"):
        return _run_on_hosts(args)
    if args.machines < _MIN_MACHINES:
        raise InvalidArgument(
            "--machines",
            f"must be >= {_MIN_MACHINES} (12-wide stripes and a spare), got {args.machines}",
        )
    if args.data_dir is not None and args.data_dir.exists() and any(args.data_dir.iterdir()):
        raise InvalidArgument("--data-dir", f"{args.data_dir} is not empty")
    from kvstore.chaos.scenarios import SCENARIOS, scenario
    from kvstore.chaos.table import format_table, to_json

    chosen = list(SCENARIOS) if args.scenario == "all" else [scenario(args.scenario)]
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    temporary = args.data_dir is None
    data_root = Path(tempfile.mkdtemp(prefix="kvstore-chaos-")) if temporary else args.data_dir
    started = time.monotonic()
    # Ray prints its own notices (a raylet we killed, ...) on this process's stdout; stdout is
    # for the table or the JSON only, so everything else goes to stderr until the end.
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        results = _run_scenarios(args, chosen, data_root)
    finally:
        sys.stdout.flush()
        os.dup2(real_stdout, 1)
        os.close(real_stdout)
        if temporary:
            shutil.rmtree(data_root, ignore_errors=True)
    extra = {"machines": args.machines, "seed": args.seed, "seconds": time.monotonic() - started}
    if args.json:
        print_document(to_json(results, extra))
    else:
        print(format_table(results))
    return 0 if all(row.ok for row in results) else 1


def _run_scenarios(
    args: argparse.Namespace, chosen: list[Scenario], data_root: Path
) -> list[ScenarioResult]:
    from kvstore.chaos.scenarios import run_scenario
    from kvstore.chaos.tier import ChaosConfig, ChaosTier
    from kvstore.runtime.cluster import LocalCluster

    _progress(f"starting a local cluster of {args.machines} machines")
    # Ray's default health checks (LocalClusterConfig) already leave a starved raylet alone;
    # the tier detects dead machines itself (its repair loop pings every 0.3 s).
    cluster = LocalCluster.start(num_machines=args.machines)
    results = []
    shared = [item for item in chosen if item.name not in OWN_DEPLOYMENT]
    own = sorted(
        (item for item in chosen if item.name in OWN_DEPLOYMENT),
        key=lambda item: OWN_DEPLOYMENT.index(item.name),
    )
    try:
        base = ChaosConfig(data_root=str(data_root), storage_nodes=args.machines, seed=args.seed)
        for group, config in (
            (shared, base),
            (own, base.with_changes(
                data_root=str(data_root / "own"), deployment="chaosown", **OWN_DEPLOYMENT_CONFIG
            )),
        ):  # fmt: skip
            if not group:
                continue
            deploying = time.monotonic()
            tier = ChaosTier.deploy(cluster, config)
            _progress(f"tier {config.deployment} deployed in {time.monotonic() - deploying:.0f} s")
            try:
                for item in group:
                    _progress(f"scenario {item.number} {item.name}: {item.summary}")
                    row = run_scenario(tier, item)
                    results.append(row)
                    _progress(f"  {'PASS' if row.ok else 'FAIL'} in {row.seconds:.1f} s")
            finally:
                tier.shutdown()
    finally:
        cluster.shutdown()
    return results


def _run_on_hosts(args: argparse.Namespace) -> int:
    from kvstore.chaos.hostrun import run_host_scenarios
    from kvstore.chaos.table import format_table, to_json

    names = list(HOST_SCENARIO_NAMES) if args.scenario == "hosts" else [args.scenario]
    started = time.monotonic()
    results, facts = run_host_scenarios(names, seed=args.seed, progress=_progress)
    extra = {**facts, "seed": args.seed, "seconds": time.monotonic() - started}
    if args.json:
        print_document(to_json(results, extra))
    else:
        print(format_table(results))
    if facts["leftovers"]:
        print(f"kvstore chaos: the testbed left {facts['leftovers']}", file=sys.stderr)
    return 0 if all(row.ok for row in results) and not facts["leftovers"] else 1


def _progress(message: str) -> None:
    print(f"kvstore chaos: {message}", file=sys.stderr, flush=True)
