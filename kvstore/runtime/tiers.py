"""The tier facade wired to a Ray deployment: its control-plane figures and its engine factory.

``cluster_tier`` builds the one ``kvstore.tier.cluster.ClusterTier`` over a deployed block tier
and SWA tier (the gateway's, an engine's); ``RayTierControl`` answers the figures only actors
have; ``ClusterReaderFactory`` is the picklable recipe an engine's fetcher process runs to reach
the same tier from its own process.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import ray

from kvstore.blockstore.config import BlockStoreConfig
from kvstore.geometry import GeometryConfig
from kvstore.runtime.deploy import BlockStoreHandles
from kvstore.runtime.swa_actors import SWARayTransport
from kvstore.swa.client import SWAClient
from kvstore.swa.transport import SWALayout
from kvstore.tier.cluster import ClusterTier
from kvstore.tier.revoke import Revoker

log = logging.getLogger(__name__)

#: Figures must answer even when part of the cluster is down: each source gets this long.
_STATS_TIMEOUT_S = 5.0


class RayTierControl:
    """``kvstore.tier.cluster.TierControl`` over the deployment's meta-shard and repair actors."""

    def __init__(self, metas: list[Any], repair: Any | None) -> None:
        self._metas = list(metas)
        self._repair = repair

    def meta_stats(self) -> list[dict[str, Any] | None]:
        return _gather([handle.stats.remote() for handle in self._metas])

    def repair_stats(self) -> dict[str, Any] | None:
        if self._repair is None:
            return None
        return _gather([self._repair.stats.remote()])[0]


def _gather(refs: list[Any]) -> list[Any]:
    """Results of ``refs``; None for each one that failed or did not answer in time."""
    out: list[Any] = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=_STATS_TIMEOUT_S))
        except Exception as error:  # one silent part must not take the figures down
            log.info("stats source unavailable: %s", error)
            out.append(None)
    return out


def cluster_tier(
    blocks: BlockStoreHandles,
    swa: SWALayout | None,
    geometry: GeometryConfig,
    *,
    local_machine: str | None = None,
    foreign_leases: bool = False,
    block_bytes: int | None = None,
    machine_addresses: dict[str, str] | None = None,
    grants_reads: bool = False,
) -> ClusterTier:
    """The tier facade over a deployment (this process connected to its Ray cluster);
    ``foreign_leases``: see ``ClusterTier``; ``block_bytes``: the payload size it accepts
    (default: the preset's). ``grants_reads``: this tier holds the cluster read key and
    answers a lease asked for ``direct``ly with its read capability (the gateway's tier only:
    an engine's own tier, ``ClusterReaderFactory``, must never hold the key)."""
    direct: dict[str, Any] = {}
    if grants_reads:
        direct = {
            "read_key": blocks.read_key(),
            "read_endpoints": ReadEndpoints(blocks),
            "revoker": Revoker(blocks.revoke),
        }
    swa_client = None
    if swa is not None:
        swa_client = SWAClient(swa, SWARayTransport(swa), local_machine=local_machine)
    return ClusterTier(
        blocks=blocks.client(),
        swa=swa_client,
        geometry=geometry,
        state_size=geometry.state_size_to_disk,
        block_bytes=geometry.block_bytes if block_bytes is None else block_bytes,
        control=RayTierControl(blocks.metas, blocks.repair),
        foreign_leases=foreign_leases,
        machine_addresses=machine_addresses,
        **direct,
    )


class ReadEndpoints:
    """The storage nodes' engine read sockets, as the tier hands them to engines: asked of the
    nodes once, then again every ``refresh_s`` from a daemon thread (a restarted node listens
    on a new port; a QueryHit must not wait for twelve Ray calls). Callable: the current map."""

    def __init__(self, blocks: BlockStoreHandles, refresh_s: float = 2.0) -> None:
        self._blocks = blocks
        self._refresh_s = refresh_s
        self._current: dict[int, tuple[str, int]] = blocks.read_endpoints(timeout=_STATS_TIMEOUT_S)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="read-endpoints", daemon=True)
        self._thread.start()

    def __call__(self) -> dict[int, tuple[str, int]]:
        return self._current

    def close(self) -> None:
        self._stopped.set()

    def _loop(self) -> None:
        while not self._stopped.wait(self._refresh_s):
            try:
                found = self._blocks.read_endpoints(timeout=_STATS_TIMEOUT_S)
            except Exception:  # a control loop survives a failing step
                log.warning("refreshing the nodes' read endpoints failed", exc_info=True)
                continue
            if found != self._current:
                log.info("storage nodes' read endpoints now %s", found)
            self._current = found


@dataclass(frozen=True)
class ClusterReaderFactory:
    """Builds a ``ClusterTier`` inside the engine's fetcher process (picklable: plain config):
    join the Ray cluster at ``ray_address``, find the deployed block tier by its actor names,
    reach the SWA tier of ``swa`` (None: states are misses). The leases of the loads it reads
    were taken by the engine's scheduler-side tier, which releases them: it reads with their
    ids unknown (``foreign_leases``)."""

    ray_address: str
    blockstore: BlockStoreConfig
    geometry: GeometryConfig
    swa: SWALayout | None = None
    local_machine: str | None = None
    namespace: str = "kvstore"

    def __call__(self) -> ClusterTier:
        from kvstore.runtime.cluster import connect

        connect(self.ray_address, namespace=self.namespace)
        return cluster_tier(
            BlockStoreHandles.from_names(self.blockstore),
            self.swa,
            self.geometry,
            local_machine=self.local_machine,
            foreign_leases=True,
        )
