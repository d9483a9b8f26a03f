"""Security review of ``kvstore up`` (issue 15), capacity: the figures the GC acts on, checked
against what the disk really has, on real storage nodes sharing this machine's filesystem.

Findings: 64 GiB per node by default while 12 nodes shared one filesystem (the GC believed in
677 GB with 77 GB free: ENOSPC long before the high watermark), and usage counted apparent sizes
(200 one-byte blocks took 10.5 MB of disk blocks and counted a fraction of it). Since the segment
log (issue 17) a node holds a few large files, counted as allocated; the GC counts live bytes.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from kvstore.blockstore.client import BlockStoreClient
from kvstore.blockstore.config import BlockStoreConfig, StorageNodeConfig
from kvstore.blockstore.fanout import META, NODE, LocalFanout
from kvstore.blockstore.meta import MetaShard
from kvstore.blockstore.node import StorageNode
from kvstore.clock import ManualClock
from kvstore.gc.config import GCConfig
from kvstore.gc.worker import GCWorker

NODES = 12


def _key(i: int) -> bytes:
    return hashlib.blake2b(b"capacity-%d" % i, digest_size=32).digest()


class _Tier:
    """Twelve storage nodes with default capacity under one data root, two meta shards."""

    def __init__(self, root: Path) -> None:
        self.clock = ManualClock(1_000_000.0)
        self.config = BlockStoreConfig(
            storage_nodes=NODES, meta_shards=2, node=StorageNodeConfig(fsync="never")
        )
        self.nodes = [
            StorageNode(i, root / f"node-{i}", self.config.node, self.clock) for i in range(NODES)
        ]
        self.metas = [MetaShard(i, self.config, self.clock) for i in range(2)]
        targets: dict[tuple[str, int], object] = {(NODE, n.node_id): n for n in self.nodes}
        targets.update({(META, m.shard_id): m for m in self.metas})
        self.fanout = LocalFanout(targets)
        self.client = BlockStoreClient(self.config, self.fanout, clock=self.clock)

    def gc_pass(self) -> dict[str, object]:
        worker = GCWorker(
            GCConfig(),
            self.fanout,
            meta_shards=range(2),
            nodes=range(NODES),
            class_names=self.config.traffic_classes,
            clock=self.clock,
        )
        return worker.run_once().as_dict()


def _allocated(root: Path) -> int:
    """Bytes the segment files under ``root`` take on disk, as the filesystem counts them."""
    return sum(path.lstat().st_blocks * 512 for path in root.glob("node-*/segments/*.seg"))


def test_twelve_nodes_on_one_filesystem_count_its_free_space_once(tmp_path: Path) -> None:
    tier = _Tier(tmp_path / "blocks")
    tier.client.put_blocks([_key(i) for i in range(4)], [bytes(50_000)] * 4, "default")
    report = tier.gc_pass()
    disk = os.statvfs(tmp_path)
    free = disk.f_bavail * disk.f_frsize
    used = int(report["used_bytes_before"])  # type: ignore[call-overload]
    capacity = int(report["capacity_bytes"])  # type: ignore[call-overload]
    held = _allocated(tmp_path / "blocks")
    # All that the nodes could ever hold: what they hold plus what the disk has left.
    assert used < capacity <= held + free, (capacity, used, held, free)
    # The GC counts the blocks' live records: never more than the disk holds for them.
    assert 0 < used <= held
    assert sum(node.usage()["bytes_used"] for node in tier.nodes) == held
    # And each node alone, taken as the GC takes it, never claims more than the disk has.
    for node in tier.nodes:
        usage = node.usage()
        assert usage["capacity_bytes"] <= usage["bytes_used"] + free


def test_two_hundred_one_byte_blocks_take_a_segment_a_node_counted_as_allocated(
    tmp_path: Path,
) -> None:
    tier = _Tier(tmp_path / "blocks")
    keys = [_key(i) for i in range(200)]
    payloads = [np.full(1, i % 256, dtype=np.uint8) for i in range(200)]
    result = tier.client.put_blocks(keys, payloads, "default")
    assert result.ok and len(result.stored) == 200
    files = list((tmp_path / "blocks").glob("node-*/segments/*"))
    assert len(files) == NODES  # one segment each, not 2,400 shard files
    allocated = _allocated(tmp_path / "blocks")
    assert sum(node.usage()["bytes_used"] for node in tier.nodes) == allocated > 0
    live = sum(node.usage()["live_bytes"] for node in tier.nodes)
    assert tier.gc_pass()["used_bytes_before"] == live <= allocated
