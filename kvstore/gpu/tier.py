"""What the engine side needs from the storage tier: read, write, and ask how much is cached.

Three small protocols, each satisfied by the gRPC client (``kvstore.api.client.KVStoreClient``),
by the in-cluster client, and by ``kvstore.gpu.dirtier.DirectoryTier`` (a tier made of files in
one directory, for a single machine and for tests). The fetcher runs in its own process, so it is
given a *factory* (any picklable zero-argument callable, e.g. ``functools.partial(KVStoreClient,
"127.0.0.1:50051")``) and builds its reader there: a gRPC channel or a Ray handle cannot cross a
process boundary, an address can.

A failed read is a miss (``payload``/``state`` None), never an exception the engine must decode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from kvstore.api.backend import BlockRead, HitAnswer, PutAnswer, StateRead


class TierReader(Protocol):
    """Reads whole blocks and SWA states. Missing or unreadable → ``None`` payload / state."""

    def get_blocks(self, keys: Sequence[bytes], lease_id: str | None = None) -> list[BlockRead]: ...

    def get_swa_state(self, key: bytes, position: int) -> StateRead: ...


class TierWriter(Protocol):
    """Writes whole blocks (layer-major payloads) and SWA states (the stored region)."""

    def put_blocks(
        self, keys: Sequence[bytes], payloads: Sequence[bytes], traffic_class: str = ""
    ) -> PutAnswer: ...

    def put_swa_state(
        self, key: bytes, position: int, state: bytes, machine: str | None = None
    ) -> str: ...


class HitSource(Protocol):
    """Answers "how much of this prompt is cached" over both tiers (SPEC §5)."""

    def query_hit(
        self,
        *,
        token_ids: Sequence[int] | None = None,
        block_keys: Sequence[bytes] | None = None,
        prompt_len: int = 0,
        mode: str = "standard",
        traffic_class: str = "",
        take_lease: bool = True,
    ) -> HitAnswer: ...

    def release(self, lease_id: str) -> bool:
        """Give back the lease ``query_hit`` took once the blocks are read."""
        ...


#: Builds a reader inside the fetcher process. Must be picklable (spawn start method).
ReaderFactory = Callable[[], TierReader]
