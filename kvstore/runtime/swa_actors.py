"""Ray shells of the SWA tier (stores and entrypoints) and the function that deploys them.

The logic lives in plain objects (``kvstore.swa.agent.StoreAgent``,
``kvstore.swa.directory.DirectoryShard``); these classes only move messages, run the heartbeat
loop and put a timeout on every remote call.

Placement:
- one store per machine, pinned hard to that machine's Ray node (``num_cpus=0``: a pinned actor
  holding a CPU could wait forever for one, seen with Ray 2.60). Its states die with the machine.
- E entrypoints (default one per machine), spread over the machines with *soft* node affinity
  and unlimited restarts: a killed entrypoint comes back (empty, new incarnation) on its machine
  or, when that machine is gone, on another one; stores then re-register what they hold.

Actor names are ``<config.name>-store-<machine>`` and ``<config.name>-entry-<shard>`` in the
driver's namespace, so a client anywhere in the cluster finds them by name.

Fetches of a state from another Ray node go over the store's direct socket
(``kvstore.fastcall``): one request, one scatter-gather reply straight from the object
store's shared memory, no Ray call. A reader on the store's own node maps the state from shared
memory through Ray instead (no copy at all).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvstore.blockstore.fanout import Ticket, gather, gathered
from kvstore.clock import SystemClock
from kvstore.errors import InvalidArgument, NodeUnavailable, StateRejected, StoreError
from kvstore.fastcall.server import FastCallServer
from kvstore.fastcall.tls import tls_env_options
from kvstore.keys import BlockKey
from kvstore.pending import Pending
from kvstore.runtime.blockstore_actors import find_actor, wait_names_released
from kvstore.runtime.cluster import pin_to_node
from kvstore.runtime.fanout import RayFanout
from kvstore.runtime.forwards import forwards
from kvstore.swa.agent import StoreAgent
from kvstore.swa.calls import DirectoryShardCalls
from kvstore.swa.client import SWAClient
from kvstore.swa.config import SWAConfig
from kvstore.swa.directory import (
    DirectoryShard,
    ShardMap,
    StoreRef,
    shard_ids,
)
from kvstore.swa.store import SWAStore, pool_max_state_bytes
from kvstore.swa.transport import (
    EntrypointCalls,
    LookupCalls,
    StoreCalls,
    SWALayout,
    entry_target,
    layout_for,
    store_target,
)

log = logging.getLogger(__name__)

#: How long deploy waits for freshly created actors to answer (worker start-up, not a request).
_START_TIMEOUT_S = 120.0


def keep_in_object_store(array: np.ndarray) -> Any:
    """How a store actor keeps a state: in its machine's Ray object store (shared memory),
    owned by the store actor, so it disappears with the store or its machine."""
    return ray.put(array)


def _warn_if_object_store_too_small(capacity: int) -> None:
    node = ray.get_runtime_context().get_node_id()
    for info in ray.nodes():
        if info.get("NodeID") == node:
            store_bytes = float(info.get("Resources", {}).get("object_store_memory", 0))
            if store_bytes and capacity > 0.8 * store_bytes:
                log.warning(
                    "SWA pool of %d B is close to or above this node's object store (%d B): "
                    "Ray will spill states to disk",
                    capacity,
                    int(store_bytes),
                )
            return


#: What an entrypoint asks Ray for (see ``deploy_swa``); far below what its directory uses.
_ENTRYPOINT_MEMORY_BYTES = 1 << 20


def store_actor_name(config: SWAConfig, machine_id: str) -> str:
    return f"{config.name}-store-{machine_id}"


def entry_actor_name(config: SWAConfig, shard_id: str) -> str:
    return f"{config.name}-entry-{shard_id}"


@ray.remote
@forwards(DirectoryShardCalls, to=DirectoryShard, held_as="_shard", lock="_lock")
class SWAEntrypointActor:
    """One directory shard. Synchronous: calls run one at a time, in arrival order per caller.
    ``sync`` and ``lookup`` are forwarded to the plain shard (``kvstore.runtime.forwards``)."""

    def __init__(self, shard_id: str, owner_timeout_s: float) -> None:
        self._shard = DirectoryShard(shard_id, owner_timeout_s=owner_timeout_s, clock=SystemClock())
        # Lookups (a hit query's second round) also come over a direct socket, served by
        # another thread: the lock keeps the shard single-threaded. TLS where the operator set
        # it (the data-plane setting deploy_swa handed on).
        self._lock = threading.Lock()
        self._fast = FastCallServer.from_env(
            self._shard,
            ("lookup",),
            self._lock,
            ray.util.get_node_ip_address(),
        )

    def fast_endpoint(self) -> tuple[str, int, bytes]:
        return self._fast.endpoint

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return self._shard.stats().__dict__

    def ping(self) -> str:
        """The shard's incarnation (changes when the actor is replaced)."""
        return self._shard.incarnation

    def node_id(self) -> str:
        """The Ray node this entrypoint runs on (hex)."""
        return str(ray.get_runtime_context().get_node_id())


async def _held(agent: StoreAgent, key: BlockKey) -> Any | None:
    return agent.get(key)


class _SocketFetch:
    """A store's ``fetch`` as its socket thread serves it: the agent is touched on the actor's
    event loop only (its one owner), the bytes are read from the object store in this thread."""

    def __init__(
        self, agent: StoreAgent, loop: asyncio.AbstractEventLoop, node: str, timeout_s: float
    ) -> None:
        self._agent = agent
        self._loop = loop
        self._node = node
        self._timeout = timeout_s

    def fetch(self, key: BlockKey, reader_node: str) -> np.ndarray | bool | None:
        held = asyncio.run_coroutine_threadsafe(_held(self._agent, key), self._loop)
        ref = held.result(self._timeout)
        if ref is None:
            return None
        if reader_node == self._node:
            return True  # map it from shared memory (``get``): no copy at all
        array: np.ndarray = ray.get(ref, timeout=self._timeout)  # a view of shared memory
        return array


@ray.remote
class SWAStoreActor:
    """One machine's SWA store. Async: fetches, puts and the heartbeat loop interleave on one
    event loop, and the plain agent is only touched between awaits (no locks needed)."""

    def __init__(
        self,
        *,
        config: SWAConfig,
        state_bytes: int,
        block_tokens: int,
        machine_id: str,
        shards: Sequence[str],
    ) -> None:
        self._config = config
        capacity = config.resolved_capacity_bytes()
        store = SWAStore(
            max_state_bytes=pool_max_state_bytes(state_bytes, capacity),
            capacity_bytes=capacity,
            ttl_s=config.ttl_s,
            clock=SystemClock(),
            block_tokens=block_tokens,
            keep=keep_in_object_store,
        )
        self._node = ray.get_runtime_context().get_node_id()
        _warn_if_object_store_too_small(capacity)
        ref = StoreRef(machine_id, store_actor_name(config, machine_id))
        self._agent = StoreAgent(store, ref, ShardMap(shards))
        self._handles: dict[str, Any] = {}
        # Ray runs an async actor's __init__ inside its event loop: start the loops now, so a
        # restarted store announces its new incarnation without waiting for a first request.
        # One heartbeat loop per shard: a shard that hangs until the call timeout (its machine
        # died) never delays the heartbeats that keep this store alive in the other shards.
        loop = asyncio.get_running_loop()
        # Fetches from other nodes come over a direct socket (the module doc), in TLS where
        # the operator set it (the data-plane setting deploy_swa handed on). The lock only orders
        # the socket's own calls: the agent is reached through the loop.
        self._fast = FastCallServer.from_env(
            _SocketFetch(self._agent, loop, self._node, config.call_timeout_s),
            ("fetch",),
            threading.Lock(),
            ray.util.get_node_ip_address(),
        )
        self._loops = [loop.create_task(self._expiry_loop())]
        self._loops += [loop.create_task(self._heartbeat_loop(s)) for s in shards]

    async def put(self, key: BlockKey, position: int, blob: np.ndarray, owner: str = "") -> bool:
        """Store ``owner``'s state and register it; True when the directory confirmed the
        registration (False: it stays pending and the next heartbeat retries)."""
        try:
            self._agent.put(key, position, blob, owner=owner)
        except StateRejected:
            raise
        except InvalidArgument as error:
            # Re-raised as a picklable error so the caller sees the real reason.
            detail = str(error).removeprefix(f"{error.argument}: ")
            raise StateRejected(error.argument, detail) from None
        await self._sync(self._agent.dirty_shards())
        return self._agent.is_registered(key)

    async def get(self, key: BlockKey, reader_node: str | None = None) -> Any | None:
        """The state for a reader on Ray node ``reader_node``, or None (miss).

        Same node: ``[ObjectRef]`` (wrapped, so Ray hands the reference over), which the reader
        maps from shared memory without a copy. Another node: the bytes themselves, inline in the
        reply (measured here: ~2x faster than letting the reader pull the object node to node).
        Either way a reader holding the bytes keeps them valid if the store evicts meanwhile.
        """
        ref = self._agent.get(key)
        if ref is None:
            return None
        if reader_node == self._node:
            return [ref]
        return await ref

    async def fetch(self, key: BlockKey, reader_node: str) -> np.ndarray | bool | None:
        """``StoreCalls.fetch`` through Ray (the first fetch, before the caller has this
        store's socket): the bytes inline, None, or True for a reader on this node."""
        ref = self._agent.get(key)
        if ref is None:
            return None
        if reader_node == self._node:
            return True
        array: np.ndarray = await ref
        return array

    async def fast_endpoint(self) -> tuple[str, int, bytes]:
        """Where (and with which key) the direct socket of this incarnation listens."""
        return self._fast.endpoint

    async def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [key in self._agent.store for key in keys]

    async def sync_now(self) -> dict[str, bool]:
        """Expire, then sync with every shard at once (what each heartbeat does); returns which
        shards answered."""
        self._agent.tick()
        return await self._sync(self._agent.shards.ids)

    async def stats(self) -> dict[str, Any]:
        stats = self._agent.store.stats().__dict__
        stats["pending_changes"] = self._agent.pending_count()
        stats["incarnation"] = self._agent.incarnation
        stats["fastcall"] = self._fast.stats()
        return stats

    async def ping(self) -> str:
        return self._agent.incarnation

    async def _heartbeat_loop(self, shard: str) -> None:
        interval = self._config.heartbeat_interval_s
        while True:
            try:
                await self._sync_one(shard)
            except Exception:  # a control loop survives a failing step
                log.exception("SWA store heartbeat to shard %s failed", shard)
            await asyncio.sleep(interval)

    async def _expiry_loop(self) -> None:
        interval = self._config.heartbeat_interval_s
        while True:
            try:
                self._agent.tick()  # expired keys are unregistered by the next heartbeats
            except Exception:
                log.exception("SWA store expiry failed")
            await asyncio.sleep(interval)

    async def _sync(self, shards: Sequence[str]) -> dict[str, bool]:
        results = await asyncio.gather(*(self._sync_one(shard) for shard in shards))
        return dict(zip(shards, results, strict=True))

    async def _sync_one(self, shard: str) -> bool:
        request, ticket = self._agent.outgoing(shard)
        try:
            handle = self._entry(shard)
            reply = await asyncio.wait_for(
                handle.sync.remote(request), timeout=self._config.call_timeout_s
            )
        except (ray.exceptions.RayError, ValueError, TimeoutError) as error:
            # ValueError: the entrypoint's name is not registered (yet / any more).
            self._agent.on_failure(ticket)
            self._handles.pop(shard, None)
            log.debug("sync with shard %s failed: %s", shard, error)
            return False
        self._agent.on_reply(ticket, reply)
        return True

    def _entry(self, shard: str) -> Any:
        handle = self._handles.get(shard)
        if handle is None:
            handle = ray.get_actor(entry_actor_name(self._config, shard))
            self._handles[shard] = handle
        return handle


@dataclass
class SWADeployment(SWALayout):
    """What ``deploy_swa`` created: the tier's layout (enough to build clients anywhere: it
    pickles) plus what it takes to grow or tear the tier down."""

    #: Detached actors outlive the deploying process (an operator's long-running tier).
    detached: bool = False
    #: Handles of the actors this process created: Ray ends a non-detached actor once no handle
    #: to it is left, so the deploying process keeps them. Not pickled: clients find by name.
    handles: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["handles"] = {}
        return state

    def store(self, machine_id: str) -> Any:
        return ray.get_actor(self.store_name(machine_id))

    def entrypoint(self, shard_id: str) -> Any:
        if shard_id not in self.shards:
            raise InvalidArgument("shard_id", f"unknown shard {shard_id!r} (shards {self.shards})")
        return ray.get_actor(entry_actor_name(self.config, shard_id))

    def add_store(self, machine_id: str, node_id: str) -> None:
        """Start the store of a machine that joined (or came back)."""
        handle = _start_store(self, machine_id, node_id)
        ray.get(handle.ping.remote(), timeout=_START_TIMEOUT_S)
        self.stores[machine_id] = store_actor_name(self.config, machine_id)
        self.handles[self.stores[machine_id]] = handle

    def shutdown(self) -> None:
        """Kill every actor of this deployment (missing ones are skipped)."""
        names = list(self.stores.values()) + [entry_actor_name(self.config, s) for s in self.shards]
        for name in names:
            try:
                ray.kill(ray.get_actor(name), no_restart=True)
            except (ValueError, ray.exceptions.RayError):
                continue
        self.handles.clear()
        wait_names_released(names, "SWA tier")

    def layout(self) -> SWALayout:
        """The plain layout (no Ray methods): what an engine's fetcher process needs."""
        return SWALayout(
            self.config,
            self.state_bytes,
            self.block_tokens,
            self.stored_layers,
            self.window,
            self.shards,
            dict(self.stores),
        )

    def client(self, local_machine: str | None = None) -> SWAClient:
        """A client of this tier over Ray (and the entrypoints' direct sockets)."""
        return SWAClient(self, SWARayTransport(self), local_machine=local_machine)


def _start_store(deployment: SWADeployment, machine_id: str, node_id: str) -> Any:
    return SWAStoreActor.options(  # type: ignore[attr-defined]
        name=store_actor_name(deployment.config, machine_id),
        max_restarts=-1,
        max_task_retries=0,
        enable_task_events=False,
        lifetime="detached" if deployment.detached else None,
        **pin_to_node(node_id),
        **tls_env_options(),  # a Ray worker does not inherit this process's environment
    ).remote(
        config=deployment.config,
        state_bytes=deployment.state_bytes,
        block_tokens=deployment.block_tokens,
        machine_id=machine_id,
        shards=deployment.shards,
    )


def deploy_swa(
    machines: Mapping[str, str],
    *,
    config: SWAConfig,
    geometry: Any,
    detached: bool = False,
    entrypoint_nodes: Sequence[str] | None = None,
) -> SWADeployment:
    """Start the SWA tier: a store on every machine and the entrypoint directory.

    ``machines`` maps machine id -> Ray node id (hex); for a ``LocalCluster`` that is
    ``{m: cluster.node_id(m) for m in cluster.machines}``. ``geometry`` is a
    ``kvstore.geometry.GeometryConfig`` (state size, stored layers, window, block size).
    Returns once every actor answers. Non-detached actors live as long as the returned
    deployment (or the deploying process); ``detached=True`` keeps them until ``shutdown``.
    ``entrypoint_nodes``: the Ray nodes the directory's entrypoints prefer (default: the
    machines', in turn).
    """
    if not machines:
        raise InvalidArgument("machines", "the SWA tier needs at least one machine")
    count = config.num_entrypoints or len(machines)
    deployment = SWADeployment(
        **layout_for(config, geometry, shard_ids(count)).__dict__, detached=detached
    )
    node_ids = list(entrypoint_nodes or machines.values())
    for index, shard in enumerate(deployment.shards):
        deployment.handles[entry_actor_name(config, shard)] = SWAEntrypointActor.options(  # type: ignore[attr-defined]
            name=entry_actor_name(config, shard),
            num_cpus=0,
            # A token request: Ray places an actor that asks for no resource at all on a random
            # node whatever its soft affinity says (ray-project/ray#25360 fixed the hard case
            # only). Every node has "memory", so this still fits anywhere after a machine loss.
            memory=_ENTRYPOINT_MEMORY_BYTES,
            max_restarts=-1,
            max_task_retries=0,
            enable_task_events=False,
            lifetime="detached" if detached else None,
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_id=node_ids[index % len(node_ids)], soft=True
            ),
            **tls_env_options(),  # a Ray worker does not inherit this process's environment
        ).remote(shard, config.owner_timeout_s)
    for machine_id, node_id in machines.items():
        name = store_actor_name(config, machine_id)
        deployment.handles[name] = _start_store(deployment, machine_id, node_id)
        deployment.stores[machine_id] = name
    try:
        ray.get(
            [handle.ping.remote() for handle in deployment.handles.values()],
            timeout=_START_TIMEOUT_S,
        )
    except ray.exceptions.RayError as error:
        deployment.shutdown()
        raise StoreError(f"SWA tier did not start: {error}") from error
    return deployment


class SWARayTransport:
    """``kvstore.swa.transport.SWATransport`` over Ray: every call the SWA client makes, each
    bounded by the tier's ``call_timeout_s``; a call that fails or times out answers None (a
    miss), never an exception, except a rejected put (bad input).

    Holds actor handles by name, resolved on first use and forgotten after a failure (a
    replacement actor under the same name is then found again). Pickles without its handles.
    """

    def __init__(self, layout: SWALayout) -> None:
        self._layout = layout
        self._timeout = layout.config.call_timeout_s
        self._handles: dict[str, Any] = {}
        self._node: str | None = None
        config = layout.config
        self._entries = RayFanout(
            {},
            resolve=lambda target: find_actor(entry_actor_name(config, str(target.id))),
            fast_methods=(EntrypointCalls.lookup,),
        )
        self._stores = RayFanout(
            {}, resolve=lambda target: find_actor(str(target.id)), fast_methods=(StoreCalls.fetch,)
        )
        self._near: set[str] = set()  # stores on this Ray node: states mapped, not sent

    def __getstate__(self) -> dict[str, Any]:
        layout = self._layout
        return {"layout": layout.layout() if isinstance(layout, SWADeployment) else layout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["layout"])  # type: ignore[misc]

    def lookup(self, calls: LookupCalls) -> Pending[dict[str, list[StoreRef | None] | None]]:
        """One ``lookup`` per directory shard, all in flight at once under one deadline, over
        the entrypoints' direct sockets when they have them (the block tier's ``RayFanout``
        and ``gathered``: the one RPC seam); a shard that did not answer in time is None."""
        tickets = self._submit_lookups(calls)
        outcomes = gathered(self._entries, tickets, self._timeout)
        return outcomes.then(lambda answered: self._answers(calls, tickets, answered))

    def _submit_lookups(self, calls: LookupCalls) -> dict[Ticket[Any], str]:
        return {
            self._entries.submit(entry_target(shard), EntrypointCalls.lookup, list(keys), prefer): (
                shard
            )
            for shard, (keys, prefer) in calls.items()
        }

    @staticmethod
    def _answers(
        calls: LookupCalls, tickets: dict[Ticket[Any], str], outcomes: dict[Ticket[Any], Any]
    ) -> dict[str, list[StoreRef | None] | None]:
        answers: dict[str, list[StoreRef | None] | None] = dict.fromkeys(calls)
        for ticket, outcome in outcomes.items():
            if isinstance(outcome, NodeUnavailable):
                log.debug("directory lookup failed: %s", outcome)
                continue
            answers[tickets[ticket]] = outcome
        return answers

    def stats(self) -> dict[str, dict[str, Any] | None]:
        refs = {}
        for name in self._layout.stores.values():
            handle = self._handle(name)
            if handle is not None:
                refs[name] = handle.stats.remote()
        out: dict[str, dict[str, Any] | None] = dict.fromkeys(self._layout.stores.values())
        for name, ref in refs.items():
            out[name] = self._get(name, ref, wait=True)
        return out

    def fetch(self, owner: StoreRef, key: BlockKey) -> np.ndarray | None:
        """The state's bytes (read-only), within one timeout; None on any failure. From
        another node over the store's direct socket (the first time through Ray, while its
        endpoint is asked for); from this node's store mapped from shared memory."""
        store_name = owner.store_name
        if store_name not in self._near:
            target = store_target(store_name)
            ticket = self._stores.submit(target, StoreCalls.fetch, key, self._reader_node())
            answer = gather(self._stores, [ticket], self._timeout)[ticket]
            if isinstance(answer, NodeUnavailable):
                log.debug("state from %s not fetched: %s", store_name, answer)
                return None
            if answer is not True:
                if not isinstance(answer, np.ndarray):
                    return None
                answer.flags.writeable = False  # as a mapped state is: the caller's to read
                return answer
            self._near.add(store_name)
        return self._map(store_name, key)

    def _map(self, store_name: str, key: BlockKey) -> np.ndarray | None:
        """A state of a store on this node, mapped from shared memory (no copy)."""
        handle = self._handle(store_name)
        if handle is None:
            return None
        deadline = time.monotonic() + self._timeout
        answer = self._get(store_name, handle.get.remote(key, self._reader_node()), wait=True)
        if isinstance(answer, list) and answer:
            # Same machine: a reference into this node's object store; map it (no copy).
            try:
                answer = ray.get(answer[0], timeout=max(deadline - time.monotonic(), 0.001))
            except ray.exceptions.RayError as error:  # owner or machine gone, timeout
                log.debug("state from %s not readable: %s", store_name, error)
                return None
        return answer if isinstance(answer, np.ndarray) else None

    def put(
        self, store_name: str, key: BlockKey, position: int, blob: np.ndarray, owner: str = ""
    ) -> bool:
        """Store ``owner``'s state: True when stored and registered, False when stored but
        the registration is pending. Raises ``StateRejected`` for a bad state, ``StoreError``
        when the store cannot be reached in time (the state was not stored)."""
        handle = self._handle(store_name)
        if handle is None:
            raise StoreError(f"SWA store {store_name!r} is not running")
        try:
            stored = handle.put.remote(key, position, blob, owner)
            return bool(ray.get(stored, timeout=self._timeout))
        except StateRejected:
            raise
        except ray.exceptions.RayError as error:
            self._handles.pop(store_name, None)
            raise StoreError(f"SWA store {store_name!r} did not take the state: {error}") from None

    def ping(self, name: str) -> float | None:
        """Seconds of one empty round trip to actor ``name``, or None when it failed."""
        handle = self._handle(name)
        if handle is None:
            return None
        start = time.perf_counter()
        if self._get(name, handle.ping.remote(), wait=True) is None:
            return None
        return time.perf_counter() - start

    def _reader_node(self) -> str:
        if self._node is None:
            self._node = ray.get_runtime_context().get_node_id()
        return self._node

    def _handle(self, name: str) -> Any | None:
        handle = self._handles.get(name)
        if handle is None:
            try:
                handle = ray.get_actor(name)
            except (ValueError, ray.exceptions.RayError):
                return None
            self._handles[name] = handle
        return handle

    def _get(self, name: str, ref: Any, wait: bool = False) -> Any | None:
        try:
            return ray.get(ref, timeout=self._timeout if wait else 0)
        except ray.exceptions.RayError as error:
            self._handles.pop(name, None)
            log.debug("call to %s failed: %s", name, error)
            return None


if TYPE_CHECKING:
    _store_socket: type[StoreCalls] = _SocketFetch  # (the async shell's ``fetch`` mirrors it)
