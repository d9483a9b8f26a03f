"""Host scenarios end to end: a testbed up, the scenarios run from its client host, all down.

``run_host_scenarios(["partition"])`` (what ``kvstore chaos --scenario partition`` and the tests
call) brings a ``kvstore.testbed`` up, starts this module as the driver on the client host
(``python3 -m kvstore.chaos.hostrun --testbed RUN_DIR --scenario NAME ...``: it joins the Ray
cluster over the test network, deploys a ``ChaosTier`` on the storage hosts and runs the
scenarios, printing one JSON line), runs ``head-loss`` itself from outside (it takes the Ray
head down, which a driver cannot survive), takes the testbed down and checks nothing is left.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore.chaos.catalog import HOST_CATALOG
from kvstore.chaos.table import ScenarioResult
from kvstore.errors import InvalidArgument

#: The driver's result line on stdout starts with this (Ray may print lines of its own).
RESULT_MARK = "KVSTORE-HOSTRUN-RESULT "
_DRIVER_TIMEOUT_S = 1800.0


def _in_driver() -> dict[str, Callable[..., ScenarioResult]]:
    from kvstore.chaos.scenarios.hosts import host_crash, partition

    return {"partition": partition, "host-crash": host_crash}


def driver_main(argv: list[str] | None = None) -> int:
    """The driver on the client host (see the module doc)."""
    parser = argparse.ArgumentParser(description="host scenarios, from a testbed's client host")
    parser.add_argument("--testbed", type=Path, required=True, help="the testbed's run dir")
    parser.add_argument("--scenario", action="append", required=True, help="scenario name")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from kvstore.chaos.scenarios.base import Scenario, run_scenario
    from kvstore.chaos.tier import ChaosConfig, ChaosTier
    from kvstore.runtime.cluster import connect
    from kvstore.testbed.testbed import Testbed

    functions = _in_driver()
    unknown = [name for name in args.scenario if name not in functions]
    if unknown:
        parser.error(f"--scenario {unknown[0]}: one of {', '.join(functions)}")
    bed = Testbed.attach(args.testbed)
    connect(bed.ray.address)
    hosts = bed.config.storage_hosts
    config = ChaosConfig(
        data_root=str(bed.run_dir / "chaos-data"),
        storage_nodes=2 * hosts,
        nodes_per_machine=2,
        deployment="hosts",
        seed=args.seed,
        # Reads and puts cross a real (virtual) network: a cut-off host's calls time out.
        call_timeout_s=4.0,
    )
    _say(f"deploying {config.storage_nodes} storage nodes on {hosts} hosts")
    tier = ChaosTier.deploy(bed.ray, config)
    results: list[dict[str, Any]] = []
    try:
        for number, name, summary, _ci in HOST_CATALOG:
            if name not in args.scenario:
                continue
            _say(f"scenario {number} {name}: {summary}")
            row = run_scenario(tier, Scenario(number, name, summary, functions[name]))
            _say(f"  {'PASS' if row.ok else 'FAIL'} in {row.seconds:.1f} s")
            results.append(row.as_dict())
    finally:
        tier.shutdown()
    print(RESULT_MARK + json.dumps(results), flush=True)
    return 0


def _say(message: str) -> None:
    print(f"kvstore chaos: {message}", file=sys.stderr, flush=True)


def _result_from(data: dict[str, Any]) -> ScenarioResult:
    fields = {k: v for k, v in data.items() if k != "ok"}
    return ScenarioResult(**fields)


def run_host_scenarios(
    names: list[str], *, seed: int = 0, progress: Callable[[str], None] = _say
) -> tuple[list[ScenarioResult], dict[str, Any]]:
    """Run host scenarios ``names`` on a fresh testbed; (rows, facts of the run: bring-up and
    teardown times, what was left behind)."""
    from kvstore.testbed.headloss import head_loss
    from kvstore.testbed.testbed import CLIENT, Testbed, TestbedConfig, teardown_on_signals

    known = [name for _, name, _, _ in HOST_CATALOG]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise InvalidArgument("scenario", f"{unknown[0]!r}: host scenarios are {known}")
    started = time.monotonic()
    bed = Testbed.up(TestbedConfig(), progress=progress)
    facts: dict[str, Any] = {"testbed": bed.config.name, "up_s": time.monotonic() - started}
    results: list[ScenarioResult] = []
    try:
        with teardown_on_signals(bed):
            driven = [name for name in names if name in _DRIVEN]
            if driven:
                results += _drive(bed, driven, seed, progress)
            if "head-loss" in names:
                progress("scenario 20 head-loss: the Ray head host lost, then restored")
                row = head_loss(bed, progress)
                progress(f"  {'PASS' if row.ok else 'FAIL'} in {row.seconds:.1f} s")
                results.append(row)
    finally:
        down_started = time.monotonic()
        facts["leftovers"] = bed.down()
        facts["down_s"] = time.monotonic() - down_started
        facts["client_host"] = CLIENT
    return results, facts


_DRIVEN = ("partition", "host-crash")


def _drive(bed: Any, names: list[str], seed: int, progress: Callable[[str], None]) -> list[Any]:
    argv = [sys.executable, "-m", "kvstore.chaos.hostrun", "--testbed", str(bed.run_dir)]
    argv += ["--seed", str(seed)]
    for name in names:
        argv += ["--scenario", name]
    log = bed.run_dir / "driver.log"
    out_path = bed.run_dir / "driver.out"
    with log.open("wb") as saved, out_path.open("wb") as out:
        process = bed.network.popen(
            "client", argv, env=bed.env(), stdout=out, stderr=subprocess.PIPE
        )
        assert process.stderr is not None
        deadline = time.monotonic() + _DRIVER_TIMEOUT_S
        for raw in process.stderr:  # the driver's progress, live
            saved.write(raw)
            line = raw.decode(errors="replace").rstrip()
            if line.startswith("kvstore chaos: "):
                progress(line[len("kvstore chaos: ") :])
            if time.monotonic() > deadline:
                process.kill()
                break
        process.wait(timeout=60)
    for line in out_path.read_text(errors="replace").splitlines():
        if line.startswith(RESULT_MARK):
            return [_result_from(row) for row in json.loads(line[len(RESULT_MARK) :])]
    raise RuntimeError(
        f"the driver on the client host ended ({process.returncode}) without results:\n"
        + log.read_text(errors="replace")[-3000:]
    )


if __name__ == "__main__":
    sys.exit(driver_main())
