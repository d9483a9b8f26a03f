"""In-process block tier for unit tests: plain storage nodes and meta shards in ``tmp_path``,
wired by ``LocalFanout`` (switches to make a target dead or hung, and ``tamper`` to make a
node answer damaged shards), on a manual clock."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvstore.blockstore.client import BlockStoreClient
from kvstore.blockstore.config import BlockStoreConfig, StorageNodeConfig
from kvstore.blockstore.fanout import META, NODE, LocalFanout
from kvstore.blockstore.meta import MetaShard
from kvstore.blockstore.node import StorageNode, split_shards
from kvstore.clock import ManualClock
from kvstore.keys import BlockKey

#: What a tampered node answers for a key instead of its shard (None: absent).
Tamper = Callable[[np.ndarray], np.ndarray | None]


class Tier:
    def __init__(self, root: Path, nodes: int = 12, **overrides: object) -> None:
        self.root = root
        self.clock = ManualClock(1_000_000.0)
        settings: dict[str, object] = {
            "storage_nodes": nodes,
            "node": StorageNodeConfig(fsync="never"),
            "hedge_after_s": 0.02,
            "call_timeout_s": 0.3,
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

    def reclaim_orphans(self) -> int:
        """Past the orphan grace, every node's orphan scrub, answered by the meta shards (as
        the node actors ask them); returns how many shards it dropped."""
        self.clock.advance(self.config.orphan_grace_s + 1)
        dropped = 0
        for node_id, node in self.nodes.items():

            def referenced(keys: list[BlockKey], node_id: int = node_id) -> list[bool]:
                answer = [False] * len(keys)
                for shard, positions in self.client._by_meta(keys).items():
                    asked = self.metas[shard].referenced([keys[p] for p in positions], node_id)
                    for position, used in zip(positions, asked, strict=True):
                        answer[position] = used
                return answer

            done = node.reclaim_orphans(referenced, self.config.orphan_grace_s)
            dropped += done["pending_reclaimed"] + done["committed_reclaimed"]
        return dropped

    def tamper(self, node_id: int, key: bytes, change: Tamper) -> None:
        """From now on node ``node_id`` answers ``change(shard)`` for ``key``'s shard: what
        damage its own checks missed (bit rot between scrubs, a stray old write) looks like to
        its readers. The node itself (``self.nodes``) is left as it is."""
        target = (NODE, node_id)
        served = self.fanout.targets[target]
        if not isinstance(served, _Tampered):
            served = self.fanout.targets[target] = _Tampered(self.nodes[node_id])
        served.changes[bytes(key)] = change


class _Tampered:
    """A storage node whose ``get`` answers changed shards for some keys."""

    def __init__(self, node: StorageNode) -> None:
        self.node = node
        self.changes: dict[bytes, Tamper] = {}

    def __getattr__(self, name: str) -> object:
        return getattr(self.node, name)

    def get(self, keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        shards = split_shards(self.node.get(keys))
        answer = []
        for key, shard in zip(keys, shards, strict=True):
            change = self.changes.get(bytes(key))
            answer.append(shard if change is None or shard is None else change(shard.copy()))
        lengths = np.array([-1 if s is None else s.size for s in answer], dtype=np.int64)
        present = [s for s in answer if s is not None]
        return (np.concatenate(present) if present else np.zeros(0, np.uint8)), lengths


def reads_exact(tier: Tier, keys: list[bytes], payloads: list[np.ndarray]) -> bool:
    """Whether every key reads back bit-exact through the tier's client."""
    got = tier.client.get_blocks(keys)
    return all(
        g is not None and g.tobytes() == p.tobytes() for g, p in zip(got, payloads, strict=True)
    )


def placements_of(tier: Tier, keys: list[bytes]) -> np.ndarray:
    """The committed placements of ``keys`` (all must hit), from a lookup."""
    found = tier.client.lookup(keys)
    assert found.hit_blocks == len(keys) and found.lease is not None
    tier.client.release(found.lease)
    return found.lease.placements
