"""Direct reads on a deployed block tier (real storage node actors on the session Ray cluster):
every node serves its engine read socket beside its fastcall one, with the read key deploy
made; a capability minted from a real lookup's lease reads the blocks bit-exact straight into
one buffer, and a revocation sent through the actors stops it."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
import pytest
import ray
from ray.exceptions import RayError

from kvstore.blockstore.capability import mint_for_lease
from kvstore.blockstore.config import BlockStoreConfig
from kvstore.blockstore.direct import DirectReader
from kvstore.runtime.cluster import LocalCluster
from kvstore.runtime.deploy import BlockStoreHandles, deploy_blockstore

SIZE = 128 * 1024


@pytest.fixture(scope="module")
def handles(
    ray_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BlockStoreHandles]:
    config = BlockStoreConfig(
        storage_nodes=12,
        meta_shards=1,
        data_root=str(tmp_path_factory.mktemp("direct")),
        deployment="direct-reads-test",
        call_timeout_s=15.0,
    )
    deployed = deploy_blockstore(config, ray_cluster, start_repair=False)
    yield deployed
    deployed.shutdown()


def test_a_leases_blocks_read_straight_from_the_nodes(handles: BlockStoreHandles) -> None:
    client = handles.client()
    keys = [os.urandom(32) for _ in range(40)]
    rng = np.random.default_rng(3)
    payloads = [rng.integers(0, 256, SIZE, dtype=np.uint8) for _ in keys]
    assert client.put_blocks(keys, payloads).stored == keys
    found = client.lookup(keys)
    assert found.hit_blocks == len(keys) and found.lease is not None
    lease = found.lease
    capability = mint_for_lease(handles.read_key(), lease, "alice")
    endpoints = handles.read_endpoints()
    assert sorted(endpoints) == list(range(12))
    config = handles.config
    reader = DirectReader(endpoints, config.data_shards, config.parity_shards)
    out = np.zeros(len(keys) * SIZE, np.uint8)
    sends_before = _sends(handles)
    assert reader.read_into(capability, list(lease.blocks), out) == [True] * len(keys)
    for b, payload in enumerate(payloads):
        assert np.array_equal(out[b * SIZE : (b + 1) * SIZE], payload)
    assert reader.counters["fast_blocks"] == len(keys)
    # The put laid each node's data shards end to end (data first, ``client._by_node``): each
    # node answered its one request with one send from its segment file.
    sent = _sends_since(handles, sends_before)
    assert sent == dict.fromkeys(sent, 1)

    # Released: the tier revokes through the actors; the same capability reads nothing.
    assert handles.revoke([lease.lease_id], lease.until) == 12
    out[:] = 0
    assert reader.read_into(capability, list(lease.blocks), out) == [False] * len(keys)
    assert not out.any()
    stats = ray.get(handles.nodes[0].stats.remote(), timeout=30)["engine_reads"]
    assert stats["revoked"] == 1 and stats.get("refused_revoked", 0) > 0
    client.release(lease)


def _sends_since(handles: BlockStoreHandles, before: dict[int, int]) -> dict[int, int]:
    """Each node's sends since ``before``, once every node has counted one (bounded): a node
    counts its sends when the call that made them returns, which on a busy machine can be
    after the reader already holds every byte of the reply."""
    deadline = time.monotonic() + 30
    while True:
        sent = _sends(handles)
        since = {node: sent[node] - before[node] for node in sent}
        if all(since.values()) or time.monotonic() > deadline:
            return since
        time.sleep(0.05)


def _sends(handles: BlockStoreHandles) -> dict[int, int]:
    """Each node's sends from its segment files so far (``EngineReadServer.stats``)."""
    stats = ray.get([h.stats.remote() for h in handles.nodes.values()], timeout=30)
    return {
        node: found["engine_reads"].get("sends", 0)
        for node, found in zip(handles.nodes, stats, strict=True)
    }


def test_a_key_made_up_by_an_engine_reads_nothing(handles: BlockStoreHandles) -> None:
    client = handles.client()
    keys = [os.urandom(32) for _ in range(4)]
    payloads = [np.full(SIZE, 7, np.uint8) for _ in keys]
    assert client.put_blocks(keys, payloads).stored == keys
    found = client.lookup(keys)
    assert found.lease is not None
    forged = mint_for_lease(os.urandom(32), found.lease, "alice")
    reader = DirectReader(handles.read_endpoints(), 10, 2)
    out = np.zeros(len(keys) * SIZE, np.uint8)
    assert reader.read_into(forged, list(found.lease.blocks), out) == [False] * len(keys)
    client.release(found.lease)


def test_a_restarted_node_serves_direct_reads_under_the_same_key(
    handles: BlockStoreHandles,
) -> None:
    """Ray restarts a crashed node with its arguments, the read key among them: it serves
    capabilities minted before its crash, on its new port, and still refuses those of the
    leases released before it (``revokedfile``)."""
    client = handles.client()
    keys = [os.urandom(32) for _ in range(6)]
    payloads = [np.full(SIZE, i, np.uint8) for i in range(len(keys))]
    assert client.put_blocks(keys, payloads).stored == keys
    found = client.lookup(keys)
    assert found.lease is not None
    capability = mint_for_lease(handles.read_key(), found.lease, "alice")
    released = client.lookup(keys)
    assert released.lease is not None
    released_capability = mint_for_lease(handles.read_key(), released.lease, "alice")
    assert handles.revoke([released.lease.lease_id], released.lease.until) == 12
    before = handles.read_endpoints()[3]
    incarnation = ray.get(handles.nodes[3].incarnation.remote(), timeout=30)
    handles.kill_node(3, restart=True)
    deadline = time.monotonic() + 120
    while True:  # until the restarted incarnation answers
        try:
            if ray.get(handles.nodes[3].incarnation.remote(), timeout=10) != incarnation:
                break
        except RayError:
            pass
        assert time.monotonic() < deadline, "node 3 did not restart"
        time.sleep(0.2)
    endpoints = handles.read_endpoints()
    assert endpoints[3] != before
    reader = DirectReader(endpoints, 10, 2)
    out = np.zeros(len(keys) * SIZE, np.uint8)
    assert reader.read_into(capability, list(found.lease.blocks), out) == [True] * len(keys)
    assert reader.counters["fast_blocks"] == len(keys)  # node 3's data shards included
    for b, payload in enumerate(payloads):
        assert np.array_equal(out[b * SIZE : (b + 1) * SIZE], payload)
    # The released lease's capability reads nothing, the restarted node 3 refusing it too.
    out[:] = 0
    misses = reader.read_into(released_capability, list(released.lease.blocks), out)
    assert misses == [False] * len(keys)
    assert not out.any()
    node_3 = ray.get(handles.nodes[3].stats.remote(), timeout=30)["engine_reads"]
    assert node_3["revoked"] >= 1 and node_3.get("refused_revoked", 0) > 0, node_3
    client.release(found.lease)
    client.release(released.lease)
