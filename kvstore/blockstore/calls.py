"""What storage nodes and meta shards answer through a ``Fanout``: one Protocol each.

Call sites name methods through these (``fanout.submit(node_target(3), StorageNodeCalls.get,
keys)``), so mypy checks every argument and result, and that the method is one the target's
kind offers. The plain objects (``StorageNode``, ``MetaShard``) and their Ray shells
(``kvstore.runtime.blockstore_actors``) are checked against them where they are defined (this
module is the client's side and imports no server module): a signature that drifts on either
side fails mypy. Only what is called through a fanout is here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from kvstore.blockstore.fanout import META, NODE, Target
from kvstore.blockstore.records import MetaReply, RemovedBlock, StripeRecord


class StorageNodeCalls(Protocol):
    def put(
        self,
        token: int,
        keys: Sequence[bytes],
        shards: Sequence[np.ndarray],
        class_ids: Sequence[int],
        created: Sequence[float],
    ) -> list[bool]: ...

    def commit(self, token: int, keys: Sequence[bytes]) -> list[bool]: ...

    def get(self, keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]: ...

    def delete(self, keys: Sequence[bytes], not_after: float | None = None) -> int: ...

    def usage(self) -> dict[str, int]: ...

    def scrub(self, limit: int = 1024, budget_bytes: int | None = None) -> dict[str, object]: ...

    def ping(self) -> int: ...

    def status(self) -> dict[str, int]: ...

    def set_draining(self, flag: bool) -> bool: ...


class MetaShardCalls(Protocol):
    def begin_put(self, keys: Sequence[bytes], token: int) -> list[int]: ...

    def commit(
        self,
        keys: Sequence[bytes],
        token: int,
        placements: np.ndarray,
        sizes: Sequence[int],
        class_id: int,
    ) -> list[bool]: ...

    def abort_put(self, keys: Sequence[bytes], token: int) -> None: ...

    def lookup_wire(self, request: tuple[Any, ...]) -> tuple[Any, ...]: ...

    def locate(
        self,
        keys: Sequence[bytes],
        down_nodes: Sequence[int] = (),
        traffic_class: str | None = None,
        lease_until: float | None = None,
    ) -> MetaReply: ...

    def release(
        self, keys: Sequence[bytes] | np.ndarray, rows: np.ndarray | None = None
    ) -> int: ...

    def mark_nodes(self, down: Sequence[int] = (), up: Sequence[int] = ()) -> list[int]: ...

    def repair_queue(
        self,
        dead_nodes: Sequence[int],
        draining_nodes: Sequence[int],
        limit: int,
        max_bytes: int,
        class_rank: Sequence[int] = (),
        refresh: bool = False,
    ) -> tuple[list[StripeRecord], dict[str, Any]]: ...

    def set_placements(self, moves: Sequence[tuple[bytes, int, int, int]]) -> list[bool]: ...

    def gc_expire(
        self,
        now: float,
        ttl_seconds_by_class: dict[str, float],
        basis: str = "last_access",
        limit: int | None = None,
    ) -> list[RemovedBlock]: ...

    def gc_lru_candidates(
        self, now: float, bytes_needed: int
    ) -> list[tuple[float, bytes, int]]: ...

    def gc_evict(
        self, keys: Sequence[bytes], now: float, chosen_at: float | None = None
    ) -> list[RemovedBlock]: ...

    def stored_bytes_by_class(self) -> dict[str, int]: ...


def node_target(node_id: int) -> Target[StorageNodeCalls]:
    return Target(NODE, node_id)


def meta_target(shard_id: int) -> Target[MetaShardCalls]:
    return Target(META, shard_id)
