"""The SWA tier as an engine (or the gateway) uses it, over an injected transport.

- ``put``: store a state on a machine's store (normally the machine that produced it).
- ``lookup`` / ``locate``: batched directory lookups, one call per shard, all shards in flight.
- ``fetch`` / ``get``: bring a state's bytes from its owner; every fetch feeds the per-machine
  latency/bandwidth estimate of the fetch-or-replay advice.

The transport (``kvstore.swa.transport``) moves the calls: in-process objects in unit tests, Ray
actors and their direct sockets in a cluster (``kvstore.runtime.swa_actors``). Nothing here
raises for an unreachable shard or store: no answer within ``call_timeout_s`` is a miss, and so
is a fetched blob of the wrong size (never wrong bytes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.keys import BlockKey, check_key, check_keys
from kvstore.pending import Pending
from kvstore.swa.advice import FetchReplayAdvisor
from kvstore.swa.directory import ShardMap, StoreRef
from kvstore.swa.store import check_state
from kvstore.swa.transport import SWALayout, SWATransport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchedState:
    key: BlockKey
    owner: StoreRef
    blob: np.ndarray
    seconds: float


class SWAClient:
    """Client of one SWA tier; ``local_machine`` is the machine this process runs on (its own
    store is preferred when several hold a state, and fetches from it count as local)."""

    def __init__(
        self, layout: SWALayout, transport: SWATransport, *, local_machine: str | None = None
    ) -> None:
        self.layout = layout
        self.local_machine = local_machine
        self._shards = ShardMap(layout.shards)
        self._transport = transport
        self.advisor = FetchReplayAdvisor(
            config=layout.config,
            state_bytes=layout.state_bytes,
            stored_layers=layout.stored_layers,
            replay_tokens=layout.window,
        )

    @property
    def machines(self) -> list[str]:
        """Machines with a store, sorted."""
        return sorted(self.layout.stores)

    # --- directory --------------------------------------------------------------------

    def lookup(
        self, keys: Sequence[BlockKey], prefer_machine: str | None = None
    ) -> Pending[list[StoreRef | None]]:
        """Owner of each key or None (miss). One call per shard, all in flight together;
        waited for from a thread (``result()``) or a loop (``await``)."""
        checked = check_keys(keys, "keys")
        prefer = self.local_machine if prefer_machine is None else prefer_machine
        groups = self._shards.group(checked)
        calls = {
            shard: ([checked[i] for i in indices], prefer) for shard, indices in groups.items()
        }
        return self._transport.lookup(calls).then(lambda answers: _owners(checked, groups, answers))

    # --- states -----------------------------------------------------------------------

    def put(
        self,
        machine_id: str,
        key: BlockKey,
        position: int,
        blob: object,
        *,
        state_bytes: int | None = None,
        owner: str = "",
    ) -> bool:
        """Store a state on ``machine_id``'s store. True once registered in the directory;
        False when stored but the registration is still pending (the store retries).
        ``state_bytes``: the exact size of a state of its layout (None: the tier's own).
        ``owner``: the tenant putting it ("" the tier's own callers): the store keeps each
        owner's states in its own share (``SWAStore.put``).
        Raises ``StateRejected`` (wrong size / position) before anything is sent,
        ``InvalidArgument`` for an unknown machine, and ``StoreError`` when the store could
        not take it."""
        key = check_key(key, "key")
        array = check_state(
            position,
            blob,
            state_bytes=self.layout.state_bytes if state_bytes is None else state_bytes,
            block_tokens=self.layout.block_tokens,
        )
        name = self.layout.store_name(machine_id)
        return self._transport.put(name, key, int(position), array, owner)

    def fetch(
        self, owner: StoreRef, key: BlockKey, *, state_bytes: int | None = None
    ) -> FetchedState | None:
        """The state's bytes from ``owner``, or None (gone, owner lost, timeout, bad size;
        ``state_bytes``: the size of its layout's states, None: the tier's own)."""
        start = time.perf_counter()
        blob = self._transport.fetch(owner, key)
        seconds = time.perf_counter() - start
        if blob is None:
            return None
        expected = self.layout.state_bytes if state_bytes is None else state_bytes
        if blob.dtype != np.uint8 or blob.size != expected:
            log.warning(
                "state %s from %s has %s B, expected %s B: treated as a miss",
                key.hex()[:16],
                owner.machine_id,
                blob.size,
                expected,
            )
            return None
        if seconds > 0:
            self.advisor.observe_fetch(owner.machine_id, blob.nbytes, seconds)
        return FetchedState(key, owner, blob, seconds)

    def get(self, key: BlockKey, *, state_bytes: int | None = None) -> FetchedState | None:
        """Look the state up and fetch it from its owner: None on any kind of miss."""
        owner = self.lookup([key]).result()[0]
        return None if owner is None else self.fetch(owner, key, state_bytes=state_bytes)

    def measure_link(self, machine_id: str, samples: int = 3) -> float | None:
        """Ping ``machine_id``'s store ``samples`` times to feed the latency estimate; returns
        the best round trip (None when the store did not answer)."""
        name = self.layout.stores.get(machine_id)
        if name is None:
            return None
        best: float | None = None
        for _ in range(samples):
            seconds = self._transport.ping(name)
            if seconds is None:
                return best
            self.advisor.observe_latency(machine_id, seconds)
            best = seconds if best is None else min(best, seconds)
        return best

    def stats(self) -> dict[str, Any]:
        """The stores' figures summed (``bytes``, ``states``, ...; ``bytes_by_owner`` per
        owner), with ``stores_answering`` and each store's own figures under ``by_machine``."""
        by_name = self._transport.stats()
        machine_of = {name: machine for machine, name in self.layout.stores.items()}
        totals: dict[str, Any] = {"stores": len(self.layout.stores), "stores_answering": 0}
        owners: dict[str, int] = {}
        by_machine: dict[str, Any] = {}
        for name, figures in by_name.items():
            by_machine[machine_of.get(name, name)] = figures
            if figures is None:
                continue
            totals["stores_answering"] += 1
            for field_name, value in figures.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    totals[field_name] = totals.get(field_name, 0) + value
            for owner, size in (figures.get("bytes_by_owner") or {}).items():
                owners[owner] = owners.get(owner, 0) + int(size)
        totals["bytes_by_owner"] = owners
        totals["by_machine"] = by_machine
        return totals

    def __repr__(self) -> str:
        return f"SWAClient({self.layout.config.name!r}, local={self.local_machine!r})"


def _owners(
    checked: list[BlockKey],
    groups: dict[str, list[int]],
    answers: dict[str, list[StoreRef | None] | None],
) -> list[StoreRef | None]:
    owners: list[StoreRef | None] = [None] * len(checked)
    for shard, indices in groups.items():
        answer = answers.get(shard)
        if answer is None or len(answer) != len(indices):
            continue  # shard unreachable or confused: its keys are misses
        for index, owner in zip(indices, answer, strict=True):
            owners[index] = owner
    return owners
