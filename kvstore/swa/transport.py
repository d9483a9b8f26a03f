"""How the SWA client reaches the directory shards and the stores, as one small protocol.

``SWAClient`` (``kvstore.swa.client``) holds the logic: which shard owns a key, checking what
comes back, feeding the fetch-or-replay estimates. A transport only moves calls, the way the block
client's ``Fanout`` does: ``LocalSWATransport`` (here) drives plain in-process objects for unit
tests and single-process tools; the Ray one lives in ``kvstore.runtime.swa_actors``. Every call
of a transport answers within its timeout; an unreachable shard or store is None (a miss), never
an exception — except a rejected put, which is bad input (``StateRejected``), and a put that could
not be delivered (``StoreError``), which the caller must know about.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvstore.blockstore.fanout import ENTRY, Target
from kvstore.clock import Clock, SystemClock
from kvstore.errors import InvalidArgument, StateRejected, StoreError
from kvstore.keys import BlockKey
from kvstore.pending import Pending
from kvstore.swa.agent import StoreAgent
from kvstore.swa.config import SWAConfig
from kvstore.swa.directory import DirectoryShard, ShardMap, StoreRef, shard_ids
from kvstore.swa.store import SWAStore, pool_max_state_bytes

#: shard id -> (keys, preferred machine) of one lookup round.
LookupCalls = Mapping[str, tuple[Sequence[BlockKey], str | None]]


class EntrypointCalls(Protocol):
    """What a directory shard answers through a ``Fanout`` (``kvstore.blockstore.fanout``)."""

    def lookup(
        self, keys: Sequence[BlockKey], prefer_machine: str | None = None
    ) -> list[StoreRef | None]: ...


def entry_target(shard_id: str) -> Target[EntrypointCalls]:
    return Target(ENTRY, shard_id)


#: SWA stores, as fanout targets; their ids are store (actor) names.
STORE = "swa-store"


class StoreCalls(Protocol):
    """What an SWA store answers through a ``Fanout``."""

    def fetch(self, key: BlockKey, reader_node: str) -> np.ndarray | bool | None:
        """The state's bytes for a reader on Ray node ``reader_node``; None: a miss; True: the
        reader is on the store's own node, where it maps the state from shared memory instead
        (it asks again for a reference)."""
        ...


def store_target(store_name: str) -> Target[StoreCalls]:
    return Target(STORE, store_name)


if TYPE_CHECKING:  # the plain shard answers every call (its Ray shell is checked there)
    _shard: type[EntrypointCalls] = DirectoryShard


@dataclass
class SWALayout:
    """The shape of one SWA tier: what a client needs to know to use it, and nothing that only
    works inside one process (so it pickles into an engine's fetcher process)."""

    config: SWAConfig
    state_bytes: int
    block_tokens: int
    stored_layers: int
    window: int
    shards: tuple[str, ...]
    #: machine id -> name of that machine's store
    stores: dict[str, str] = field(default_factory=dict)

    def store_name(self, machine_id: str) -> str:
        name = self.stores.get(machine_id)
        if name is None:
            raise InvalidArgument(
                "machine_id", f"no SWA store on {machine_id!r} (stores on {sorted(self.stores)})"
            )
        return name


def layout_for(config: SWAConfig, geometry: Any, shards: Sequence[str]) -> SWALayout:
    """The layout of a tier for ``geometry`` (a ``GeometryConfig``), without stores yet."""
    return SWALayout(
        config=config,
        state_bytes=int(geometry.state_size_to_disk),
        block_tokens=int(geometry.block_tokens),
        stored_layers=len(geometry.stored_swa_layers),
        window=int(geometry.window),
        shards=tuple(shards),
    )


class SWATransport(Protocol):
    def lookup(self, calls: LookupCalls) -> Pending[dict[str, list[StoreRef | None] | None]]:
        """One directory lookup per shard, all in flight at once under one deadline; a shard
        that did not answer in time maps to None. Waited for from a thread or a loop."""
        ...

    def fetch(self, owner: StoreRef, key: BlockKey) -> np.ndarray | None:
        """The state's bytes from its owner's store (read-only), or None."""
        ...

    def put(
        self, store_name: str, key: BlockKey, position: int, blob: np.ndarray, owner: str = ""
    ) -> bool:
        """Store ``owner``'s state (its share of the store, ``SWAStore.put``): True once the
        directory registered it, False when stored with the registration still pending.
        Raises ``StateRejected`` / ``StoreError`` (see above)."""
        ...

    def ping(self, store_name: str) -> float | None:
        """Seconds of one empty round trip to the store, or None."""
        ...

    def stats(self) -> dict[str, dict[str, Any] | None]:
        """Every store's figures (``SWAStore.stats`` and more) by store name; None: no answer."""
        ...


class LocalSWATransport:
    """The tier's shards and stores as plain objects in this process. ``down`` holds the shard
    ids and store names that do not answer (a lost entrypoint or machine). The Ray stores sync
    with the directory from a heartbeat loop; here ``heartbeat()`` does one round of it."""

    def __init__(
        self, shards: Mapping[str, DirectoryShard], agents: Mapping[str, StoreAgent]
    ) -> None:
        self.shards = dict(shards)
        self.agents = dict(agents)  # by store name
        self.down: set[str] = set()

    def lookup(self, calls: LookupCalls) -> Pending[dict[str, list[StoreRef | None] | None]]:
        return Pending.of(lambda: self._lookup(calls))  # in-process: nothing to wait for

    def _lookup(self, calls: LookupCalls) -> dict[str, list[StoreRef | None] | None]:
        answers: dict[str, list[StoreRef | None] | None] = {}
        for shard_id, (keys, prefer) in calls.items():
            shard = None if shard_id in self.down else self.shards.get(shard_id)
            answers[shard_id] = None if shard is None else shard.lookup(keys, prefer)
        return answers

    def fetch(self, owner: StoreRef, key: BlockKey) -> np.ndarray | None:
        agent = self._agent(owner.store_name)
        if agent is None:
            return None
        blob = agent.get(key)
        return None if blob is None else np.asarray(blob)

    def put(
        self, store_name: str, key: BlockKey, position: int, blob: np.ndarray, owner: str = ""
    ) -> bool:
        agent = self._agent(store_name)
        if agent is None:
            raise StoreError(f"SWA store {store_name!r} is not running")
        try:
            agent.put(key, position, blob, owner=owner)
        except StateRejected:
            raise
        except InvalidArgument as error:  # as the Ray store re-raises it: a rejected state
            detail = str(error).removeprefix(f"{error.argument}: ")
            raise StateRejected(error.argument, detail) from None
        self._sync(agent, agent.dirty_shards())
        return agent.is_registered(key)

    def ping(self, store_name: str) -> float | None:
        started = time.perf_counter()
        return None if self._agent(store_name) is None else time.perf_counter() - started

    def stats(self) -> dict[str, dict[str, Any] | None]:
        out: dict[str, dict[str, Any] | None] = {}
        for name, agent in self.agents.items():
            out[name] = None if name in self.down else dict(agent.store.stats().__dict__)
        return out

    def heartbeat(self) -> None:
        """What every live store's heartbeat loops do: expire, then sync with every shard."""
        for name, agent in self.agents.items():
            if name not in self.down:
                agent.tick()
                self._sync(agent, agent.shards.ids)

    def _agent(self, store_name: str) -> StoreAgent | None:
        return None if store_name in self.down else self.agents.get(store_name)

    def _sync(self, agent: StoreAgent, shards: Sequence[str]) -> None:
        for shard_id in shards:
            request, ticket = agent.outgoing(shard_id)
            shard = self.shards.get(shard_id)
            if shard is None or shard_id in self.down:
                agent.on_failure(ticket)
            else:
                agent.on_reply(ticket, shard.sync(request))


def local_swa(
    machines: Sequence[str],
    *,
    config: SWAConfig,
    geometry: Any,
    clock: Clock | None = None,
) -> tuple[SWALayout, LocalSWATransport]:
    """A whole SWA tier in this process: a store per machine, ``config.num_entrypoints`` (or one
    per machine) directory shards, states kept as plain arrays."""
    if not machines:
        raise InvalidArgument("machines", "the SWA tier needs at least one machine")
    clock = clock or SystemClock()
    layout = layout_for(config, geometry, shard_ids(config.num_entrypoints or len(machines)))
    shards = {
        shard: DirectoryShard(shard, owner_timeout_s=config.owner_timeout_s, clock=clock)
        for shard in layout.shards
    }
    agents = {}
    for machine in machines:
        name = f"{config.name}-store-{machine}"
        capacity = config.resolved_capacity_bytes()
        store = SWAStore(
            max_state_bytes=pool_max_state_bytes(layout.state_bytes, capacity),
            capacity_bytes=capacity,
            ttl_s=config.ttl_s,
            clock=clock,
            block_tokens=layout.block_tokens,
        )
        agents[name] = StoreAgent(store, StoreRef(machine, name), ShardMap(layout.shards))
        layout.stores[machine] = name
    return layout, LocalSWATransport(shards, agents)
