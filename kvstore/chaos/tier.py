"""``ChaosTier``: the whole kvstore tier deployed on a ``LocalCluster`` for failure injection.

One storage node per machine (machine i hosts node i, a failure domain with its own data dir),
with at least 13 machines so a 12-wide stripe always has a spare machine to be repaired onto;
the meta shards and the repair loop, an SWA tier whose stores sit on a few machines, and a ledger
of every block committed through it. Timings are short (health checks every 0.3 s, a node dead
after 2 s of silence) so detection and repair happen within a test's patience.

Machines the tier may crash are the ``owned`` ones (a test session shares its first machines
with other tests) that host no control-plane actor (meta shard, repair loop, SWA entrypoint):
crashing those is a different scenario (``kill_meta``, ``kill_entrypoint``) and must not blur
the one being measured.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.exceptions import RayError

from kvstore.blockstore.config import BlockStoreConfig, StorageNodeConfig
from kvstore.chaos.ledger import Ledger, ReadCheck, payload_for
from kvstore.errors import ConfigError, InvalidArgument, StoreError
from kvstore.geometry import GeometryConfig
from kvstore.keys import BlockKey
from kvstore.runtime.blockstore_actors import find_actor, node_actor_name
from kvstore.runtime.cluster import Machines, alive_node_ids
from kvstore.runtime.deploy import BlockStoreHandles, deploy_blockstore, node_data_dir
from kvstore.runtime.swa_actors import SWADeployment, deploy_swa, store_actor_name
from kvstore.runtime.tiers import cluster_tier
from kvstore.swa.client import SWAClient
from kvstore.swa.config import SWAConfig, deployment_swa_name
from kvstore.tier.cluster import ClusterTier
from kvstore.tier.protocols import TierReader, TierWriter
from kvstore.tier.records import PutAnswer

log = logging.getLogger(__name__)

#: One V4.1-Flash block (docs/rules.md §3): what an engine stores per 128 tokens.
DEFAULT_BLOCK_BYTES = GeometryConfig.default().block_bytes
MIN_MACHINES = 13


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(name, f"must be a positive number, got {value!r}")


@dataclass(frozen=True)
class ChaosConfig:
    """Shape and timings of a chaos deployment."""

    data_root: str
    storage_nodes: int = MIN_MACHINES
    meta_shards: int = 2
    block_bytes: int = DEFAULT_BLOCK_BYTES
    deployment: str = "chaos"
    #: SWA stores on this many crashable machines, and this many directory shards.
    swa_stores: int = 3
    swa_entrypoints: int = 2
    swa_capacity_states: int = 16
    health_interval_s: float = 0.3
    dead_after_s: float = 2.0
    call_timeout_s: float = 4.0
    node_retry_s: float = 1.0
    hedge_after_s: float = 0.05
    #: Short, so a killed writer's reservation stops protecting its orphans soon.
    put_reservation_s: float = 5.0
    swa_heartbeat_s: float = 0.3
    swa_owner_timeout_s: float = 3.0
    swa_call_timeout_s: float = 1.5
    #: Longest wait for a detection or a repair before the scenario reports it as broken.
    detect_timeout_s: float = 30.0
    repair_timeout_s: float = 120.0
    seed: int = 0
    #: Passed to the ``BlockStoreConfig`` when set (None: its default). The repair's caps ...
    repair_bytes_per_s: int | None = None
    repair_stripes_per_round: int | None = None
    repair_round_bytes: int | None = None
    #: ... the fewest live failure domains a put commits on (under-redundant below the width) ...
    min_write_shards: int | None = None
    #: ... and the background scrub's rate per node. Off by default here: the scenarios that
    #: damage shards run a scrub pass of their own and count what it finds, which a background
    #: pass would find first; ``scrub`` turns it on (``ChaosTier.set_repair_rates``).
    scrub_bytes_per_s: int = 0
    #: The storage nodes' segment size: small, so a run's few hundred blocks roll, seal and
    #: compact several segments.
    segment_bytes: int = 256 * 1024
    #: Storage nodes a machine may host: 1 (each machine one failure domain) on a
    #: ``LocalCluster``; more on a testbed's hosts (``kvstore.testbed``), whose nodes share
    #: the host as their failure domain.
    nodes_per_machine: int = 1

    def __post_init__(self) -> None:
        if not self.data_root:
            raise ConfigError("data_root", "must name a directory")
        if isinstance(self.storage_nodes, bool) or not isinstance(self.storage_nodes, int):
            raise ConfigError("storage_nodes", f"must be an integer, got {self.storage_nodes!r}")
        if self.storage_nodes < MIN_MACHINES:
            raise ConfigError(
                "storage_nodes",
                f"must be >= {MIN_MACHINES} (12-wide stripes plus a spare machine), "
                f"got {self.storage_nodes}",
            )
        for name in (
            "meta_shards",
            "block_bytes",
            "swa_stores",
            "swa_entrypoints",
            "segment_bytes",
            "nodes_per_machine",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        for name in (
            "health_interval_s",
            "dead_after_s",
            "call_timeout_s",
            "node_retry_s",
            "hedge_after_s",
            "put_reservation_s",
            "swa_heartbeat_s",
            "swa_owner_timeout_s",
            "swa_call_timeout_s",
            "detect_timeout_s",
            "repair_timeout_s",
        ):
            _positive(name, getattr(self, name))
        for name in (
            "repair_bytes_per_s",
            "repair_stripes_per_round",
            "repair_round_bytes",
            "min_write_shards",
        ):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value <= 0
            ):
                raise ConfigError(name, f"must be a positive integer or None, got {value!r}")
        value = self.scrub_bytes_per_s
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError("scrub_bytes_per_s", f"must be an integer >= 0, got {value!r}")

    def _repair_knobs(self) -> dict[str, Any]:
        knobs = {
            name: getattr(self, name)
            for name in (
                "repair_bytes_per_s",
                "repair_stripes_per_round",
                "repair_round_bytes",
                "min_write_shards",
            )
            if getattr(self, name) is not None
        }
        return {**knobs, "scrub_bytes_per_s": self.scrub_bytes_per_s}

    def blockstore(self) -> BlockStoreConfig:
        return BlockStoreConfig(
            storage_nodes=self.storage_nodes,
            meta_shards=self.meta_shards,
            data_root=self.data_root,
            deployment=self.deployment,
            dead_after_s=self.dead_after_s,
            health_interval_s=self.health_interval_s,
            call_timeout_s=self.call_timeout_s,
            node_retry_s=self.node_retry_s,
            hedge_after_s=self.hedge_after_s,
            put_reservation_s=self.put_reservation_s,
            # fsync off: a killed process loses nothing (page cache), and disks here are slow.
            node=StorageNodeConfig(fsync="never", segment_bytes=self.segment_bytes),
            **self._repair_knobs(),
        )

    def swa(self, geometry: GeometryConfig) -> SWAConfig:
        return SWAConfig(
            name=deployment_swa_name(self.deployment),
            capacity_bytes=self.swa_capacity_states * int(geometry.state_size_to_disk),
            num_entrypoints=self.swa_entrypoints,
            heartbeat_interval_s=self.swa_heartbeat_s,
            owner_timeout_s=self.swa_owner_timeout_s,
            call_timeout_s=self.swa_call_timeout_s,
        )

    def with_changes(self, **changes: Any) -> ChaosConfig:
        return replace(self, **changes)


def wait_until(
    condition: Callable[[], bool], timeout: float, interval: float = 0.1
) -> float | None:
    """Seconds until ``condition()`` held (Ray errors count as not yet), None on timeout."""
    started = time.monotonic()
    while True:
        try:
            if condition():
                return time.monotonic() - started
        except (RayError, StoreError):
            pass
        if time.monotonic() - started >= timeout:
            return None
        time.sleep(interval)


@dataclass
class Redundancy:
    """Stripe health of a set of blocks given the nodes known dead."""

    full: int = 0
    degraded: int = 0
    unreadable: int = 0
    missing: int = 0  # not in any meta shard's index
    degraded_keys: list[BlockKey] = field(default_factory=list)


class ChaosTier:
    """A deployed tier plus what the scenarios need to poke at it and check it."""

    def __init__(
        self,
        cluster: Machines,
        config: ChaosConfig,
        owned: Sequence[str],
        handles: BlockStoreHandles,
        swa: SWADeployment,
        node_machine: dict[int, str],
    ) -> None:
        self.cluster = cluster
        self.config = config
        self.blockstore_config = config.blockstore()
        self.geometry = GeometryConfig.default()
        self.owned = list(owned)
        self.handles = handles
        self.swa = swa
        self.node_machine = dict(node_machine)
        self.ledger = Ledger()
        self.client = handles.client()
        self._facade = cluster_tier(handles, swa, self.geometry)
        self._key_counter = 0
        self._rng = np.random.default_rng(config.seed)

    # --- life cycle --------------------------------------------------------------------------

    @classmethod
    def deploy(
        cls, cluster: Machines, config: ChaosConfig, owned: Sequence[str] | None = None
    ) -> ChaosTier:
        """Deploy on ``cluster``; ``owned``: the machines scenarios may crash (default: all)."""
        machines = cluster.machines
        if len(machines) * config.nodes_per_machine < config.storage_nodes:
            raise InvalidArgument(
                "machines",
                f"the cluster has {len(machines)} machines; {config.storage_nodes} storage nodes "
                f"at {config.nodes_per_machine} a machine need more",
            )
        owned = list(machines if owned is None else owned)
        unknown = sorted(set(owned) - set(machines))
        if unknown:
            raise InvalidArgument("owned", f"machines {unknown} are not in the cluster")
        Path(config.data_root).mkdir(parents=True, exist_ok=True)
        # As deploy_blockstore places them: node i on machine i mod machines.
        node_machine = {i: machines[i % len(machines)] for i in range(config.storage_nodes)}
        handles = deploy_blockstore(config.blockstore(), cluster, start_repair=True)
        swa = None
        try:
            geometry = GeometryConfig.default()
            control = _machines_of(cluster, [*handles.metas, handles.repair])
            candidates = [m for m in reversed(owned) if m not in control]
            if len(candidates) < config.swa_stores:
                candidates = list(reversed(owned))
            swa_machines = candidates[: config.swa_stores]
            swa = deploy_swa(
                {m: cluster.node_id(m) for m in swa_machines},
                config=config.swa(geometry),
                geometry=geometry,
                entrypoint_nodes=cluster.control_node_ids() or None,
            )
            tier = cls(cluster, config, owned, handles, swa, node_machine)
            tier.wait_healthy()
        except BaseException:
            if swa is not None:
                swa.shutdown()
            handles.shutdown()
            raise
        return tier

    def shutdown(self) -> None:
        try:
            self.swa.shutdown()
        finally:
            self.handles.shutdown()

    # --- where things run ----------------------------------------------------------------------

    def machine_of_node(self, node_id: int) -> str:
        return self.node_machine[node_id]

    def node_on(self, machine: str) -> int | None:
        nodes = self.nodes_on(machine)
        return nodes[0] if nodes else None

    def nodes_on(self, machine: str) -> list[int]:
        return [node for node, where in sorted(self.node_machine.items()) if where == machine]

    def control_machines(self) -> set[str]:
        """Machines hosting a meta shard, the repair loop or an SWA entrypoint right now."""
        actors = [*self.handles.metas, self.handles.repair]
        for shard in self.swa.shards:
            try:
                actors.append(self.swa.entrypoint(shard))
            except (ValueError, RayError):
                continue
        return _machines_of(self.cluster, actors)

    def swa_machines(self) -> list[str]:
        return list(self.swa.stores)

    def crashable_nodes(self, allow_swa: bool = False) -> list[int]:
        """Storage nodes whose whole machine a scenario may crash (owned, no control plane)."""
        control = self.control_machines()
        swa = set() if allow_swa else set(self.swa.stores)
        up = set(self.cluster.machines)
        return [
            node
            for node, machine in sorted(self.node_machine.items())
            if machine in self.owned and machine in up and machine not in control | swa
        ]

    def data_dir(self, node_id: int) -> Path:
        return Path(node_data_dir(self.blockstore_config, node_id))

    # --- data --------------------------------------------------------------------------------

    def new_keys(self, count: int) -> list[BlockKey]:
        return [BlockKey(self._rng.bytes(32)) for _ in range(count)]

    def put(
        self,
        keys: Sequence[bytes],
        traffic_class: str = "default",
        writer: TierWriter | None = None,
        size: int | None = None,
    ) -> PutAnswer:
        """Put ``payload_for(key, size)`` under each key through the tier seam (``writer``, by
        default this tier's own facade; ``size``, by default the config's block size);
        committed ones enter the ledger."""
        size = self.config.block_bytes if size is None else size
        payloads = [payload_for(key, size).tobytes() for key in keys]
        answer = (writer or self._facade).put_blocks(list(keys), payloads, traffic_class)
        self.ledger.add(answer.committed_keys(keys), size, traffic_class)
        return answer

    def put_fresh(self, count: int, traffic_class: str = "default") -> list[BlockKey]:
        """Commit ``count`` new blocks (in batches); raises if the healthy tier refuses any."""
        keys = self.new_keys(count)
        for start in range(0, count, 32):
            chunk = keys[start : start + 32]
            answer = self.put(chunk, traffic_class)
            if answer.stored != len(chunk):
                raise StoreError(
                    f"healthy tier committed {answer.stored} of {len(chunk)} blocks "
                    f"(failed {len(answer.failed_keys)}, busy {len(answer.busy_keys)})"
                )
        return keys

    def read(
        self, keys: Sequence[bytes] | None = None, reader: TierReader | None = None
    ) -> ReadCheck:
        """Read ``keys`` (default: the whole ledger) in batches through the tier seam
        (``reader``, by default this tier's own facade) and classify every read."""
        keys = self.ledger.keys() if keys is None else list(keys)
        reader = reader or self._facade
        ok = misses = wrong = 0
        missed: list[BlockKey] = []
        wrong_keys: list[BlockKey] = []
        for start in range(0, len(keys), 64):
            chunk = keys[start : start + 64]
            reads = [read.payload for read in reader.get_blocks(chunk)]
            check = self.ledger.check(chunk, reads)
            ok += check.ok
            misses += check.misses
            wrong += check.wrong
            missed.extend(check.missed_keys)
            wrong_keys.extend(check.wrong_keys)
        return ReadCheck(ok, misses, wrong, tuple(missed), tuple(wrong_keys))

    # --- inspection --------------------------------------------------------------------------

    def placements(self) -> dict[BlockKey, tuple[int, ...]]:
        """Every indexed block's shard placement (-1 = shard lost), from the meta shards."""
        tables = ray.get(
            [m.snapshot_table.remote() for m in self.handles.metas],
            timeout=self.config.call_timeout_s * 5,
        )
        out: dict[BlockKey, tuple[int, ...]] = {}
        for table in tables:
            for key, placement in zip(
                table.column("key").to_pylist(),
                table.column("placement").to_pylist(),
                strict=True,
            ):
                out[BlockKey(bytes(key))] = tuple(int(n) for n in placement)
        return out

    def placed_on(self, node: int, keys: Iterable[bytes] | None = None) -> list[BlockKey]:
        """Committed blocks (default: the ledger's) with a shard placed on ``node``."""
        return self.placed_on_any([node], keys)

    def placed_on_any(
        self, nodes: Iterable[int], keys: Iterable[bytes] | None = None
    ) -> list[BlockKey]:
        """Committed blocks (default: the ledger's) with a shard placed on one of ``nodes``."""
        placements = self.placements()
        wanted = self.ledger.keys() if keys is None else [BlockKey(bytes(k)) for k in keys]
        on = set(nodes)
        return [key for key in wanted if on & set(placements.get(key, ()))]

    def host_spread(self) -> int:
        """The most shards any ledger block has placed on one machine (its nodes together)."""
        placements = self.placements()
        most = 0
        for key in self.ledger.keys():
            machines = [self.node_machine[n] for n in placements.get(key, ()) if n >= 0]
            if machines:
                most = max(most, max(machines.count(m) for m in set(machines)))
        return most

    def repair_stats(self) -> dict[str, Any]:
        return dict(ray.get(self._repair().stats.remote(), timeout=self.config.call_timeout_s))

    def _repair(self) -> Any:
        if self.handles.repair is None:
            raise StoreError("this chaos tier runs without a repair loop")
        return self.handles.repair

    def dead_nodes(self) -> set[int]:
        """Nodes the cluster knows are dead: declared by the repair loop and published to every
        meta shard (from then on readers skip them and their shards stop counting)."""
        stats = ray.get(
            [m.stats.remote() for m in self.handles.metas], timeout=self.config.call_timeout_s
        )
        return {int(n) for s in stats for n in s.get("down_nodes", ())}

    def fresh_reader(self) -> ClusterTier:
        """A reader that has seen nothing yet (no node it skips, current actor handles)."""
        return self.facade()

    def metas_ready(self) -> bool:
        return all(
            ray.get(
                [m.ready.remote() for m in self.handles.metas], timeout=self.config.call_timeout_s
            )
        )

    def nodes_answering(self) -> set[int]:
        refs = {i: h.ping.remote() for i, h in self.handles.nodes.items()}
        ready, _ = ray.wait(
            list(refs.values()), num_returns=len(refs), timeout=self.config.call_timeout_s
        )
        done = set(ready)
        answering = set()
        for node, ref in refs.items():
            if ref in done:
                try:
                    ray.get(ref, timeout=0)
                    answering.add(node)
                except RayError:
                    continue
        return answering

    def redundancy(self, keys: Iterable[bytes] | None = None) -> Redundancy:
        """Stripe health from the index and the repair loop's dead set."""
        placements = self.placements()
        dead = self.dead_nodes()
        wanted = self.ledger.keys() if keys is None else [BlockKey(bytes(k)) for k in keys]
        width = self.blockstore_config.stripe_width
        k = self.blockstore_config.data_shards
        report = Redundancy()
        for key in wanted:
            placement = placements.get(key)
            if placement is None:
                report.missing += 1
                continue
            healthy = {n for n in placement if n >= 0 and n not in dead}
            if len(healthy) == width and len(set(placement)) == width:
                report.full += 1
            elif len(healthy) >= k:
                report.degraded += 1
                report.degraded_keys.append(key)
            else:
                report.unreadable += 1
        return report

    def shard_census(self, keys: Sequence[bytes] | None = None) -> dict[str, int]:
        """Where shard files really are, against the index: ``missing`` (placement says a node
        holds one, it does not), ``stray`` (a node holds one the placement does not name)."""
        placements = self.placements()
        wanted = list(placements) if keys is None else [BlockKey(bytes(k)) for k in keys]
        holds = ray.get(
            [h.holds.remote(wanted) for h in self.handles.nodes.values()],
            timeout=self.config.call_timeout_s * 5,
        )
        node_ids = list(self.handles.nodes)
        missing = stray = 0
        for position, key in enumerate(wanted):
            placement = set(placements.get(key, ()))
            for node, held in zip(node_ids, holds, strict=True):
                if held[position] and node not in placement:
                    stray += 1
                elif not held[position] and node in placement:
                    missing += 1
        return {"blocks": len(wanted), "missing": missing, "stray": stray}

    def usage_by_node(self) -> dict[int, dict[str, int]]:
        """Each live node's ``usage()`` (shards, pending, bytes_used, live_bytes, ...)."""
        nodes = sorted(self.handles.nodes)
        usage = ray.get(
            [self.handles.nodes[n].usage.remote() for n in nodes],
            timeout=self.config.call_timeout_s * 5,
        )
        return {
            n: {k: int(v) for k, v in u.items() if isinstance(v, int)}
            for n, u in zip(nodes, usage, strict=True)
        }

    def node_usage(self) -> dict[str, int]:
        usage = ray.get(
            [h.usage.remote() for h in self.handles.nodes.values()],
            timeout=self.config.call_timeout_s * 5,
        )
        return {
            "shards": sum(int(u["shards"]) for u in usage),
            "pending": sum(int(u["pending"]) for u in usage),
            "bytes_used": sum(int(u["bytes_used"]) for u in usage),
            "live_bytes": sum(int(u["live_bytes"]) for u in usage),
        }

    # --- control -----------------------------------------------------------------------------

    def repair_barrier(self) -> None:
        """Run one repair cycle and wait for it: it waits for the loop's lock, so a step that
        was under way (reading shards while a node now dead still served) has finished."""
        ray.get(self._repair().tick.remote(), timeout=self.config.call_timeout_s * 10)

    def pause_repair(self, paused: bool) -> None:
        ray.get(self._repair().pause.remote(paused), timeout=self.config.call_timeout_s)

    def drain(self, node_id: int, draining: bool = True) -> dict[str, Any]:
        """Start (or end, ``draining=False``) draining storage node ``node_id``: it takes no new
        writes and the repair moves its shards elsewhere."""
        reply = ray.get(
            self._repair().drain.remote(int(node_id), draining),
            timeout=self.config.call_timeout_s * 5,
        )
        return dict(reply or {})

    def set_repair_rates(
        self, repair_bytes_per_s: int | None = None, scrub_bytes_per_s: int | None = None
    ) -> dict[str, Any]:
        """Change the repair's and the scrub's rates at run time (None: unchanged)."""
        reply = ray.get(
            self._repair().set_rates.remote(
                repair_bytes_per_s=repair_bytes_per_s, scrub_bytes_per_s=scrub_bytes_per_s
            ),
            timeout=self.config.call_timeout_s * 5,
        )
        return dict(reply or {})

    def swa_client(self, local_machine: str | None = None) -> SWAClient:
        return self.swa.client(local_machine=local_machine)

    def facade(self, local_machine: str | None = None) -> ClusterTier:
        """The tier seam over this deployment, as the gateway and the engines use it (a fresh
        block client: one per thread)."""
        return cluster_tier(self.handles, self.swa, self.geometry, local_machine=local_machine)

    def restart_node(self, node_id: int) -> None:
        """(Re)create storage node ``node_id`` on its data dir, wherever it was pinned."""
        existing = find_actor(node_actor_name(self.blockstore_config.deployment, node_id))
        if existing is not None:
            try:
                ray.kill(existing, no_restart=True)
            except RayError:
                pass
            wait_until(
                lambda: (
                    find_actor(node_actor_name(self.blockstore_config.deployment, node_id)) is None
                ),
                30,
                0.05,
            )
        self.handles.start_node(node_id)

    def restore_machine(self, machine: str) -> None:
        """Bring a crashed machine back under its id; its storage node restarts on its dir."""
        if machine not in self.cluster.machines:
            self.cluster.add_machine(machine)
        for node in self.nodes_on(machine):
            if self._wait_answering(node) is None:  # Ray gave up restarting it: start anew
                self.restart_node(node)
        if machine in self.swa.stores:
            self._restart_store(machine)

    def _wait_answering(self, node: int) -> float | None:
        handle = self.handles.nodes[node]
        return wait_until(
            lambda: ray.get(handle.ping.remote(), timeout=2) == node,
            self.config.repair_timeout_s,
            0.2,
        )

    def _restart_store(self, machine: str) -> None:
        name = store_actor_name(self.swa.config, machine)
        old = find_actor(name)
        if old is not None:
            try:  # pinned to the Ray node that died: it can never come back by itself
                ray.kill(old, no_restart=True)
            except RayError:
                pass
            wait_until(lambda: find_actor(name) is None, 30, 0.05)
        self.swa.add_store(machine, self.cluster.node_id(machine))

    def _replace_dead_machines(self) -> None:
        """Machines Ray declared dead although nobody crashed them (a raylet starved past its
        health checks on a loaded host) are taken out of the cluster, to be started again."""
        alive = set(alive_node_ids())
        for machine in list(self.cluster.machines):
            try:
                node_id = self.cluster.node_id(machine)
            except InvalidArgument:  # a testbed host whose Ray node the GCS declared dead
                node_id = ""
            if machine in self.node_machine.values() and node_id not in alive:
                log.warning("machine %s died on its own; starting it again", machine)
                try:
                    self.cluster.remove_machine(machine, graceful=False)
                except Exception as error:  # its processes are gone already
                    log.warning("removing dead machine %s: %s", machine, error)

    def wait_healthy(self, timeout: float | None = None) -> float:
        """Until every machine is up, every node answers, the metas are ready, the repair loop
        sees no dead node and every SWA store answers; returns the seconds waited."""
        timeout = self.config.repair_timeout_s if timeout is None else timeout
        started = time.monotonic()
        self._replace_dead_machines()
        for machine in set(self.node_machine.values()) - set(self.cluster.machines):
            self.restore_machine(machine)
        down = set(self.handles.nodes) - self.nodes_answering()
        for node in sorted(down):
            self.restart_node(node)
        self.pause_repair(False)
        waited = wait_until(
            lambda: (
                self.metas_ready()
                and not self.dead_nodes()
                and self.nodes_answering() == set(self.handles.nodes)
            ),
            timeout,
            0.2,
        )
        if waited is None:
            raise StoreError(f"the chaos tier did not become healthy within {timeout} s")
        for machine in self.swa.stores:
            try:
                ray.get(self.swa.store(machine).ping.remote(), timeout=5)
            except (RayError, ValueError):
                self._restart_store(machine)
        # The driver's client may still skip nodes it saw fail; forget that.
        self.client = self.handles.client()
        self._facade = cluster_tier(self.handles, self.swa, self.geometry)
        return time.monotonic() - started


def _machines_of(cluster: Machines, actors: Iterable[Any]) -> set[str]:
    """Machine ids of the Ray nodes the ``actors`` run on (the head or unknown: skipped)."""
    by_node = {}
    for machine in cluster.machines:
        try:
            by_node[cluster.node_id(machine)] = machine
        except InvalidArgument:
            continue
    refs = []
    for actor in actors:
        if actor is None:
            continue
        refs.append(actor.__ray_call__.remote(_node_of_self))
    found: set[str] = set()
    for ref in refs:
        try:
            node = ray.get(ref, timeout=10)
        except RayError:
            continue
        if node in by_node:
            found.add(by_node[node])
    return found


def _node_of_self(_self: Any) -> str:
    return str(ray.get_runtime_context().get_node_id())


def process_id(actor: Any, timeout: float = 10.0) -> int:
    """OS pid of an actor's worker process."""
    return int(ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=timeout))
