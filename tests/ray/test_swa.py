"""The SWA tier on a real local multi-node Ray cluster: stores pinned to machines, a sharded
entrypoint directory, fetches across Ray nodes, entrypoints and machines lost for real."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray

from kvstore.errors import StateRejected
from kvstore.fastcall.client import FastChannel
from kvstore.geometry import GeometryConfig
from kvstore.runtime.cluster import LocalCluster, pin_to_machine
from kvstore.runtime.swa_actors import SWADeployment, deploy_swa
from kvstore.swa.config import SWAConfig
from kvstore.swa.directory import ShardMap
from kvstore.swa.transport import entry_target

GEOMETRY = GeometryConfig.default()
STATE = GEOMETRY.state_size_to_disk  # 1,415,040


def state(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, STATE, dtype=np.uint8)


def fresh_keys(count: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(count)]


def keys_on_every_shard(shards: list[str], per_shard: int) -> list[bytes]:
    """Fresh keys, `per_shard` of them on each directory shard, the shards taking turns.

    A test that loses one shard needs keys on it and on the others; a handful of random keys
    all land on one shard now and then (8 keys over 2 shards: 1 run in 128)."""
    shard_map = ShardMap(shards)
    chosen: dict[str, list[bytes]] = {shard: [] for shard in shards}
    for _ in range(1000 * per_shard * len(shards)):
        if all(len(keys) == per_shard for keys in chosen.values()):
            return [key for turn in zip(*chosen.values(), strict=True) for key in turn]
        key = os.urandom(32)
        if len(chosen[shard_map.shard_of(key)]) < per_shard:
            chosen[shard_map.shard_of(key)].append(key)
    raise AssertionError(f"no {per_shard} keys on each of {shards} in many draws")


def machines_of(cluster: LocalCluster, ids: list[str]) -> dict[str, str]:
    return {m: cluster.node_id(m) for m in ids}


@ray.remote
class Requester:
    """An engine-side client living on one machine."""

    def __init__(self, deployment: SWADeployment, machine: str) -> None:
        self.client = deployment.client(local_machine=machine)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def get(self, key: bytes) -> tuple[str, str, np.ndarray] | None:
        fetched = self.client.get(key)
        if fetched is None:
            return None
        return fetched.owner.machine_id, fetched.owner.store_name, fetched.blob


@pytest.fixture(scope="module")
def swa(ray_cluster: LocalCluster) -> Iterator[SWADeployment]:
    config = SWAConfig(
        name="swatest",
        capacity_bytes=16 * STATE,
        heartbeat_interval_s=0.3,
        owner_timeout_s=4.0,
        call_timeout_s=2.0,
    )
    deployment = deploy_swa(
        machines_of(ray_cluster, ray_cluster.machines[:3]), config=config, geometry=GEOMETRY
    )
    try:
        yield deployment
    finally:
        deployment.shutdown()


def test_a_state_stored_on_one_machine_is_fetched_bit_exact_from_another_node(
    ray_cluster: LocalCluster, swa: SWADeployment
) -> None:
    m0, m1 = ray_cluster.machines[:2]
    client = swa.client()
    key = fresh_keys(1)[0]
    original = state(1)
    assert client.put(m0, key, 1024, original) is True
    owner = client.lookup([key]).result()[0]
    assert owner is not None and owner.machine_id == m0

    remote = Requester.options(**pin_to_machine(m1)).remote(swa, m1)  # type: ignore[attr-defined]
    local = Requester.options(**pin_to_machine(m0)).remote(swa, m0)  # type: ignore[attr-defined]
    try:
        assert ray.get(remote.node.remote(), timeout=60) == ray_cluster.node_id(m1)
        answer = ray.get(remote.get.remote(key), timeout=60)
        assert answer is not None
        machine, store_name, blob = answer
        assert (machine, store_name) == (m0, swa.stores[m0])
        assert ray_cluster.node_id(machine) != ray_cluster.node_id(m1)  # crossed Ray nodes
        assert blob.dtype == np.uint8 and np.array_equal(blob, original)
        assert ray.get(remote.get.remote(fresh_keys(1)[0]), timeout=60) is None
        # A reader on the owner's own machine takes the shared-memory path: same bytes.
        assert ray.get(local.node.remote(), timeout=60) == ray_cluster.node_id(m0)
        answer = ray.get(local.get.remote(key), timeout=60)
        assert answer is not None and np.array_equal(answer[2], original)
    finally:
        ray.kill(remote)
        ray.kill(local)
    # The driver (on the head node) fetches it too, and the fetch fed the advice estimate.
    fetched = client.get(key)
    assert fetched is not None and np.array_equal(fetched.blob, original)
    assert client.advisor.link(m0).fetch_samples == 1


def test_lookups_are_batched_one_call_per_shard(swa: SWADeployment) -> None:
    client = swa.client()
    entries = [swa.entrypoint(s) for s in swa.shards]
    before = ray.get([e.stats.remote() for e in entries], timeout=30)
    keys = fresh_keys(300)
    assert client.lookup(keys).result() == [None] * 300
    after = ray.get([e.stats.remote() for e in entries], timeout=30)
    groups = ShardMap(swa.shards).group(keys)
    for shard, old, new in zip(swa.shards, before, after, strict=True):
        assert new["lookup_calls"] - old["lookup_calls"] == 1
        assert new["lookups"] - old["lookups"] == len(groups[shard])


def test_wrong_size_or_misaligned_position_is_rejected_naming_both(
    ray_cluster: LocalCluster, swa: SWADeployment
) -> None:
    m0 = ray_cluster.machines[0]
    client = swa.client()
    key = fresh_keys(1)[0]
    with pytest.raises(StateRejected, match=r"state of 1415039 B at position 256") as caught:
        client.put(m0, key, 256, np.zeros(STATE - 1, dtype=np.uint8))
    assert caught.value.argument == "blob"
    with pytest.raises(StateRejected, match=r"exactly 1415040 B .* p % 128 == 0") as caught:
        client.put(m0, key, 200, state(2))
    assert caught.value.argument == "position"
    # The store itself refuses too (a producer that skips the client), across Ray: a pool
    # holds every layout's states, so it checks the position and its largest size (the exact
    # size is the layout's, checked by the client and the gateway).
    store = swa.store(m0)
    with pytest.raises(StateRejected) as caught:
        ray.get(store.put.remote(key, 129, np.zeros(10, dtype=np.uint8)), timeout=30)
    assert caught.value.argument == "position" and "at most" in str(caught.value)
    with pytest.raises(StateRejected) as caught:
        ray.get(store.put.remote(key, 128, np.zeros(0, dtype=np.uint8)), timeout=30)
    assert caught.value.argument == "blob"
    assert ray.get(store.contains.remote([key]), timeout=30) == [False]
    assert client.lookup([key]).result()[0] is None


def test_a_killed_entrypoint_answers_miss_until_stores_re_register(
    ray_cluster: LocalCluster,
) -> None:
    # Heartbeats far apart, so the test decides when re-registration happens.
    config = SWAConfig(
        name="swakill",
        capacity_bytes=8 * STATE,
        num_entrypoints=2,
        heartbeat_interval_s=60.0,
        owner_timeout_s=300.0,
        call_timeout_s=2.0,
    )
    machines = ray_cluster.machines[:2]
    swa = deploy_swa(machines_of(ray_cluster, machines), config=config, geometry=GEOMETRY)
    try:
        client = swa.client()
        keys = keys_on_every_shard(swa.shards, 4)
        for index, key in enumerate(keys):
            assert client.put(machines[index % 2], key, 128 * (index + 1), state(index)) is True
        assert all(owner is not None for owner in client.lookup(keys).result())
        on_e0 = [k for k in keys if ShardMap(swa.shards).shard_of(k) == "e0"]
        others = [k for k in keys if k not in on_e0]
        assert on_e0 and others

        entry = swa.entrypoint("e0")
        incarnation = ray.get(entry.ping.remote(), timeout=30)
        ray.kill(entry, no_restart=False)
        deadline = time.monotonic() + 60
        while True:  # wait for the replacement; lookups meanwhile answer, never raise
            assert len(client.lookup(on_e0).result()) == len(on_e0)
            try:
                if ray.get(entry.ping.remote(), timeout=5) != incarnation:
                    break
            except ray.exceptions.RayError:
                pass
            assert time.monotonic() < deadline, "the entrypoint never came back"
            time.sleep(0.2)
        assert client.lookup(on_e0).result() == [None] * len(on_e0)
        assert all(owner is not None for owner in client.lookup(others).result())

        synced = ray.get([swa.store(m).sync_now.remote() for m in machines], timeout=30)
        assert all(all(answered.values()) for answered in synced)
        # The replacement asked for a full registration; the next sync sends it.
        ray.get([swa.store(m).sync_now.remote() for m in machines], timeout=30)
        owners = client.lookup(keys).result()
        assert [o.machine_id if o else None for o in owners] == [
            machines[i % 2] for i in range(len(keys))
        ]
        fetched = client.get(on_e0[0])
        assert fetched is not None and np.array_equal(fetched.blob, state(keys.index(on_e0[0])))
    finally:
        swa.shutdown()


def test_entrypoint_recovery_happens_by_itself_through_heartbeats(
    ray_cluster: LocalCluster, swa: SWADeployment
) -> None:
    client = swa.client()
    keys = keys_on_every_shard(swa.shards, 4)  # the killed e1 holds some of them
    for index, key in enumerate(keys):
        client.put(ray_cluster.machines[index % 3], key, 128, state(100 + index))
    assert all(owner is not None for owner in client.lookup(keys).result())
    entry = swa.entrypoint("e1")
    incarnation = ray.get(entry.ping.remote(), timeout=30)
    ray.kill(entry, no_restart=False)
    deadline = time.monotonic() + 60
    while True:
        try:
            if ray.get(entry.ping.remote(), timeout=5) != incarnation:
                break  # a fresh, empty replacement answers
        except ray.exceptions.RayError:
            pass
        assert time.monotonic() < deadline, "the entrypoint never came back"
        time.sleep(0.1)
    while not all(owner is not None for owner in client.lookup(keys).result()):
        assert time.monotonic() < deadline, "stores never re-registered with the new entrypoint"
        time.sleep(0.2)


def test_a_machine_removed_without_notice_drops_out_within_the_owner_timeout(
    ray_cluster: LocalCluster, swa: SWADeployment
) -> None:
    doomed = ray_cluster.add_machine()
    try:
        swa.add_store(doomed, ray_cluster.node_id(doomed))
        client = swa.client()
        key, survivor = fresh_keys(2)
        assert client.put(doomed, key, 512, state(7)) is True
        assert client.put(ray_cluster.machines[0], survivor, 512, state(8)) is True
        owner = client.lookup([key]).result()[0]
        assert owner is not None and owner.machine_id == doomed
        assert client.fetch(owner, key) is not None

        ray_cluster.remove_machine(doomed, graceful=False)
        removed_at = time.monotonic()
        while client.lookup([key]).result()[0] is not None:
            assert time.monotonic() - removed_at < swa.config.owner_timeout_s + 3.0
            time.sleep(0.1)
        gone_after = time.monotonic() - removed_at
        assert gone_after <= swa.config.owner_timeout_s + 3.0
        # A fetch from the lost owner (a stale answer someone still holds) is a miss, in time.
        started = time.monotonic()
        assert client.fetch(owner, key) is None
        assert time.monotonic() - started <= swa.config.call_timeout_s + 1.0
        assert client.get(key) is None
        # The rest of the tier is unaffected.
        fetched = client.get(survivor)
        assert fetched is not None and np.array_equal(fetched.blob, state(8))
    finally:
        swa.stores.pop(doomed, None)
        if doomed in ray_cluster.machines:
            ray_cluster.remove_machine(doomed)


def test_lru_eviction_and_ttl_expiry_unregister_from_the_directory(
    ray_cluster: LocalCluster,
) -> None:
    config = SWAConfig(
        name="swaevict",
        capacity_bytes=2 * STATE,
        ttl_s=3.0,
        num_entrypoints=2,
        heartbeat_interval_s=0.25,
        owner_timeout_s=5.0,
    )
    m0 = ray_cluster.machines[0]
    swa = deploy_swa(machines_of(ray_cluster, [m0]), config=config, geometry=GEOMETRY)
    try:
        client = swa.client()
        first, second, third = fresh_keys(3)
        client.put(m0, first, 128, state(1))
        client.put(m0, second, 256, state(2))
        assert client.put(m0, third, 384, state(3)) is True  # evicts `first` (LRU)
        assert [o is not None for o in client.lookup([first, second, third]).result()] == [
            False,
            True,
            True,
        ]
        assert client.get(first) is None
        # Nothing touches them now: within TTL + a heartbeat they expire and leave the directory.
        deadline = time.monotonic() + config.ttl_s + 5.0
        while any(o is not None for o in client.lookup([second, third]).result()):
            assert time.monotonic() < deadline, "expired states are still in the directory"
            time.sleep(0.1)
        stats: dict[str, Any] = ray.get(swa.store(m0).stats.remote(), timeout=30)
        assert stats["states"] == 0 and stats["evicted_lru"] == 1 and stats["expired_ttl"] == 2
    finally:
        swa.shutdown()


def _replaced(entrypoint: Any, incarnation: str) -> bool:
    try:
        return ray.get(entrypoint.ping.remote(), timeout=1) != incarnation
    except ray.exceptions.RayError:
        return False  # still down or restarting


def test_losing_the_machine_of_an_entrypoint_is_survived(ray_cluster: LocalCluster) -> None:
    doomed = ray_cluster.add_machine()
    m0 = ray_cluster.machines[0]
    config = SWAConfig(
        name="swaentryloss",
        capacity_bytes=16 * STATE,
        num_entrypoints=2,  # e0 on m0, e1 on the doomed machine
        heartbeat_interval_s=0.3,
        owner_timeout_s=4.0,
        call_timeout_s=1.5,
    )
    swa = deploy_swa(machines_of(ray_cluster, [m0, doomed]), config=config, geometry=GEOMETRY)
    try:
        client = swa.client()
        shard_map = ShardMap(swa.shards)
        keys = keys_on_every_shard(swa.shards, 6)
        registered = [client.put(m0, k, 128 * (i + 1), state(i)) for i, k in enumerate(keys)]
        lost_state = fresh_keys(1)[0]
        registered.append(client.put(doomed, lost_state, 128, state(99)))
        found = client.lookup([*keys, lost_state]).result()
        assert all(registered)
        assert all(o is not None for o in found)
        on_e1 = [k for k in keys if shard_map.shard_of(k) == "e1"]
        on_e0 = [k for k in keys if k not in on_e1]
        assert on_e0 and on_e1
        e0, e1 = swa.entrypoint("e0"), swa.entrypoint("e1")
        # Each entrypoint runs on the machine it was given (an actor asking Ray for no resource
        # at all would be placed at random, soft affinity or not).
        assert ray.get(e0.node_id.remote(), timeout=30) == ray_cluster.node_id(m0)
        assert ray.get(e1.node_id.remote(), timeout=30) == ray_cluster.node_id(doomed)
        e1_before = ray.get(e1.ping.remote(), timeout=30)

        ray_cluster.remove_machine(doomed, graceful=False)
        deadline = time.monotonic() + 60
        while True:
            started = time.monotonic()
            owners = client.lookup(keys).result()  # never raises, bounded by the call timeout
            assert time.monotonic() - started <= config.call_timeout_s + 1.0
            # Shard e0 lives on a healthy machine: its keys keep answering the whole time.
            assert all(owners[keys.index(k)] is not None for k in on_e0)
            if all(o is not None for o in owners) and _replaced(e1, e1_before):
                break  # e1 was restarted elsewhere and m0's store re-registered with it
            # (All found before e1 is replaced proves nothing: the removed machine's worker
            # may still answer Ray's direct calls for a moment.)
            assert time.monotonic() < deadline, "shard e1 never came back"
            time.sleep(0.2)
        owners_now = client.lookup(keys).result()
        assert [o.machine_id if o else None for o in owners_now] == [m0] * len(keys)
        # The lost machine's own state is a miss, not an error.
        deadline = time.monotonic() + config.owner_timeout_s + 5
        while client.lookup([lost_state]).result()[0] is not None:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert client.get(lost_state) is None
    finally:
        swa.stores.pop(doomed, None)
        swa.shutdown()
        if doomed in ray_cluster.machines:
            ray_cluster.remove_machine(doomed)


def test_an_unresponsive_entrypoint_endpoint_delays_no_other_shard(swa: SWADeployment) -> None:
    """A removed machine's process may linger: the kernel still accepts on its socket but nobody
    answers. Dialing it must not eat the deadline the healthy shards share, and the stale
    endpoint is dropped so the next lookup asks Ray."""
    client = swa.client()
    m0 = sorted(swa.stores)[0]
    shard_map = ShardMap(swa.shards)
    per_shard: dict[str, list[bytes]] = {shard: [] for shard in swa.shards}
    while any(len(group) < 2 for group in per_shard.values()):  # two keys on every shard
        key = fresh_keys(1)[0]
        if len(per_shard[shard_map.shard_of(key)]) < 2:
            per_shard[shard_map.shard_of(key)].append(key)
    keys = [key for group in per_shard.values() for key in group]
    assert all(client.put(m0, k, 128, state(i)) for i, k in enumerate(keys))
    # The client's socket channels, by target (the transport's fanout of the entrypoints).
    fast = client._transport._entries._fast  # type: ignore[attr-defined]
    names = [entry_target(shard) for shard in swa.shards]
    for shard, name in zip(swa.shards, names, strict=True):  # every shard on its socket
        endpoint = ray.get(swa.entrypoint(shard).fast_endpoint.remote(), timeout=30)
        fast._channels[name] = FastChannel(tuple(endpoint))
    assert all(
        o is not None for o in client.lookup(keys).result()
    )  # each channel now holds a socket
    assert all(fast._channels[name].idle() for name in names)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never answers
    try:
        victim = names[0]
        fast._channels[victim] = FastChannel((*silent.getsockname(), b"k" * 32))
        on_victim = per_shard[swa.shards[0]]
        started = time.monotonic()
        owners = client.lookup(keys).result()
        assert time.monotonic() - started <= swa.config.call_timeout_s + 1.0
        for key, owner in zip(keys, owners, strict=True):
            if key not in on_victim:
                assert owner is not None and owner.machine_id == m0
        assert (
            fast._channels.get(victim) is None
            or fast._channels[victim].endpoint[1] != (silent.getsockname()[1])
        )
        assert all(
            o is not None for o in client.lookup(keys).result()
        )  # through Ray, then re-resolved
    finally:
        silent.close()
