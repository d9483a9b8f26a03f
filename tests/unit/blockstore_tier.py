"""In-process block tier for unit tests: plain storage nodes and meta shards in ``tmp_path``,
wired by ``LocalFanout`` (switches to make a target dead or hung), on a manual clock."""

from __future__ import annotations

from pathlib import Path

from kvstore.blockstore.client import BlockStoreClient
from kvstore.blockstore.config import BlockStoreConfig, StorageNodeConfig
from kvstore.blockstore.fanout import META, NODE, LocalFanout
from kvstore.blockstore.meta import MetaShard
from kvstore.blockstore.node import StorageNode
from kvstore.clock import ManualClock


class Tier:
    def __init__(self, root: Path, nodes: int = 12, **overrides: object) -> None:
        self.root = root
        self.clock = ManualClock(1_000_000.0)
        settings: dict[str, object] = {
            "storage_nodes": nodes,
            "node": StorageNodeConfig(fsync="never"),
            "hedge_after_s": 0.02,
            "call_timeout_s": 0.3,
            # Dead and hung nodes here are fanout switches that a direct disk read would not
            # see; the short-circuit path has its own tests (``test_blockstore_localread.py``).
            "local_reads": False,
        }
        settings.update(overrides)
        self.config = BlockStoreConfig(**settings)  # type: ignore[arg-type]
        self.nodes = {i: self.new_node(i) for i in range(nodes)}
        self.metas = {
            i: MetaShard(i, self.config, self.clock) for i in range(self.config.meta_shards)
        }
        targets: dict[tuple[str, int], object] = {(NODE, i): n for i, n in self.nodes.items()}
        targets.update({(META, i): m for i, m in self.metas.items()})
        self.fanout = LocalFanout(targets)
        self.client = BlockStoreClient(self.config, self.fanout, clock=self.clock)

    def new_node(self, i: int) -> StorageNode:
        return StorageNode(i, self.root / f"node-{i}", self.config.node, self.clock)

    def rebuild_meta(self, shard: int) -> MetaShard:
        meta = MetaShard(shard, self.config, self.clock, rebuilding=True)
        for node_id, node in self.nodes.items():
            meta.absorb_manifest(node_id, node.manifest(shard, self.config.meta_shards))
        meta.finish_rebuild()
        self.metas[shard] = meta
        self.fanout.targets[(META, shard)] = meta
        return meta
