"""The whole tier in this process for unit tests: the block tier's plain nodes and meta shards
over ``LocalFanout`` (``blockstore_tier``), the SWA tier's plain shards and stores over
``LocalSWATransport``, and the one facade (``ClusterTier``) over both, on one manual clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from blockstore_tier import Tier as BlockTier

from kvstore.geometry import GeometryConfig
from kvstore.swa.client import SWAClient
from kvstore.swa.config import SWAConfig
from kvstore.swa.transport import LocalSWATransport, local_swa
from kvstore.tier.cluster import ClusterTier

GEOMETRY = GeometryConfig.default()
MACHINES = ("m0", "m1", "m2")


class LocalControl:
    """``TierControl`` over the in-process meta shards (no repair loop here)."""

    def __init__(self, blocks: BlockTier) -> None:
        self._blocks = blocks

    def meta_stats(self) -> list[dict[str, Any] | None]:
        return [dict(meta.stats()) for meta in self._blocks.metas.values()]

    def repair_stats(self) -> dict[str, Any] | None:
        return None


class InProcessTier:
    def __init__(
        self,
        root: Path,
        *,
        local_machine: str | None = "m0",
        max_open_leases: int = 1000,
        read_key: bytes | None = None,
        read_endpoints: Any = None,
        revoker: Any = None,
        **block_overrides: object,
    ) -> None:
        self.blocks = BlockTier(root, **block_overrides)
        self.clock = self.blocks.clock
        layout, transport = local_swa(
            MACHINES,
            config=SWAConfig(capacity_bytes=8 * GEOMETRY.state_size_to_disk),
            geometry=GEOMETRY,
            clock=self.clock,
        )
        self.transport: LocalSWATransport = transport
        self.swa = SWAClient(layout, transport, local_machine=local_machine)
        self.tier = ClusterTier(
            blocks=self.blocks.client,
            swa=self.swa,
            geometry=GEOMETRY,
            state_size=GEOMETRY.state_size_to_disk,
            block_bytes=GEOMETRY.block_bytes,
            control=LocalControl(self.blocks),
            max_open_leases=max_open_leases,
            clock=self.clock,
            read_key=read_key,
            read_endpoints=read_endpoints,
            revoker=revoker,
        )
