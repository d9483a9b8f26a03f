"""What every scenario shares: its registration record, and running one with recovery after."""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from ray.exceptions import RayError

from kvstore.chaos.load import LoadStats
from kvstore.chaos.table import ScenarioResult
from kvstore.chaos.tier import ChaosTier
from kvstore.errors import KVStoreError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scenario:
    number: int
    name: str
    summary: str
    run: Callable[[ChaosTier], ScenarioResult]
    #: Part of the default test run (the others carry the ``chaos`` marker).
    default_run: bool = False


def run_scenario(tier: ChaosTier, scenario: Scenario) -> ScenarioResult:
    """Run one scenario from a healthy tier and leave the tier healthy again.

    A scenario that raises is reported as a broken promise (with the error), not as a crash of
    the whole chaos run; so is a tier that does not recover afterwards.
    """
    started = time.monotonic()
    try:
        tier.wait_healthy()
    except (KVStoreError, RayError) as error:
        result = ScenarioResult(scenario.name, scenario.summary)
        result.violations.append(f"the tier was not healthy before the scenario: {error}")
        result.seconds = time.monotonic() - started
        return result
    try:
        result = scenario.run(tier)
    except (
        KVStoreError,
        RayError,
        RuntimeError,
        AssertionError,
        OSError,
        ValueError,
        KeyError,
    ) as error:
        log.error("scenario %s raised:\n%s", scenario.name, traceback.format_exc())
        result = ScenarioResult(scenario.name, scenario.summary)
        result.violations.append(f"scenario raised {type(error).__name__}: {error}")
    try:
        tier.wait_healthy()
    except (KVStoreError, RayError) as error:
        result.violations.append(f"the tier did not recover afterwards: {error}")
    result.seconds = time.monotonic() - started
    return result


def absorb_load(result: ScenarioResult, stats: LoadStats) -> None:
    """Add a load run's figures to a result (misses are left to the scenario to judge)."""
    result.operations += stats.operations
    result.reads_ok += stats.reads_ok
    result.wrong_bytes += stats.wrong_bytes
    result.details["load"] = stats.as_dict()
    result.require(
        stats.errors == 0, f"clients raised {stats.errors} times: {stats.error_messages[:3]}"
    )


def seconds_or_violation(
    result: ScenarioResult, waited: float | None, what: str, timeout: float
) -> float | None:
    result.require(waited is not None, f"{what} did not happen within {timeout:.0f} s")
    return waited
