"""Generated forwarders (``kvstore.runtime.forwards``) on a real Ray actor: a storage node's
Protocol calls through Ray, with positional, keyword and defaulted arguments, counted as the
hand-written ones were; Ray binds each ``.remote()`` against the Protocol's signature, so a
wrong argument fails at the caller."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import ray

from kvstore.blockstore.config import StorageNodeConfig
from kvstore.blockstore.node import split_shards
from kvstore.ec import Codec
from kvstore.runtime.blockstore_actors import StorageNodeActor, actor_options
from kvstore.runtime.cluster import LocalCluster, pin_to_machine


def test_a_storage_nodes_forwarded_calls_through_ray(
    ray_cluster: LocalCluster, tmp_path: Path
) -> None:
    options = actor_options(f"fwd-node-{tmp_path.name}", max_restarts=0)
    options.update(pin_to_machine(ray_cluster.machines[0]))
    node = StorageNodeActor.options(**options).remote(  # type: ignore[attr-defined]
        7, str(tmp_path), StorageNodeConfig(fsync="never"), "fwd", 1, 10.0
    )
    try:
        key = hashlib.blake2b(b"one", digest_size=32).digest()
        payload = np.arange(4000, dtype=np.uint32).astype(np.uint8)
        shard = Codec(4, 2).encode(payload, key)[1]
        call = lambda ref: ray.get(ref, timeout=60)  # noqa: E731
        assert call(node.ping.remote()) == 7
        assert call(node.put.remote(5, [key], [shard], [0], created=[1.0])) == [True]
        assert call(node.commit.remote(token=5, keys=[key])) == [True]
        got = split_shards(call(node.get.remote([key])))
        assert got[0] is not None and bytes(got[0]) == bytes(shard)
        assert call(node.holds.remote([key, b"\0" * 32])) == [True, False]
        assert call(node.scrub.remote())["corrupt"] == []  # both defaults
        assert call(node.scrub.remote(budget_bytes=1))["checked"] == 1  # one default
        assert call(node.manifest.remote()).num_rows == 1
        assert call(node.set_draining.remote(flag=True)) is True
        assert call(node.status.remote()) == {"node_id": 7, "draining": 1}
        assert call(node.delete.remote([key])) == 1  # not_after defaulted
        with pytest.raises(TypeError, match="budget"):
            node.scrub.remote(budgets=1)  # bound against the Protocol's signature, here
        counted = call(node.stats.remote())["ray_calls"]
        assert counted == {"put": 1, "commit": 1, "get": 1, "holds": 1, "delete": 1}
    finally:
        ray.kill(node, no_restart=True)
