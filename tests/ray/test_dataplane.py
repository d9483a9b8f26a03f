"""The direct sockets as the data plane, on the session's real local Ray cluster: a block
client's shard bytes (and the meta shard calls of its puts and reads) go over the actors'
sockets and not through Ray, from the very first call; a killed node fails its calls as
``NodeUnavailable`` and reads degrade around it; an SWA state crosses Ray nodes over the
store's socket. Each plane's calls are counted by the actor itself (``stats()``)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

from kvstore.blockstore.calls import StorageNodeCalls, node_target
from kvstore.blockstore.config import BlockStoreConfig, StorageNodeConfig
from kvstore.blockstore.fanout import gather
from kvstore.errors import NodeUnavailable
from kvstore.geometry import GeometryConfig
from kvstore.runtime.cluster import LocalCluster
from kvstore.runtime.deploy import BlockStoreHandles, deploy_blockstore
from kvstore.runtime.swa_actors import deploy_swa
from kvstore.swa.config import SWAConfig
from kvstore.swa.transport import store_target

BLOCK = 114_048  # a block whose 4 data shards are ~28 KiB each
NODE_DATA = ("put", "get")
META_WRITES = ("begin_put", "commit", "lookup_wire", "release")


@pytest.fixture(scope="module")
def handles(ray_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    config = BlockStoreConfig(
        data_shards=4,
        parity_shards=2,
        storage_nodes=6,
        meta_shards=2,
        node=StorageNodeConfig(fsync="never"),
        data_root=str(tmp_path_factory.mktemp("dataplane")),
        deployment=f"dp{os.getpid()}",
        call_timeout_s=15.0,
    )
    made = deploy_blockstore(config, ray_cluster, start_repair=False)
    try:
        yield made
    finally:
        made.shutdown()


def planes(handles: BlockStoreHandles) -> tuple[Counter[str], Counter[str]]:
    """(calls served over the sockets, data calls served through Ray), summed over every node
    and meta shard, by ``kind.method``."""
    fast: Counter[str] = Counter()
    slow: Counter[str] = Counter()
    actors = [("node", h) for h in handles.nodes.values()] + [("meta", h) for h in handles.metas]
    answers = ray.get([h.stats.remote() for _, h in actors], timeout=60)
    for (kind, _), stats in zip(actors, answers, strict=True):
        fast.update({f"{kind}.{m}": n for m, n in stats["fastcall"]["served"].items()})
        slow.update({f"{kind}.{m}": n for m, n in stats["ray_calls"].items()})
    return fast, slow


def exact(got: list[np.ndarray | None], blobs: list[np.ndarray]) -> bool:
    return all(
        g is not None and g.tobytes() == b.tobytes() for g, b in zip(got, blobs, strict=True)
    )


def payloads(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(count)]


def test_a_clients_puts_and_reads_move_their_bytes_over_the_sockets_not_ray(
    handles: BlockStoreHandles,
) -> None:
    fast_before, slow_before = planes(handles)
    client = handles.client()  # its fanout fetched every endpoint already
    keys = [os.urandom(32) for _ in range(12)]
    blobs = payloads(len(keys), 1)
    assert client.put_blocks(keys, blobs).stored == keys
    hit = client.lookup(keys)
    assert hit.hit_blocks == len(keys)
    got = client.get_blocks(keys, hit.lease)
    client.release(hit.lease)
    assert exact(got, blobs)
    fast_after, slow_after = planes(handles)
    fast = fast_after - fast_before
    for method in NODE_DATA:
        assert fast[f"node.{method}"] > 0, f"no node {method} over the sockets: {fast}"
    for method in META_WRITES:
        assert fast[f"meta.{method}"] > 0, f"no meta {method} over the sockets: {fast}"
    # Not one data call through Ray, not even the first to each actor.
    assert slow_after - slow_before == Counter(), slow_after - slow_before


def test_a_killed_node_fails_its_calls_cleanly_and_reads_go_around_it(
    handles: BlockStoreHandles,
) -> None:
    client = handles.client()
    keys = [os.urandom(32) for _ in range(8)]
    blobs = payloads(len(keys), 2)
    assert client.put_blocks(keys, blobs).stored == keys
    fanout = client._fanout  # type: ignore[attr-defined]
    victim = 0
    target = node_target(victim)
    ticket = fanout.submit(target, StorageNodeCalls.get, keys)
    buffer, lengths = gather(fanout, [ticket], 15.0)[ticket]  # type: ignore[misc]
    assert fanout._fast._channels.get(target) is not None  # that call went over its socket
    handles.kill_node(victim, restart=False)  # returns once its process is gone
    try:
        ticket = fanout.submit(target, StorageNodeCalls.get, keys)
        outcome = gather(fanout, [ticket], 15.0)[ticket]
        assert isinstance(outcome, NodeUnavailable), outcome
        assert fanout._fast._channels.get(target) is None  # forgotten: asked for again later
        got = client.get_blocks(keys)  # k = 4 of the 5 nodes left
        assert exact(got, blobs)
    finally:
        handles.start_node(victim)  # back on its data dir, a new endpoint
    fresh = handles.client()
    ticket = fresh._fanout.submit(target, StorageNodeCalls.get, keys)  # type: ignore[attr-defined]
    buffer, lengths = gather(fresh._fanout, [ticket], 15.0)[ticket]  # type: ignore[attr-defined,misc]
    assert (lengths >= 0).sum() > 0  # its shards survived the kill
    stats = ray.get(handles.nodes[victim].stats.remote(), timeout=60)
    assert stats["fastcall"]["served"].get("get") == 1 and stats["ray_calls"] == {}


def test_an_swa_state_crosses_ray_nodes_over_the_stores_socket(
    ray_cluster: LocalCluster, tmp_path: Path
) -> None:
    geometry = GeometryConfig.default()
    state = np.random.default_rng(3).integers(0, 256, geometry.state_size_to_disk, dtype=np.uint8)
    machine = ray_cluster.machines[0]
    config = SWAConfig(
        name=f"dpswa{os.getpid()}",
        capacity_bytes=4 * state.size,
        heartbeat_interval_s=0.3,
        call_timeout_s=10.0,
    )
    swa = deploy_swa({machine: ray_cluster.node_id(machine)}, config=config, geometry=geometry)
    try:
        client = swa.client()  # the driver runs on the head node: another Ray node
        key = os.urandom(32)
        assert client.put(machine, key, 1024, state) is True
        transport = client._transport  # type: ignore[attr-defined]
        store_name = swa.stores[machine]
        assert transport._stores.prepare([store_target(store_name)], 30.0) == []
        before = ray.get(swa.store(machine).stats.remote(), timeout=60)["fastcall"]["served"]
        for _ in range(3):
            fetched = client.get(key)
            assert fetched is not None and fetched.blob.tobytes() == state.tobytes()
            assert not fetched.blob.flags.writeable
        after = ray.get(swa.store(machine).stats.remote(), timeout=60)["fastcall"]["served"]
        assert after.get("fetch", 0) - before.get("fetch", 0) == 3
    finally:
        swa.shutdown()
