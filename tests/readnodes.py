"""Real storage nodes, each with its real engine read socket on 127.0.0.1, in this process: what
the direct-read tests stand on (no Ray: the socket, the node and its segment files are the
parts under test). Blocks are encoded by the tier's codec and each shard put on its node as a
client's put does, then committed."""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvstore.blockstore.capability import ReadCapability, Revocations, mint
from kvstore.blockstore.config import StorageNodeConfig
from kvstore.blockstore.node import StorageNode
from kvstore.blockstore.readserver import EngineReadServer
from kvstore.blockstore.records import BlockLocation
from kvstore.clock import ManualClock
from kvstore.ec import Codec

K, M = 10, 2
WIDTH = K + M
NOW = 1_700_000_000.0


def block_key(tenant: str, i: int) -> bytes:
    return hashlib.blake2b(f"{tenant}/{i}".encode(), digest_size=32).digest()


@dataclass
class ReadNodes:
    """``count`` storage nodes with their engine read sockets, sharing one read key and one
    clock a test moves."""

    root: Path
    count: int = WIDTH
    key: bytes = field(default_factory=lambda: os.urandom(32))
    clock: ManualClock = field(default_factory=lambda: ManualClock(NOW))
    codec: Codec = field(default_factory=lambda: Codec(K, M))

    def __post_init__(self) -> None:
        config = StorageNodeConfig(fsync="never")
        self.nodes = [StorageNode(i, self.root / f"node-{i}", config) for i in range(self.count)]
        self.locks = [threading.Lock() for _ in range(self.count)]
        self.revocations = [Revocations() for _ in range(self.count)]
        self.servers = [
            EngineReadServer(
                i, self.key, self.nodes[i], self.locks[i], self.revocations[i], clock=self.clock
            )
            for i in range(self.count)
        ]
        self.payloads: dict[bytes, np.ndarray] = {}
        self.locations: dict[bytes, BlockLocation] = {}

    @property
    def endpoints(self) -> dict[int, tuple[str, int]]:
        return {i: server.endpoint for i, server in enumerate(self.servers)}

    def put(self, keys: list[bytes], size: int, seed: int = 0) -> list[BlockLocation]:
        """Store a block of ``size`` random bytes under each key, shard i of block b on node
        (b + i) mod count, committed; their locations. Each node's shards go in one put, data
        shards first, as a client's put sends them (``client._by_node``)."""
        rng = np.random.default_rng(seed)
        per_node: dict[int, list[tuple[bool, bytes, np.ndarray]]] = {}
        out = []
        for b, key in enumerate(keys):
            payload = rng.integers(0, 256, size, dtype=np.uint8)
            shards = self.codec.encode(payload, key)
            placement = tuple((b + seed + i) % self.count for i in range(WIDTH))
            for index, node in enumerate(placement):
                per_node.setdefault(node, []).append((index >= K, key, shards[index]))
            self.payloads[key] = payload
            self.locations[key] = BlockLocation(key, placement, size)  # type: ignore[arg-type]
            out.append(self.locations[key])
        for node, unordered in per_node.items():
            items = [(key, shard) for _, key, shard in sorted(unordered, key=lambda i: i[0])]
            with self.locks[node]:
                stored = self.nodes[node].put(
                    7,
                    [k for k, _ in items],
                    [s for _, s in items],
                    [0] * len(items),
                    [NOW] * len(items),
                )
                assert all(stored)
                assert all(self.nodes[node].commit(7, [k for k, _ in items]))
        return out

    def capability(
        self,
        blocks: list[BlockLocation],
        lease_id: str = "lease-1",
        tenant: str = "alice",
        seconds: float = 30.0,
        key: bytes | None = None,
    ) -> ReadCapability:
        """What the tier mints for a lease on ``blocks``: every shard at its node."""
        shards: dict[int, list[bytes]] = {}
        for block in blocks:
            for node in block.placement:
                shards.setdefault(node, []).append(block.key)
        return mint(key or self.key, lease_id, tenant, self.clock.now() + seconds, shards)

    def close(self) -> None:
        for server in self.servers:
            server.close()
        for node in self.nodes:
            node.close()
