"""Ray shells of the Block KVCache tier: storage nodes, meta shards, the repair loop.

Each shell forwards to the plain object holding the logic (``kvstore.blockstore``), with
forwarders generated from the Protocols of ``kvstore.blockstore.calls``
(``kvstore.runtime.forwards``); what is written here is only what needs Ray: finding peers by
actor name, background threads (a meta shard's rebuild, the repair loop), timeouts on calls to
peers, and the few calls that do more than forward.

Ray is the control plane; shard bytes do not go through it. Every storage node and meta shard
also serves the calls of the write and read paths (``FAST_NODE_METHODS``,
``FAST_META_METHODS``) over its own direct socket (``kvstore.fastcall``): a thread of
the actor's process runs them on the plain object under the same lock as the Ray methods, so
the two planes never run in it at once. ``stats()`` counts the calls each plane served.

Actor names (namespace of the driver, ``kvstore`` by default): ``<deployment>-node-<i>``,
``<deployment>-meta-<i>``, ``<deployment>-repair``. Nodes and meta shards restart without limit
(``max_restarts=-1``) with their constructor arguments: a restarted node re-opens its data
directory, a restarted meta shard rebuilds its index from the nodes' manifests.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import RayError

from kvstore.blockstore.calls import MetaShardCalls, StorageNodeCalls
from kvstore.blockstore.capability import READ_KEY_BYTES, Revocations
from kvstore.blockstore.config import BlockStoreConfig, StorageNodeConfig
from kvstore.blockstore.fanout import META, NODE, Target
from kvstore.blockstore.meta import MetaShard
from kvstore.blockstore.node import StorageNode
from kvstore.blockstore.placement import meta_shard_of
from kvstore.blockstore.readserver import EngineReadServer
from kvstore.blockstore.repair import HealthTracker, Repairer
from kvstore.blockstore.repairloop import RepairLoop
from kvstore.blockstore.revokedfile import RevokedFile
from kvstore.errors import StoreError
from kvstore.fastcall.server import FastCallServer
from kvstore.fastcall.tls import tls_env_options
from kvstore.keys import BlockKey
from kvstore.runtime.fanout import RayFanout
from kvstore.runtime.forwards import forwards
from kvstore.wire import MAX_FRAME_BYTES

log = logging.getLogger(__name__)

#: Storage node methods served over the node's direct socket: all that move or acknowledge
#: shard bytes (the data plane). Manifests, scrubs, usage and pings stay on Ray.
NODE_FAST_NAMES = ("put", "commit", "abort", "get", "holds", "delete")
#: Meta shard methods served over its direct socket: lookups (the hit path) and the calls every
#: put makes (reserve, commit, abort) and every read ends with (release).
META_FAST_NAMES = ("lookup_wire", "begin_put", "commit", "abort_put", "release")
#: The largest frame a node takes or sends: a client batch is at most 64 blocks, one shard
#: each per node (64 x 140 KiB = 9 MB for 1.35 MiB blocks at k=10), an SWA-sized 16 x 1.4 MB is
#: 23 MB; a call beyond it goes through Ray (``RayFanout``).
NODE_FRAME_BYTES = MAX_FRAME_BYTES
#: Request bytes a node holds at once (four of the largest frames).
NODE_INFLIGHT_BYTES = 4 * NODE_FRAME_BYTES
#: How often a node's background compaction runs a step (each moves at most its rate times
#: this, so the node's lock is held ~tens of ms at a time).
COMPACTION_STEP_S = 0.1


def _calls(protocol: type, names: Sequence[str]) -> tuple[Callable[..., Any], ...]:
    """The methods of ``protocol`` called ``names``: what a fanout sends over the sockets
    (every name the sockets serve is a Protocol method: ``forwards`` counts it)."""
    return tuple(getattr(protocol, name) for name in names)


#: The calls clients make over the direct sockets instead of through Ray.
FAST_NODE_METHODS = _calls(StorageNodeCalls, NODE_FAST_NAMES)
FAST_META_METHODS = _calls(MetaShardCalls, META_FAST_NAMES)
FAST_METHODS = FAST_NODE_METHODS + FAST_META_METHODS


def node_actor_name(deployment: str, node_id: int) -> str:
    return f"{deployment}-node-{node_id}"


def meta_actor_name(deployment: str, shard_id: int) -> str:
    return f"{deployment}-meta-{shard_id}"


def repair_actor_name(deployment: str) -> str:
    return f"{deployment}-repair"


def find_actor(name: str) -> Any:
    """The live actor called ``name`` in this job's namespace, or None."""
    try:
        return ray.get_actor(name)
    except ValueError:
        return None


def wait_names_released(names: Sequence[str], what: str, timeout_s: float = 30.0) -> None:
    """After ``ray.kill``: wait until no actor answers to ``names`` (Ray releases a killed
    actor's name asynchronously, so a redeploy right after would find it taken); warns and
    returns when ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while any(find_actor(name) is not None for name in names):
        if time.monotonic() > deadline:
            log.warning("%s actors still registered after shutdown", what)
            return
        time.sleep(0.05)


def name_resolver(deployment: str) -> Any:
    def resolve(target: Target[Any]) -> Any:
        kind, ident = target
        if kind == NODE:
            return find_actor(node_actor_name(deployment, int(ident)))
        if kind == META:
            return find_actor(meta_actor_name(deployment, int(ident)))
        return None

    return resolve


@ray.remote
@forwards(
    StorageNodeCalls,
    to=StorageNode,
    held_as="_node",
    lock="_lock",
    counted=NODE_FAST_NAMES,
    counter="_ray_calls",
)
class StorageNodeActor:
    """A storage node; its data calls come over its direct socket too (see the module doc).
    Every method holds ``_lock``: the plain node is single-threaded, and a node that cannot
    take its lock (a wedged disk) answers no ``ping`` or ``status`` either. The calls of
    ``StorageNodeCalls`` are forwarded to the plain node (``kvstore.runtime.forwards``)."""

    def __init__(
        self,
        node_id: int,
        data_dir: str,
        node_config: StorageNodeConfig,
        deployment: str,
        meta_shards: int,
        call_timeout_s: float,
        read_key: bytes | None = None,
    ) -> None:
        """``read_key``: the cluster read key capabilities are minted under (deploy makes it;
        None: a key of its own, which no tier holds, so its engine read socket serves
        nothing)."""
        self._node = StorageNode(node_id, data_dir, node_config)
        self._incarnation = os.urandom(8).hex()
        self._deployment = deployment
        self._meta_shards = meta_shards
        self._timeout = call_timeout_s
        self._lock = threading.Lock()
        self._ray_calls: Counter[str] = Counter()  # data calls that came through Ray instead
        # TLS where the operator set it, plaintext beyond loopback only where they said
        # insecure (the data-plane setting deploy handed on: actor_options).
        self._fast = FastCallServer.from_env(
            self._served(),
            NODE_FAST_NAMES,
            self._lock,
            ray.util.get_node_ip_address(),
            frame_limit=NODE_FRAME_BYTES,
            max_inflight_bytes=NODE_INFLIGHT_BYTES,
        )
        # Engines read their leases' shards here with a read capability, never the key above
        # (``kvstore.blockstore.readserver``); same data-plane setting, a port of its own.
        self._read_key = read_key if read_key is not None else os.urandom(READ_KEY_BYTES)
        # The released leases this node was told of survive its restart (``revokedfile``).
        now = time.time()
        self._revoked = Revocations()
        self._revoked_file = RevokedFile(self._node.root, now)
        for lease_ids, until in self._revoked_file.batches:
            self._revoked.revoke(lease_ids, until, now)
        self._reads = EngineReadServer.from_env(
            node_id,
            self._read_key,
            self._served(),
            self._lock,
            self._revoked,
            ray.util.get_node_ip_address(),
        )

        self._compaction = threading.Thread(
            target=self._compact_loop, name="compaction", daemon=True
        )
        self._compaction.start()

    def _served(self) -> Any:
        """What the direct socket calls (the plain node; a test double may put a wrapper in
        front of it, e.g. the chaos runs' slow node)."""
        return self._node

    def _compact_loop(self) -> None:
        """Compaction in the background, at most ``compact_bytes_per_s``, in small steps so a
        step holds the node's lock only briefly (foreground calls wait for it)."""
        rate = self._node.config.compact_bytes_per_s
        step_s = COMPACTION_STEP_S
        while True:
            time.sleep(step_s)
            try:
                with self._lock:
                    self._node.compact(max(1, int(rate * step_s)))
            except Exception:  # a full disk, a segment gone: logged, tried again next step
                log.exception("node %d: compaction step failed", self._node.node_id)
                time.sleep(1.0)

    def fast_endpoint(self) -> tuple[str, int, bytes]:
        """Where (and with which key) the direct socket of this incarnation listens."""
        return self._fast.endpoint

    def read_endpoint(self) -> tuple[str, int]:
        """Where this incarnation's engine read socket listens (no key: engines present a
        read capability)."""
        return self._reads.endpoint

    def read_key(self) -> bytes:
        """The cluster read key, for the in-cluster process that mints capabilities (the
        tier), through Ray as the fastcall keys are; never handed on to an engine."""
        return self._read_key

    def revoke(self, lease_ids: Sequence[str], until: float) -> int:
        """Stop honouring the capabilities of ``lease_ids`` (released leases) until
        ``until``; returns the ids remembered. The tier calls it when a lease is released."""
        ids, end, now = [str(i) for i in lease_ids], float(until), time.time()
        remembered = self._revoked.revoke(ids, end, now)
        if end > now:
            try:
                self._revoked_file.append(ids, end, now)
            except OSError:  # refused here all the same; a restart would forget them
                log.exception(
                    "node %d: keeping %d revocations on disk failed", self._node.node_id, len(ids)
                )
        return remembered

    def incarnation(self) -> str:
        """Differs after every (re)start of the actor."""
        return self._incarnation

    def stats(self) -> dict[str, object]:
        """The node's figures, and the data calls each plane served (``fastcall``: the
        socket's, with its in-flight budget; ``ray_calls``: those that came through Ray;
        ``engine_reads``: the engine read socket's)."""
        with self._lock:
            return {
                **self._node.stats(),
                "fastcall": self._fast.stats(),
                "ray_calls": dict(self._ray_calls),
                "engine_reads": {**self._reads.stats(), "revoked": len(self._revoked)},
            }

    def reclaim_orphans(self, grace_s: float) -> dict[str, int]:
        """Delete pending shards older than ``grace_s`` and committed ones no meta shard maps to
        this node. A meta shard that does not answer makes the whole pass keep everything."""
        node_id = self._node.node_id

        def referenced(keys: list[BlockKey]) -> list[bool]:
            owners = meta_shard_of(keys, self._meta_shards)
            groups: dict[int, list[int]] = defaultdict(list)
            for position, owner in enumerate(owners):
                groups[int(owner)].append(position)
            answer = [True] * len(keys)
            for owner, positions in groups.items():
                meta = find_actor(meta_actor_name(self._deployment, owner))
                if meta is None:
                    raise StoreError(f"meta shard {owner} not found; keeping every shard")
                try:
                    reply = ray.get(
                        meta.referenced.remote([keys[p] for p in positions], node_id),
                        timeout=self._timeout,
                    )
                except RayError as error:
                    raise StoreError(f"meta shard {owner} did not answer: {error}") from None
                for position, used in zip(positions, reply, strict=True):
                    answer[position] = bool(used)
            return answer

        try:
            # The lock stays held while the meta shards answer (bounded by the call timeout):
            # the node's pass is not written for other calls between its batches.
            with self._lock:
                return self._node.reclaim_orphans(referenced, grace_s)
        except StoreError as error:
            log.warning("node %d: orphan reclaim skipped: %s", node_id, error)
            return {"pending_reclaimed": 0, "committed_reclaimed": 0, "skipped": 1}


@ray.remote
@forwards(
    MetaShardCalls,
    to=MetaShard,
    held_as="_meta",
    lock="_lock",
    counted=META_FAST_NAMES,
    counter="_ray_calls",
)
class MetaShardActor:
    """A meta shard; lookups and the write calls come over its direct socket too. The calls
    of ``MetaShardCalls`` are forwarded to the plain shard under ``_lock``, all but
    ``lookup_wire`` (``kvstore.runtime.forwards``)."""

    def __init__(self, shard_id: int, config: BlockStoreConfig, node_ids: Sequence[int]) -> None:
        self._meta = MetaShard(shard_id, config, rebuilding=True)
        self._incarnation = os.urandom(8).hex()
        self._config = config
        self._node_ids = list(node_ids)
        self._lock = threading.Lock()
        self._rebuild_report: dict[str, object] = {}
        # Lookups and the write calls also come over a direct socket (the module doc), in TLS
        # where the operator set it (the data-plane setting deploy handed on: actor_options).
        self._ray_calls: Counter[str] = Counter()  # fast-plane calls that came through Ray
        self._fast = FastCallServer.from_env(
            self._meta,
            META_FAST_NAMES,
            self._lock,
            ray.util.get_node_ip_address(),
        )
        self._start_rebuild()

    def fast_endpoint(self) -> tuple[str, int, bytes]:
        """Where (and with which key) the direct socket of this incarnation listens."""
        return self._fast.endpoint

    def _start_rebuild(self) -> None:
        with self._lock:
            self._meta.begin_rebuild()
        threading.Thread(target=self._rebuild, name="meta-rebuild", daemon=True).start()

    def _rebuild(self) -> None:
        """Read every node's manifest (slice of this shard) and install the index."""
        started = time.monotonic()
        config = self._config
        shard = self._meta.shard_id
        refs = {}
        for node_id in self._node_ids:
            handle = find_actor(node_actor_name(config.deployment, node_id))
            if handle is not None:
                refs[node_id] = handle.manifest.remote(shard, config.meta_shards)
        absorbed, failed = 0, []
        deadline = time.monotonic() + 3 * config.call_timeout_s
        for node_id, ref in refs.items():
            try:
                table = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except RayError as error:
                failed.append(node_id)
                log.warning("meta %d: manifest of node %d unavailable: %s", shard, node_id, error)
                continue
            with self._lock:
                absorbed += self._meta.absorb_manifest(node_id, table)
        with self._lock:
            restored = self._meta.finish_rebuild()
        missing = sorted(set(self._node_ids) - set(refs))
        self._rebuild_report = {
            "restored_blocks": restored,
            "shards_seen": absorbed,
            "nodes_failed": failed + missing,
            "seconds": time.monotonic() - started,
        }

    def ready(self) -> bool:
        with self._lock:
            return not self._meta.rebuilding

    def incarnation(self) -> str:
        """Differs after every (re)start of the actor."""
        return self._incarnation

    def rebuild(self) -> None:
        """Start a fresh rebuild (operator action; lookups are misses until it ends)."""
        self._start_rebuild()

    def lookup_wire(self, request: tuple[Any, ...]) -> tuple[Any, ...]:
        with self._lock:
            self._ray_calls["lookup_wire"] += 1
            try:
                return self._meta.lookup_wire(request)
            finally:
                self._meta.after_reply()  # through Ray there is no "after the reply"

    def stats(self) -> dict[str, object]:
        """The shard's figures, its last rebuild, and the fast-plane calls each plane served
        (as a storage node's ``stats``)."""
        with self._lock:
            return {
                **self._meta.stats(),
                "last_rebuild": dict(self._rebuild_report),
                "fastcall": self._fast.stats(),
                "ray_calls": dict(self._ray_calls),
            }


@ray.remote
class RepairActor:
    """Health checks, repair rounds, drains and scrub (``kvstore.blockstore.repairloop``) in a
    background thread: rounds back to back, paced to the byte cap, while there is a backlog;
    one every ``health_interval_s`` otherwise."""

    def __init__(self, config: BlockStoreConfig, node_ids: Sequence[int], run: bool = True):
        # Repair moves shard bytes too: over the sockets, as a client's reads and writes do.
        def fanout() -> RayFanout:
            return RayFanout(
                {}, resolve=name_resolver(config.deployment), fast_methods=FAST_METHODS
            )

        # Health checks on a fanout (and a thread) of their own: a check waits up to
        # call_timeout_s on a node that just died, rounds go on meanwhile.
        self._checker = Repairer(config, fanout(), node_ids)
        self._loop = RepairLoop(
            Repairer(config, fanout(), node_ids),
            HealthTracker(config.dead_after_s),
            checker=self._checker,
        )
        self._interval = config.health_interval_s
        self._lock = threading.Lock()
        self._snapshot: dict[str, object] = self._loop.stats()
        self._running = run
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._health_lock = threading.Lock()  # one health check at a time
        self._thread = threading.Thread(target=self._run, name="repair-loop", daemon=True)
        self._thread.start()
        self._health = threading.Thread(target=self._check, name="health", daemon=True)
        self._health.start()

    def _check(self) -> None:
        while not self._stop.wait(self._interval):
            if not self._running:
                continue
            try:
                with self._health_lock:
                    self._loop.check_health()
            except Exception:  # checks go on: the next one may find the cluster answering
                log.exception("health check failed")
            self._wake.set()  # a death found: repair at once

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._running:
                with self._lock:
                    self._loop.tick(check_health=False)
                    backlog = self._loop.backlog()
                    pause = self._loop.pace_s() if backlog else self._interval
                    self._snapshot = self._loop.stats()
            else:
                pause = self._interval
            if pause > 0:
                self._wake.wait(pause)
                self._wake.clear()

    def tick(self) -> dict[str, float]:
        """Run one cycle now, health checks included (tests and operators)."""
        with self._health_lock:
            self._loop.check_health()
        with self._lock:
            step = self._loop.tick(check_health=False)
            self._snapshot = self._loop.stats()
            return step

    def pause(self, paused: bool = True) -> None:
        self._running = not paused
        self._wake.set()

    def declare_dead(self, node_id: int) -> None:
        with self._lock:
            self._loop.health.declare_dead(int(node_id))
        self._wake.set()

    def set_nodes(self, node_ids: Sequence[int]) -> None:
        with self._health_lock, self._lock:
            self._loop.repairer.set_nodes(node_ids)
            self._checker.set_nodes(node_ids)

    def drain(self, node_id: int, draining: bool = True) -> dict[str, Any]:
        """Start (or stop) draining a storage node: it takes no new shards, and every shard it
        holds is moved to another node (each stripe keeps its shards throughout)."""
        with self._lock:
            status = self._loop.drain(int(node_id), bool(draining))
            self._snapshot = self._loop.stats()
        self._wake.set()
        return status

    def set_rates(
        self, repair_bytes_per_s: int | None = None, scrub_bytes_per_s: int | None = None
    ) -> dict[str, int]:
        with self._lock:
            return self._loop.set_rates(repair_bytes_per_s, scrub_bytes_per_s)

    def stats(self) -> dict[str, object]:
        """The figures as of the last tick (never waits for a round in progress)."""
        return self._snapshot


def actor_options(name: str, **extra: Any) -> dict[str, Any]:
    """Options every block tier actor shares (task events off: +37% calls/s with Ray 2.60;
    no CPU held), and the fastcall TLS setting of the deploying process (a Ray worker does not
    inherit its environment)."""
    options: dict[str, Any] = {
        "name": name,
        "num_cpus": 0,
        "enable_task_events": False,
        "max_restarts": -1,
        "max_task_retries": 0,
        **tls_env_options(),
    }
    options.update(extra)
    return options


__all__ = [
    "FAST_METHODS",
    "MetaShardActor",
    "RepairActor",
    "StorageNodeActor",
    "actor_options",
    "find_actor",
    "meta_actor_name",
    "name_resolver",
    "node_actor_name",
    "repair_actor_name",
]
