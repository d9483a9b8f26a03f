"""The SWA tier as an engine (or any process in the Ray cluster) uses it.

- ``put``: store a state on a machine's store (normally the machine that produced it).
- ``lookup``: batched directory lookups, one call per shard, all shards in flight at once.
- ``fetch`` / ``get``: bring a state's bytes from its owner, across Ray nodes when it lives
  elsewhere; every fetch feeds the per-machine latency/bandwidth estimate of the advice.
- ``hit_query``: ``query_hit`` over both tiers (``kvstore.swa.hit``).

Nothing here raises for an unreachable actor: a shard or store that does not answer within
``call_timeout_s`` is a miss. A fetched blob of the wrong size is a miss too (never wrong bytes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey, check_key, check_keys
from kvstore.swa.advice import FetchReplayAdvisor
from kvstore.swa.directory import ShardMap, StoreRef
from kvstore.swa.store import check_state

if TYPE_CHECKING:
    from kvstore.runtime.swa_actors import SWADeployment
    from kvstore.swa.hit import BlockLookup, HitGeometry, HitQuery

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchedState:
    key: BlockKey
    owner: StoreRef
    blob: np.ndarray
    seconds: float


class SWAClient:
    """Client of one SWA deployment; ``local_machine`` is the machine this process runs on (its
    own store is preferred when several hold a state, and fetches from it count as local)."""

    def __init__(self, deployment: SWADeployment, *, local_machine: str | None = None) -> None:
        from kvstore.runtime.swa_actors import SWARayTransport, entry_actor_name

        self.deployment = deployment
        self.local_machine = local_machine
        config = deployment.config
        self._shards = ShardMap(deployment.shards)
        self._entry_names = {s: entry_actor_name(config, s) for s in deployment.shards}
        self._transport = SWARayTransport(config.call_timeout_s)
        self.advisor = FetchReplayAdvisor(
            config=config,
            state_bytes=deployment.state_bytes,
            stored_layers=deployment.stored_layers,
            replay_tokens=deployment.window,
        )

    # --- directory --------------------------------------------------------------------

    def lookup(
        self, keys: Sequence[BlockKey], prefer_machine: str | None = None
    ) -> list[StoreRef | None]:
        """Owner of each key or None (miss). One call per shard, all in flight together."""
        checked = check_keys(keys, "keys")
        prefer = self.local_machine if prefer_machine is None else prefer_machine
        groups = self._shards.group(checked)
        calls = {
            self._entry_names[shard]: ([checked[i] for i in indices], prefer)
            for shard, indices in groups.items()
        }
        answers = self._transport.lookup(calls)
        owners: list[StoreRef | None] = [None] * len(checked)
        for shard, indices in groups.items():
            answer = answers.get(self._entry_names[shard])
            if answer is None or len(answer) != len(indices):
                continue  # shard unreachable or confused: its keys are misses
            for index, owner in zip(indices, answer, strict=True):
                owners[index] = owner
        return owners

    def locate(self, key: BlockKey, prefer_machine: str | None = None) -> StoreRef | None:
        """Owner of one state key (the ``StateLocator`` of ``kvstore.swa.hit``)."""
        return self.lookup([key], prefer_machine)[0]

    # --- states -----------------------------------------------------------------------

    def put(self, machine_id: str, key: BlockKey, position: int, blob: object) -> bool:
        """Store a state on ``machine_id``'s store. True once registered in the directory;
        False when stored but the registration is still pending (the store retries).
        Raises ``StateRejected`` (wrong size / position) before anything is sent, and
        ``StoreError`` when the store could not take it."""
        key = check_key(key, "key")
        array = check_state(
            position,
            blob,
            state_bytes=self.deployment.state_bytes,
            block_tokens=self.deployment.block_tokens,
        )
        name = self.deployment.stores.get(machine_id)
        if name is None:
            raise InvalidArgument(
                "machine_id",
                f"no SWA store on {machine_id!r} (on {sorted(self.deployment.stores)})",
            )
        return self._transport.put(name, key, int(position), array)

    def fetch(self, owner: StoreRef, key: BlockKey) -> FetchedState | None:
        """The state's bytes from ``owner``, or None (gone, owner lost, timeout, bad size)."""
        start = time.perf_counter()
        blob = self._transport.fetch(owner.store_name, key)
        seconds = time.perf_counter() - start
        if blob is None:
            return None
        if blob.dtype != np.uint8 or blob.size != self.deployment.state_bytes:
            log.warning(
                "state %s from %s has %s B, expected %s B: treated as a miss",
                key.hex()[:16],
                owner.machine_id,
                blob.size,
                self.deployment.state_bytes,
            )
            return None
        if seconds > 0:
            self.advisor.observe_fetch(owner.machine_id, blob.nbytes, seconds)
        return FetchedState(key, owner, blob, seconds)

    def get(self, key: BlockKey) -> FetchedState | None:
        """Look the state up and fetch it from its owner: None on any kind of miss."""
        owner = self.locate(key)
        return None if owner is None else self.fetch(owner, key)

    def measure_link(self, machine_id: str, samples: int = 3) -> float | None:
        """Ping ``machine_id``'s store ``samples`` times to feed the latency estimate; returns
        the best round trip (None when the store did not answer)."""
        name = self.deployment.stores.get(machine_id)
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

    # --- both tiers -------------------------------------------------------------------

    def hit_query(self, blocks: BlockLookup, geometry: HitGeometry) -> HitQuery:
        """A ``HitQuery`` over ``blocks`` (the block tier) and this SWA directory."""
        from kvstore.swa.hit import HitQuery

        return HitQuery(
            blocks=blocks,
            states=self,
            advisor=self.advisor,
            geometry=geometry,
            local_machine=self.local_machine,
        )

    def __repr__(self) -> str:
        return f"SWAClient({self.deployment.config.name!r}, local={self.local_machine!r})"
