"""The shared local cluster: machines are real Ray nodes, pinning works, machines come and go."""

from __future__ import annotations

import os
import stat
import time

import pytest
import ray

from kvstore.errors import InvalidArgument
from kvstore.runtime.cluster import LocalCluster, alive_node_ids, pin_to_machine, pin_to_node


@ray.remote
class _WhereAmI:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def ray_auth(self) -> tuple[str | None, str | None]:
        return os.environ.get("RAY_AUTH_MODE"), os.environ.get("RAY_AUTH_TOKEN_PATH")


def test_every_machine_runs_with_token_auth_and_one_private_token_file(
    ray_cluster: LocalCluster,
) -> None:
    token = ray_cluster.token_path
    assert token is not None and token.is_file()
    assert stat.S_IMODE(token.stat().st_mode) & 0o077 == 0  # nobody else reads it
    actors = [_WhereAmI.options(**pin_to_machine(m)).remote() for m in ray_cluster.machines]
    try:
        # Workers on every machine were started by raylets that inherited the driver's choice.
        seen = ray.get([a.ray_auth.remote() for a in actors], timeout=60)
        assert seen == [("token", str(token))] * len(actors)
    finally:
        for actor in actors:
            ray.kill(actor)


def test_actors_land_on_the_machine_they_are_pinned_to(ray_cluster: LocalCluster) -> None:
    machines = ray_cluster.machines
    assert len(machines) >= 3
    actors = [_WhereAmI.options(**pin_to_machine(m)).remote() for m in machines]
    try:
        nodes = ray.get([a.node.remote() for a in actors], timeout=60)
        assert nodes == [ray_cluster.node_id(m) for m in machines]
        assert len(set(nodes)) == len(machines)
        assert set(nodes) <= set(alive_node_ids())
        by_node = _WhereAmI.options(**pin_to_node(nodes[0])).remote()
        assert ray.get(by_node.node.remote(), timeout=60) == nodes[0]
        ray.kill(by_node)
    finally:
        for actor in actors:
            ray.kill(actor)


def test_a_machine_removed_without_notice_is_declared_dead_and_can_come_back(
    ray_cluster: LocalCluster,
) -> None:
    machine = ray_cluster.add_machine()
    node_before = ray_cluster.node_id(machine)
    actor = _WhereAmI.options(**pin_to_machine(machine)).remote()
    assert ray.get(actor.node.remote(), timeout=60) == node_before
    ray_cluster.remove_machine(machine, graceful=False)
    assert machine not in ray_cluster.machines
    deadline = time.monotonic() + 30
    while node_before in alive_node_ids():
        assert time.monotonic() < deadline, "removed machine never declared dead"
        time.sleep(0.2)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.node.remote(), timeout=30)
    # The same machine id comes back as a new Ray node; pinned actors follow the id.
    assert ray_cluster.add_machine(machine) == machine
    again = _WhereAmI.options(**pin_to_machine(machine)).remote()
    try:
        assert ray.get(again.node.remote(), timeout=60) == ray_cluster.node_id(machine)
        assert ray_cluster.node_id(machine) != node_before
    finally:
        ray.kill(again)
        ray_cluster.remove_machine(machine)


def test_bad_machine_ids_are_rejected(ray_cluster: LocalCluster) -> None:
    with pytest.raises(InvalidArgument, match="machine_id"):
        ray_cluster.remove_machine("no-such-machine")
    with pytest.raises(InvalidArgument, match="machine_id"):
        ray_cluster.add_machine(ray_cluster.machines[0])
    with pytest.raises(InvalidArgument, match="machine_id"):
        pin_to_machine("")
