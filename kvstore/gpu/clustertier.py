"""The in-cluster tier seen through the engine side's protocols (``TierReader``, ``TierWriter``,
``HitSource``): the block store's client plus the SWA tier's client, over Ray.

``ClusterTier`` adapts the two clients' shapes (``get_blocks`` → arrays or None, SWA ``get(key)``
→ ``FetchedState`` or None, ``HitQuery.query_hit`` → ``HitResult``) to the ones the fetcher and
the connector use (``BlockRead``, ``StateRead``, ``HitAnswer``). ``ClusterReaderFactory`` is the
picklable recipe the fetcher process runs: join the Ray cluster at ``ray_address``, find the
deployed block store by its actor names, rebuild the SWA client from its (picklable)
deployment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.api.backend import BlockRead, HitAnswer, PutAnswer, StateRead
from kvstore.errors import InvalidArgument, StoreError
from kvstore.keys import BLOCK_TOKENS, BlockKey, check_key

#: The block store's class for requests that name none.
DEFAULT_CLASS = "default"


class ClusterTier:
    """Block store client + SWA client (optional: without it every state is a miss)."""

    def __init__(
        self,
        blocks: Any,
        swa: Any = None,
        *,
        geometry: Any = None,
        local_machine: str | None = None,
    ) -> None:
        self.blocks = blocks
        self.swa = swa
        self.geometry = geometry
        self.local_machine = local_machine
        # Leases taken by query_hit, by id, until the caller releases them.
        self._leases: dict[str, Any] = {}

    # --- TierReader --------------------------------------------------------------------------

    def get_blocks(self, keys: Sequence[bytes], lease_id: str | None = None) -> list[BlockRead]:
        typed = [check_key(key, f"keys[{i}]") for i, key in enumerate(keys)]
        payloads = self.blocks.get_blocks(typed, self._leases.get(lease_id or ""))
        return [
            BlockRead(key=key, payload=None, miss_reason="miss")
            if payload is None
            else BlockRead(key=key, payload=np.asarray(payload, dtype=np.uint8).tobytes())
            for key, payload in zip(typed, payloads, strict=True)
        ]

    def get_swa_state(self, key: bytes, position: int) -> StateRead:
        if self.swa is None:
            return StateRead(state=None, miss_reason="no SWA tier")
        fetched = self.swa.get(check_key(key))
        if fetched is None:
            return StateRead(state=None, miss_reason="miss")
        return StateRead(state=np.asarray(fetched.blob).tobytes(), owner=fetched.owner.machine_id)

    # --- TierWriter --------------------------------------------------------------------------

    def put_blocks(
        self, keys: Sequence[bytes], payloads: Sequence[bytes], traffic_class: str = ""
    ) -> PutAnswer:
        result = self.blocks.put_blocks(
            [check_key(key, f"keys[{i}]") for i, key in enumerate(keys)],
            [np.frombuffer(payload, dtype=np.uint8) for payload in payloads],
            traffic_class or DEFAULT_CLASS,
        )
        # "busy" means another writer is storing the same bytes right now: not lost.
        return PutAnswer(
            committed=len(result.stored) + len(result.existing),
            failed_keys=tuple(result.failed),
        )

    def put_swa_state(
        self, key: bytes, position: int, state: bytes, machine: str | None = None
    ) -> str:
        target = machine or self.local_machine
        if self.swa is None or target is None:
            raise StoreError("no SWA tier (or no machine) to store the state on")
        self.swa.put(target, check_key(key), position, np.frombuffer(state, dtype=np.uint8))
        return target

    # --- HitSource ---------------------------------------------------------------------------

    def query_hit(
        self,
        *,
        token_ids: Sequence[int] | None = None,
        block_keys: Sequence[bytes] | None = None,
        prompt_len: int = 0,
        mode: str = "standard",
        traffic_class: str = "",
        take_lease: bool = True,
    ) -> HitAnswer:
        if self.swa is None or self.geometry is None:
            raise InvalidArgument("hit_source", "query_hit needs the SWA client and the geometry")
        from kvstore.swa.hit import BlockClientLookup

        query = self.swa.hit_query(
            BlockClientLookup(self.blocks, traffic_class or None), self.geometry
        )
        length = len(token_ids) if token_ids is not None else prompt_len
        keys_or_tokens: Any = token_ids if token_ids is not None else list(block_keys or ())
        result = query.query_hit(keys_or_tokens, length, mode)
        lease_id = None
        if result.lease is not None:
            if take_lease:
                lease_id = str(result.lease.lease_id)
                self._leases[lease_id] = result.lease
            else:
                self.blocks.release(result.lease)
        hit_blocks = result.plan.hit_tokens // BLOCK_TOKENS
        keys: tuple[BlockKey, ...] = ()
        if result.lease is not None:
            keys = tuple(result.lease.keys[:hit_blocks])
        advice = result.advice
        return HitAnswer(
            plan=result.plan,
            swa_owner=None if result.swa_owner is None else result.swa_owner.machine_id,
            advice=None if advice is None else advice.choice,
            fetch_seconds=0.0 if advice is None else advice.fetch_s,
            replay_seconds=0.0 if advice is None else advice.replay_s,
            lease_id=lease_id,
            hit_keys=keys,
        )

    def release(self, lease_id: str) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self.blocks.release(lease)
        return True


@dataclass(frozen=True)
class ClusterReaderFactory:
    """Builds a ``ClusterTier`` inside the fetcher process (picklable: plain config)."""

    ray_address: str
    #: ``kvstore.blockstore.config.BlockStoreConfig`` of the deployed block store.
    blockstore: Any
    #: ``kvstore.runtime.swa_actors.SWADeployment`` (None: states are misses).
    swa_deployment: Any = None
    local_machine: str | None = None
    namespace: str = "kvstore"

    def __call__(self) -> ClusterTier:
        from kvstore.runtime.cluster import connect
        from kvstore.runtime.deploy import connect_client

        connect(self.ray_address, namespace=self.namespace)
        swa = None
        if self.swa_deployment is not None:
            swa = self.swa_deployment.client(local_machine=self.local_machine)
        return ClusterTier(connect_client(self.blockstore), swa, local_machine=self.local_machine)
