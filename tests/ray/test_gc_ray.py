"""The GC worker as a Ray actor over a real deployed block tier (shared local cluster).

The tier is small (4+2 coding, 6 storage nodes, 2 meta shards) to keep the shared machine's
memory in check; the GC logic does not depend on the stripe width. Time: the meta shards and
nodes run on the wall clock; the GC is told a ``now`` days ahead (``tick``), which is how the
injected clock crosses the actor boundary.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import ray

from kvstore.blockstore.config import BlockStoreConfig, StorageNodeConfig
from kvstore.gc.config import DAY, GCConfig
from kvstore.runtime.cluster import LocalCluster
from kvstore.runtime.deploy import deploy_blockstore
from kvstore.runtime.gc_actors import attach, deploy_gc, gc_actor_name, gc_worker_handle

PAYLOAD = 4_000
REPO = Path(__file__).resolve().parents[2]


def key(i: int) -> bytes:
    return hashlib.blake2b(b"gc-ray-%d" % i, digest_size=32).digest()


def payload(i: int) -> np.ndarray:
    return np.frombuffer(hashlib.shake_256(b"ray-%d" % i).digest(PAYLOAD), dtype=np.uint8)


@pytest.fixture
def tier(ray_cluster: LocalCluster, tmp_path: Path):  # type: ignore[no-untyped-def]
    config = BlockStoreConfig(
        data_shards=4,
        parity_shards=2,
        storage_nodes=6,
        meta_shards=2,
        orphan_grace_s=0.0,
        node=StorageNodeConfig(fsync="never"),
        data_root=str(tmp_path / "blocks"),
        deployment=f"gcray{os.getpid()}",
    )
    handles = deploy_blockstore(config, ray_cluster, start_repair=False)
    try:
        yield handles
    finally:
        gc_handle = gc_worker_handle(config.deployment)
        if gc_handle is not None:
            ray.kill(gc_handle, no_restart=True)
        handles.shutdown()


def indexed(handles) -> set[bytes]:  # type: ignore[no-untyped-def]
    tables = ray.get([m.snapshot_table.remote() for m in handles.metas], timeout=60)
    return {bytes(k) for t in tables for k in t.column("key").to_pylist()}


def blocks_indexed(handles) -> int:  # type: ignore[no-untyped-def]
    return sum(int(s["blocks"]) for s in ray.get([m.stats.remote() for m in handles.metas]))


def shard_files(handles) -> int:  # type: ignore[no-untyped-def]
    usage = ray.get([n.usage.remote() for n in handles.nodes.values()], timeout=60)
    return sum(u["shards"] for u in usage)


def test_gc_actor_killed_mid_pass_leaves_a_consistent_tier(tier) -> None:  # type: ignore[no-untyped-def]
    client = tier.client()
    agent, chatbot = list(range(200)), list(range(200, 205))
    for start in range(0, len(agent), 50):
        chunk = agent[start : start + 50]
        assert client.put_blocks([key(i) for i in chunk], [payload(i) for i in chunk], "agent").ok
    assert client.put_blocks([key(i) for i in chatbot], [payload(i) for i in chatbot], "chatbot").ok
    width = tier.config.stripe_width
    total = len(agent) + len(chatbot)
    assert shard_files(tier) == total * width
    later = time.time() + 3 * DAY + 600  # agent TTL passed, chatbot's not

    # One block per batch: a pass is ~200 rounds of index removal + shard deletes. Kill the
    # worker as soon as the index has started to shrink, i.e. in the middle of the pass.
    gc = deploy_gc(GCConfig(delete_batch=1), tier.config, run=False)
    pending = gc.tick.remote(later)
    deadline = time.monotonic() + 60
    while blocks_indexed(tier) == total:
        assert time.monotonic() < deadline, "the GC pass never started"
    ray.kill(gc, no_restart=True)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(pending, timeout=60)

    # Whatever the kill interrupted: every block is whole in the tier or a clean miss.
    present = indexed(tier)
    holders = list(tier.nodes.values())
    for i in agent + chatbot:
        if key(i) in present:
            holds = ray.get([n.holds.remote([key(i)]) for n in holders], timeout=60)
            assert sum(h[0] for h in holds) == width, f"block {i} indexed but not whole"
        else:
            assert client.get_blocks([key(i)]) == [None]
            assert client.lookup([key(i)]).hit_blocks == 0
    assert {key(i) for i in chatbot} <= present

    # A new pass (from this driver, through the same code) finishes the job.
    live = attach("auto", tier.config.deployment)
    report = live.worker(GCConfig(delete_batch=8)).tick(later)
    assert not report.errors
    assert indexed(tier) == {key(i) for i in chatbot}
    assert live.worker(GCConfig()).tick(later).expired.total_blocks == 0  # idempotent

    # Orphans the killed worker left are reclaimed by the nodes' scrub; nothing else is.
    ray.get([n.reclaim_orphans.remote(0.0) for n in holders], timeout=120)
    assert shard_files(tier) == len(chatbot) * width
    got = client.get_blocks([key(i) for i in chatbot])
    assert [g.tobytes() for g in got] == [payload(i).tobytes() for i in chatbot]


def test_gc_loop_runs_passes_and_cli_dry_run_sees_the_tier(tier, ray_cluster) -> None:  # type: ignore[no-untyped-def]
    client = tier.client()
    ids = list(range(12))
    assert client.put_blocks([key(i) for i in ids], [payload(i) for i in ids], "agent").ok
    gc = deploy_gc(GCConfig(scan_interval_s=0.2), tier.config, run=True)
    deadline = time.monotonic() + 60
    while ray.get(gc.status.remote(), timeout=30)["passes"] < 3:
        assert time.monotonic() < deadline, "the GC loop did not run"
        time.sleep(0.2)
    status = ray.get(gc.status.remote(), timeout=30)
    assert status["failures"] == 0
    assert status["last_pass"]["expired"] == {}  # wall clock: nothing is 3 days old yet
    assert len(indexed(tier)) == 12
    assert gc_worker_handle(tier.config.deployment) is not None
    assert gc_actor_name(tier.config.deployment).endswith("-gc")

    # `kvstore gc --dry-run` from another process, against this cluster.
    result = subprocess.run(
        [
            sys.executable, "-m", "kvstore.cli", "gc", "--dry-run", "--json",
            "--address", ray_cluster.address, "--deployment", tier.config.deployment,
        ],
        capture_output=True, text=True, timeout=180, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["expired"]["agent"]["blocks"] == 0
    assert plan["used_bytes"] == 12 * PAYLOAD
