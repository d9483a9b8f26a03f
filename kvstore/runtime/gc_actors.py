"""Ray shell of the GC worker, and the driver-side view ``kvstore gc`` uses.

``GCWorkerActor`` forwards to ``kvstore.gc.worker.GCWorker`` (all the logic) and runs its
``ReconcileLoop`` in a background thread: a pass that fails is logged and the next one runs a
scan interval later. It reaches the meta shards and storage nodes by their actor names
(``kvstore.runtime.blockstore_actors``), so restarted or added actors are found again.

Actor name: ``<deployment>-gc``. One worker per deployment is enough: a pass is a handful of
batched calls per meta shard and node, and the meta shards do the per-block work vectorised.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import ray
from ray.exceptions import RayError

from kvstore.blockstore.calls import meta_target, node_target
from kvstore.blockstore.capacity import tier_usage
from kvstore.blockstore.config import BlockStoreConfig
from kvstore.blockstore.fanout import Target
from kvstore.blockstore.indexsnapshot import index_from_table
from kvstore.clock import SystemClock
from kvstore.errors import InvalidArgument, StoreError
from kvstore.gc.config import GCConfig
from kvstore.gc.planner import GCPlan, plan_index
from kvstore.gc.worker import GCWorker, PassReport, ReconcileLoop, Tally
from kvstore.runtime.blockstore_actors import actor_options, find_actor, name_resolver
from kvstore.runtime.cluster import control_plane_options
from kvstore.runtime.fanout import RayFanout

log = logging.getLogger(__name__)


def gc_actor_name(deployment: str) -> str:
    return f"{deployment}-gc"


@ray.remote
class GCWorkerActor:
    def __init__(
        self,
        gc_config: GCConfig,
        config: BlockStoreConfig,
        node_ids: list[int] | None = None,
        run: bool = True,
    ) -> None:
        fanout = RayFanout({}, resolve=name_resolver(config.deployment))
        self._worker = GCWorker(
            gc_config,
            fanout,
            meta_shards=range(config.meta_shards),
            nodes=node_ids if node_ids is not None else range(config.storage_nodes),
            class_names=config.traffic_classes,
            clock=SystemClock(),
            data_shards=config.data_shards,
            parity_shards=config.parity_shards,
            call_timeout_s=config.call_timeout_s,
        )
        self._last: dict[str, object] | None = None
        # What every pass of this worker removed since it started (``status()["removed"]``):
        # the last pass alone says nothing of a run that spans many passes.
        self._removed = {"expired": Tally(), "evicted": Tally()}
        self._removed_lock = threading.Lock()
        self._paused = not run
        self._loop = ReconcileLoop(self._scheduled_pass, gc_config.scan_interval_s)
        self._thread = threading.Thread(target=self._loop.run, name="gc-loop", daemon=True)
        self._thread.start()

    def _scheduled_pass(self) -> None:
        if self._paused:
            return
        self._last = self._count(self._worker.run_once())

    def _count(self, report: PassReport) -> dict[str, object]:
        with self._removed_lock:
            for total, tally in (
                (self._removed["expired"], report.expired),
                (self._removed["evicted"], report.evicted),
            ):
                for name, blocks in tally.blocks.items():
                    total.blocks[name] += blocks
                    total.bytes[name] += tally.bytes[name]
        return report.as_dict()

    def ping(self) -> bool:
        return True

    def run_once(self) -> dict[str, object]:
        """One pass now (at the wall clock)."""
        self._last = self._count(self._worker.run_once())
        return self._last

    def tick(self, now: float) -> dict[str, object]:
        """One pass as if the time were ``now`` (tests move time by days this way)."""
        self._last = self._count(self._worker.tick(now))
        return self._last

    def pause(self, paused: bool = True) -> None:
        self._paused = paused

    def set_nodes(self, node_ids: list[int]) -> None:
        self._worker.set_nodes(node_ids)

    def status(self) -> dict[str, object]:
        with self._removed_lock:
            removed = {reason: tally.as_dict() for reason, tally in self._removed.items()}
        return {
            "passes": self._loop.passes,
            "failures": self._loop.failures,
            "last_error": self._loop.last_error,
            "paused": self._paused,
            "last_pass": self._last,
            # Blocks and block bytes removed by every pass so far, per class.
            "removed": removed,
        }

    def stop(self) -> None:
        self._loop.stop()


def deploy_gc(
    gc_config: GCConfig,
    config: BlockStoreConfig,
    node_ids: list[int] | None = None,
    run: bool = True,
) -> Any:
    """Start the GC worker of ``config.deployment`` (Ray connected); returns its handle.

    ``run=False`` starts it paused: passes run only when asked (``run_once``/``tick``)."""
    if not ray.is_initialized():
        raise StoreError("Ray is not connected: call kvstore.runtime.cluster.connect() first")
    options = actor_options(gc_actor_name(config.deployment), **control_plane_options())
    handle = GCWorkerActor.options(**options).remote(  # type: ignore[attr-defined]
        gc_config, config, node_ids, run
    )
    ray.get(handle.ping.remote(), timeout=120)
    return handle


# --- driver side: what `kvstore gc` talks to ------------------------------------------------


class LiveTier:
    """A running block tier found by actor names (meta shards and nodes discovered)."""

    def __init__(self, deployment: str) -> None:
        names = ray.util.list_named_actors()
        meta_ids = _ids(names, rf"{re.escape(deployment)}-meta-(\d+)")
        node_ids = _ids(names, rf"{re.escape(deployment)}-node-(\d+)")
        if not meta_ids or not node_ids:
            raise StoreError(f"no block tier {deployment!r} in this cluster")
        resolve = name_resolver(deployment)
        self.deployment = deployment
        self.meta_ids = meta_ids
        self.node_ids = node_ids
        handles: dict[Target[Any], Any] = {
            meta_target(i): resolve(meta_target(i)) for i in meta_ids
        }
        handles.update({node_target(i): resolve(node_target(i)) for i in node_ids})
        self.fanout = RayFanout(handles, resolve=resolve)
        first = handles[meta_target(meta_ids[0])]
        try:
            by_class = ray.get(first.stored_bytes_by_class.remote(), timeout=30)
        except RayError as error:
            raise StoreError(f"meta shard {meta_ids[0]} did not answer: {error}") from None
        #: Traffic class names in class-id order (the meta shard keeps them in that order).
        self.class_names = tuple(by_class)
        self._nominal = BlockStoreConfig()

    def worker(self, gc_config: GCConfig) -> GCWorker:
        return GCWorker(
            gc_config,
            self.fanout,
            self.meta_ids,
            self.node_ids,
            self.class_names,
            SystemClock(),
            self._nominal.data_shards,
            self._nominal.parity_shards,
        )

    def snapshot(self) -> pa.Table:
        """Every meta shard's index as one table (``index_to_table`` format)."""
        handles = [self.fanout.handle(meta_target(i)) for i in self.meta_ids]
        tables = ray.get([h.snapshot_table.remote() for h in handles], timeout=300)
        metadata = tables[0].schema.metadata
        merged = pa.concat_tables([t.replace_schema_metadata(None) for t in tables])
        return merged.replace_schema_metadata(metadata)

    def usage(self) -> tuple[int, int]:
        """(disk bytes held, capacity) of every node, a shared filesystem's free space counted
        once (``capacity.tier_usage``)."""
        handles = [self.fanout.handle(node_target(i)) for i in self.node_ids]
        return tier_usage(ray.get([h.usage.remote() for h in handles], timeout=60))

    def plan(self, gc_config: GCConfig, snapshot: pa.Table | None = None) -> GCPlan:
        """What a pass would do now, without doing it.

        Node usage counts shard files (parity and headers included); the plan works in block
        bytes, so usage and capacity are scaled by the measured node bytes per block byte."""
        table = snapshot if snapshot is not None else self.snapshot()
        index = index_from_table(table)
        used, capacity = self.usage()
        nominal = (self._nominal.data_shards + self._nominal.parity_shards) / (
            self._nominal.data_shards
        )
        indexed = index.total_bytes()
        ratio = max(nominal, used / indexed) if indexed else nominal
        return plan_index(
            index,
            SystemClock().now(),
            gc_config,
            self.class_names,
            capacity_bytes=int(np.floor(capacity / ratio)),
            used_bytes=int(np.ceil(used / ratio)),
        )

    def run_pass(self, gc_config: GCConfig) -> PassReport:
        return self.worker(gc_config).run_once()

    def close(self) -> None:
        """Nothing to release: the driver's Ray connection ends with the process."""


def _ids(names: list[Any], pattern: str) -> list[int]:
    found = set()
    for entry in names:
        name = entry["name"] if isinstance(entry, dict) else str(entry)
        match = re.fullmatch(pattern, name)
        if match:
            found.add(int(match.group(1)))
    return sorted(found)


def attach(address: str, deployment: str) -> LiveTier:
    """Join the Ray cluster at ``address`` ("auto": the local one) and find the block tier."""
    from kvstore.runtime.cluster import connect

    if not ray.is_initialized():
        check_reachable(address)
        connect(address)
    return LiveTier(deployment)


def check_address(address: str) -> tuple[str, int] | None:
    """``--address`` as (host, port), None for "auto"; ``InvalidArgument`` when it is neither."""
    if address == "auto":
        return None
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidArgument("--address", f"expected HOST:PORT or auto, got {address!r}")
    return host, int(port)


def check_reachable(address: str) -> None:
    """Fail fast on an address nothing listens on: ``ray.init`` would retry for minutes."""
    parsed = check_address(address)
    if parsed is None:
        return
    host, port = parsed
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as error:
        raise StoreError(f"no kvstore cluster at {address} ({error.strerror or error})") from None


def gc_worker_handle(deployment: str) -> Any:
    """The running GC worker of ``deployment``, or None."""
    return find_actor(gc_actor_name(deployment))


def format_report(report: PassReport) -> str:
    names = sorted(set(report.expired.blocks) | set(report.evicted.blocks))
    lines = [
        f"{'class':<10} {'expired':>8} {'exp bytes':>14} {'evicted':>8} {'ev bytes':>14}",
    ]
    for name in names:
        lines.append(
            f"{name:<10} {report.expired.blocks.get(name, 0):>8} "
            f"{report.expired.bytes.get(name, 0):>14} {report.evicted.blocks.get(name, 0):>8} "
            f"{report.evicted.bytes.get(name, 0):>14}"
        )
    lines.append(
        f"{'total':<10} {report.expired.total_blocks:>8} {report.expired.total_bytes:>14} "
        f"{report.evicted.total_blocks:>8} {report.evicted.total_bytes:>14}"
    )
    lines.append(
        f"node bytes {report.used_bytes_before} -> {report.used_bytes_after} of "
        f"{report.capacity_bytes}; shard files deleted {report.shards_deleted}"
    )
    lines.extend(f"error: {error}" for error in report.errors)
    return "\n".join(lines)
