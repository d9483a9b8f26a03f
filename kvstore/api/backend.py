"""What the gRPC gateway needs from the tiers behind it, as one small interface.

The servicer validates and translates protobuf messages; a ``Backend`` does the work. The real one
(``kvstore.api.cluster_backend.ClusterBackend``) forwards to the in-cluster block and SWA clients,
so the gRPC client and the in-cluster client have the same shape. Backends are synchronous (they
wait on Ray); the server runs them in a bounded thread pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvstore.hitplan import HitPlan
from kvstore.keys import BlockKey, words_to_keys


@dataclass(frozen=True)
class HitAnswer:
    """A hit plan over both tiers, with where the SWA state is and what to do about it."""

    plan: HitPlan
    swa_owner: str | None
    advice: str | None  # "fetch" | "replay" | None (nothing to fetch)
    fetch_seconds: float
    replay_seconds: float
    lease_id: str | None
    #: Keys of the hit blocks: 32-byte keys, or their (n, 4) uint64 words (``kvstore.keys``),
    #: which a gateway can pass on packed without making an object per key.
    hit_keys: tuple[BlockKey, ...] | np.ndarray = ()

    @property
    def hit_block_keys(self) -> tuple[BlockKey, ...]:
        if isinstance(self.hit_keys, np.ndarray):
            return tuple(words_to_keys(self.hit_keys))
        return self.hit_keys

    @property
    def hit_keys_packed(self) -> bytes:
        """The hit keys end to end, 32 bytes each."""
        if isinstance(self.hit_keys, np.ndarray):
            return np.ascontiguousarray(self.hit_keys).tobytes()
        return b"".join(self.hit_keys)


@dataclass(frozen=True)
class PutAnswer:
    committed: int
    failed_keys: tuple[BlockKey, ...] = ()


@dataclass(frozen=True)
class BlockRead:
    key: BlockKey
    payload: bytes | None  # None = miss
    miss_reason: str | None = None
    degraded: bool = False

    @property
    def found(self) -> bool:
        return self.payload is not None


@dataclass(frozen=True)
class StateRead:
    state: bytes | None  # None = miss
    owner: str | None = None
    miss_reason: str | None = None


@dataclass(frozen=True)
class Stats:
    """Figures for GetStats, ``kvstore stats`` and the Prometheus endpoint."""

    classes: dict[str, dict[str, Any]] = field(default_factory=dict)
    block_bytes_stored: int = 0
    swa_bytes_stored: int = 0
    degraded_reads: int = 0
    repairs_done: int = 0
    repairs_pending: int = 0
    live_storage_nodes: int = 0
    storage_nodes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Backend(Protocol):
    #: Model fingerprint used to turn token ids into block keys (``kvstore.keys.block_keys``).
    model_fingerprint: bytes
    #: Exact size an SWA state must have (``GeometryConfig.state_size_to_disk``).
    state_size: int

    def query_hit(
        self,
        keys: Sequence[BlockKey] | np.ndarray,  # or (n, 4) uint64 words (kvstore.keys)
        prompt_len: int,
        mode: str,
        traffic_class: str,
        take_lease: bool,
    ) -> HitAnswer: ...

    def put_blocks(
        self, keys: list[BlockKey], payloads: list[bytes], traffic_class: str
    ) -> PutAnswer: ...

    def get_blocks(self, keys: list[BlockKey], lease_id: str | None) -> list[BlockRead]: ...

    def put_swa_state(
        self, key: BlockKey, position: int, state: bytes, machine: str | None
    ) -> str: ...

    def get_swa_state(self, key: BlockKey, position: int) -> StateRead: ...

    def release_lease(self, lease_id: str) -> bool:
        """Give a lease back; False for an unknown id. Must not block: the gateway answers it on
        its event loop (hand the release to the cluster asynchronously)."""
        ...

    def stats(self) -> Stats: ...
