"""The chaos tier: the whole kvstore tier on the session's Ray cluster grown to 13 machines.

One deployment is shared by the tests of a module (each scenario starts from a healthy tier and
heals it afterwards); it and the machines added for it go at the end of the module, so the rest
of the session runs on the cluster it had. A module may set ``CHAOS_CONFIG`` (a dict of
``ChaosConfig`` fields) to deploy its tier differently. Machines added here are the only ones a
scenario may crash, and the only ones removed; the session's first machines are shared with
other tests.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvstore.chaos.tier import MIN_MACHINES, ChaosConfig, ChaosTier
from kvstore.runtime.cluster import LocalCluster


@pytest.fixture(scope="module")
def chaos_tier(
    request: pytest.FixtureRequest,
    ray_cluster: LocalCluster,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ChaosTier]:
    added: list[str] = []
    tier = None
    try:
        while len(ray_cluster.machines) < MIN_MACHINES:
            added.append(ray_cluster.add_machine())
        config = ChaosConfig(
            data_root=str(tmp_path_factory.mktemp("chaos-blocks")),
            deployment="chaostest",
            **getattr(request.module, "CHAOS_CONFIG", {}),
        )
        tier = ChaosTier.deploy(ray_cluster, config, owned=added)
        yield tier
    finally:
        if tier is not None:
            tier.shutdown()
        for machine in added:
            if machine in ray_cluster.machines:
                ray_cluster.remove_machine(machine)
