"""The tier as its callers need it: ask how much is cached, read, write — three small protocols.

Every caller (the gRPC servicer, the engine connector and its fetcher process, the demo engines,
the chaos load) is written against these, and every implementation satisfies them:
``kvstore.tier.cluster.ClusterTier`` (the deployed cluster), ``kvstore.tier.files.DirectoryTier``
(checksummed files in one directory: one machine, tests) and ``kvstore.api.client.KVStoreClient``
(the same calls over gRPC). A failed read is a miss (``payload``/``state`` None), never an
exception the caller must decode; bad input raises ``InvalidArgument`` naming the field.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from kvstore.tier.counters import HitCounters
from kvstore.tier.records import (
    BlockRead,
    HitAnswer,
    HitRequest,
    LeaseTag,
    PutAnswer,
    StateRead,
    Stats,
)


class HitSource(Protocol):
    """Answers "how much of this prompt is cached" over both tiers (docs/rules.md §5)."""

    def query_hit(self, request: HitRequest) -> HitAnswer:
        """The plan for one prompt (``HitRequest``), with a lease on the hit if asked."""
        ...

    def release_lease(self, lease_id: str) -> bool:
        """Give back the lease ``query_hit`` took (False: unknown or expired). Never blocks on
        the cluster: a release needs no answer."""
        ...


@runtime_checkable
class AsyncHitSource(Protocol):
    """A hit source that also plans from an asyncio loop without parking a thread (the
    cluster's): the gateway uses it for QueryHit, its hottest call."""

    async def query_hit_async(self, request: HitRequest) -> HitAnswer: ...


class TierReader(Protocol):
    """Reads whole blocks and SWA states. Missing or unreadable → ``None`` payload / state."""

    def get_blocks(
        self, keys: Sequence[bytes], lease_id: str | None = None, *, keep_lease: bool = False
    ) -> list[BlockRead]:
        """One read per key, in order. With the lease of a ``query_hit`` the reads need no
        second metadata round trip, and the lease is released once they are done —
        ``keep_lease``: not yet (more reads with it follow; ``release_lease`` ends it)."""
        ...

    def get_swa_state(
        self, key: bytes, position: int, *, state_bytes: int | None = None
    ) -> StateRead:
        """The state taken at exactly ``position``; ``state_bytes``: the exact size of its
        layout's states (None: the tier's own), any other size is a miss."""
        ...


class TierWriter(Protocol):
    """Writes whole blocks (layer-major payloads) and SWA states (the stored region)."""

    def put_blocks(
        self, keys: Sequence[bytes], payloads: Sequence[bytes], traffic_class: str = ""
    ) -> PutAnswer: ...

    def put_swa_state(
        self,
        key: bytes,
        position: int,
        state: bytes,
        machine: str | None = None,
        *,
        state_bytes: int | None = None,
        owner: str = "",
    ) -> str:
        """Store a state (on ``machine``'s store when given); returns the machine holding it.
        ``state_bytes``: the exact size of its layout's states (None: the tier's own).
        ``owner``: the tenant storing it ("": the tier's own callers). A tier whose stores
        are shared keeps each owner's states in its own share of them, so one tenant's puts
        never evict another's (``kvstore.swa.store``); one with nothing shared ignores it."""
        ...


class EngineTier(HitSource, TierReader, TierWriter, Protocol):
    """Everything an engine does with the tier: ask, read, write."""


class Tier(EngineTier, Protocol):
    """All of it, plus the figures: what the gRPC gateway serves."""

    #: Model fingerprint used to turn token ids into block keys (``kvstore.keys.block_keys``).
    model_fingerprint: bytes
    #: The tier's own layout (``kvstore.tier.records.Layout``, for requests that name none):
    #: the exact size of an SWA state (``GeometryConfig.state_size_to_disk``) and of one
    #: block's payload (``GeometryConfig.block_bytes``, or ``kvstore up --block-bytes``).
    state_size: int
    block_bytes: int

    #: The hit figures, per tenant and class: a tenant's view counts its lookups here too.
    hit_counters: HitCounters

    def stats(self) -> Stats: ...

    def lease_tag(self, lease_id: str) -> LeaseTag | None:
        """Who holds an open lease (None: unknown, read, released or expired)."""
        ...

    def open_leases(self, tenant: str) -> int:
        """Leases ``tenant`` holds open."""
        ...

    def machine_at(self, address: str) -> str | None:
        """The machine with an SWA store at IP ``address`` (None: not one of the tier's): the
        gateway keeps a state put from a machine in that machine's memory."""
        ...


#: Builds a reader inside another process (the engine's fetcher). Must be picklable (spawn): a
#: gRPC channel or a Ray handle cannot cross a process boundary, an address can.
ReaderFactory = Callable[[], TierReader]
