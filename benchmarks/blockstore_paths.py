"""The two read paths an engine has, for ``benchmarks/blockstore.py``: straight from the storage
nodes with its lease's read capability (``DirectPath``), or GetBlocks through the gateway
(``GatewayPath``, a real gRPC gateway in its own process).

Each path is used per timed batch as ``prepare()`` (untimed: what an engine has done before its
load starts, e.g. the QueryHit that leased the blocks), ``read()`` (timed: the load), and, on
the first warm-up, ``check(payloads)`` (bit-exact, untimed).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import ray

from kvstore.blockstore.capability import mint_for_lease
from kvstore.blockstore.config import BlockStoreConfig
from kvstore.blockstore.direct import DirectReader
from kvstore.blockstore.readblocks import ReadBlocks
from kvstore.keys import BLOCK_TOKENS

#: The benchmark gateway's bearer token (loopback only, a process of this run).
TOKEN = "blockstore-bench-token-0123456789"


class DirectPath:
    """An engine's load with a read capability: one lookup (its lease, untimed, as the plain
    get row's lookup is), a capability minted for it before each batch, as the tier hands one
    out with each QueryHit (untimed: the tier's work; a new one each time, so the read pays
    what a load pays for its first use, e.g. each node's part of it encoded), then
    ``DirectReader.read_into`` the lease's arrays (``ReadBlocks``, as an engine's grant holds
    them) into one reused buffer per batch."""

    def __init__(
        self, client: Any, keys: list[bytes], reader: DirectReader, read_key: bytes
    ) -> None:
        self._client = client
        found = client.lookup(keys)
        if found.lease is None or found.hit_blocks != len(keys):
            raise RuntimeError(f"direct: lookup found {found.hit_blocks} of {len(keys)} blocks")
        self._lease = found.lease
        self._read_key = read_key
        self._capability = mint_for_lease(read_key, found.lease, "bench")
        lease = found.lease
        self._blocks = ReadBlocks(lease.key_words, lease.placements, lease.sizes)
        self._reader = reader
        self.buffer = np.empty(int(lease.sizes.sum()), np.uint8)

    def prepare(self) -> None:
        self._capability = mint_for_lease(self._read_key, self._lease, "bench")

    def read(self) -> None:
        ok = self._reader.read_into(self._capability, self._blocks, self.buffer)
        if not all(ok):
            raise RuntimeError(f"direct: {ok.count(False)} of {len(ok)} blocks missed")

    def check(self, payloads: list[np.ndarray]) -> None:
        if not np.array_equal(self.buffer, np.concatenate(payloads)):
            raise RuntimeError("direct: wrong bytes")

    def close(self) -> None:
        self._client.release(self._lease)


@ray.remote
class _GatewayActor:
    """The gateway of a deployment, in a process of its own as ``kvstore up`` runs it: the
    tier facade over the deployed actors (found by name), served over gRPC on loopback."""

    def __init__(self, config: BlockStoreConfig) -> None:
        from kvstore.api.gateway import Gateway
        from kvstore.api.server import ServerOptions
        from kvstore.geometry import GeometryConfig
        from kvstore.runtime.deploy import BlockStoreHandles
        from kvstore.runtime.tiers import cluster_tier

        tier = cluster_tier(BlockStoreHandles.from_names(config), None, GeometryConfig.default())
        self._gateway = Gateway(tier, ServerOptions(token=TOKEN))

    def address(self) -> tuple[str, int]:
        return self._gateway.address, os.getpid()


class Gateway:
    """A gateway actor of this run and a gRPC client of it (this process: a client with no
    storage node). Blocks it reads must have been put through it (its tenant's namespace)."""

    def __init__(self, config: BlockStoreConfig) -> None:
        from kvstore.api.client import KVStoreClient
        from kvstore.runtime.blockstore_actors import actor_options

        # Ray would import this module by name in the worker, where ``benchmarks`` is not on
        # the path: ship the class by value instead.
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        options = actor_options(f"{config.deployment}-bench-gateway")
        options.pop("max_restarts")
        self.actor = _GatewayActor.options(**options).remote(config)  # type: ignore[attr-defined]
        address, self.pid = ray.get(self.actor.address.remote(), timeout=120)
        self.client = KVStoreClient(address, token=TOKEN, timeout_s=60)

    def path(self, keys: list[bytes], payloads: list[np.ndarray]) -> GatewayPath:
        put = self.client.put_blocks(keys, [p.tobytes() for p in payloads])
        if put.stored + put.existing != len(keys):
            raise RuntimeError(f"gateway: {put.stored} of {len(keys)} blocks stored")
        return GatewayPath(self.client, keys)

    def close(self) -> None:
        self.client.close()
        ray.kill(self.actor)


class GatewayPath:
    """An engine's load without node access: QueryHit for the lease (untimed, as the plain get
    row's lookup), then GetBlocks with it (timed: the gateway reads the shards from the nodes,
    decodes and streams each block back over gRPC)."""

    def __init__(self, client: Any, keys: list[bytes]) -> None:
        self._client = client
        self._keys = keys
        self._lease_id: str | None = None
        self.blocks: list[Any] = []

    def prepare(self) -> None:
        from kvstore.hitplan import FULL_ATTENTION
        from kvstore.tier.records import HitRequest

        n = len(self._keys)
        answer = self._client.query_hit(
            HitRequest(block_keys=self._keys, prompt_len=n * BLOCK_TOKENS + 50, mode=FULL_ATTENTION)
        )
        if len(answer.hit_block_keys) != n or answer.lease_id is None:
            raise RuntimeError(f"gateway: QueryHit hit {len(answer.hit_block_keys)} of {n}")
        self._lease_id = answer.lease_id

    def read(self) -> None:
        self.blocks = self._client.get_blocks(self._keys, self._lease_id)
        self._lease_id = None  # a GetBlocks ends its lease
        missed = sum(block.payload is None for block in self.blocks)
        if missed:
            raise RuntimeError(f"gateway: {missed} of {len(self.blocks)} blocks missed")

    def check(self, payloads: list[np.ndarray]) -> None:
        for block, payload in zip(self.blocks, payloads, strict=True):
            if block.payload != payload.tobytes():
                raise RuntimeError("gateway: wrong bytes")

    def close(self) -> None:
        if self._lease_id is not None:
            self._client.release_lease(self._lease_id)
