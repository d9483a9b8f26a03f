"""The chaos scenarios, in the order of the issue that asked for them (``catalog.py``).

Each is a plain function ``(ChaosTier) -> ScenarioResult``; ``run_scenario`` runs one from a
healthy tier and heals the tier afterwards, so any subset runs in any order on one deployment.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.chaos.catalog import CATALOG
from kvstore.chaos.scenarios.base import Scenario, run_scenario
from kvstore.chaos.scenarios.disk import corrupt
from kvstore.chaos.scenarios.gc_race import gc_lease
from kvstore.chaos.scenarios.log import compaction_race, restart_200k, segment_corrupt, torn_tail
from kvstore.chaos.scenarios.meta import meta_loss
from kvstore.chaos.scenarios.nodes import kill_three, kill_two, permanent_loss, restart
from kvstore.chaos.scenarios.redundancy import drain, repair_rate
from kvstore.chaos.scenarios.scrub import scrub
from kvstore.chaos.scenarios.slow import slow_node
from kvstore.chaos.scenarios.swa import swa_loss
from kvstore.chaos.scenarios.writers import writer_killed
from kvstore.chaos.table import ScenarioResult
from kvstore.chaos.tier import ChaosTier
from kvstore.errors import InvalidArgument

_FUNCTIONS: dict[str, Callable[[ChaosTier], ScenarioResult]] = {
    "kill-two": kill_two,
    "kill-three": kill_three,
    "restart": restart,
    "repair": permanent_loss,
    "corrupt": corrupt,
    "swa": swa_loss,
    "meta": meta_loss,
    "writer": writer_killed,
    "gc-lease": gc_lease,
    "slow-node": slow_node,
    "torn-tail": torn_tail,
    "segment-corrupt": segment_corrupt,
    "compaction-race": compaction_race,
    "restart-200k": restart_200k,
    "repair-rate": repair_rate,
    "drain": drain,
    "scrub": scrub,
}

SCENARIOS: tuple[Scenario, ...] = tuple(
    Scenario(number, name, summary, _FUNCTIONS[name], default)
    for number, name, summary, default in CATALOG
)
BY_NAME = {item.name: item for item in SCENARIOS}


def scenario(name: str) -> Scenario:
    try:
        return BY_NAME[name]
    except KeyError:
        raise InvalidArgument(
            "scenario", f"unknown scenario {name!r} (known: {', '.join(BY_NAME)})"
        ) from None


__all__ = ["BY_NAME", "SCENARIOS", "Scenario", "run_scenario", "scenario"]
