"""What storage nodes and meta shards answer remotely: one Protocol each.

Call sites name methods through these (``fanout.submit(node_target(3), StorageNodeCalls.get,
keys)``), so mypy checks every argument and result, and that the method is one the target's
kind offers. A Protocol is also where its remote signatures are written, besides the plain
object's methods that implement them (``StorageNode``, ``MetaShard``, checked against the
Protocols where they are defined: this module is the client's side and imports no server
module): the Ray shells (``kvstore.runtime.blockstore_actors``) get their forwarders generated
from these (``kvstore.runtime.forwards``), which refuses at import a Protocol method the plain
class lacks or takes other parameters for. The calls that only tools, tests, repair and GC make
through a Ray handle are here too, below the fanout ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from kvstore.blockstore.fanout import META, NODE, Target
from kvstore.blockstore.records import MetaReply, RemovedBlock, StripeRecord


class StorageNodeCalls(Protocol):
    def put(
        self,
        token: int,
        keys: Sequence[bytes],
        shards: Sequence[np.ndarray] | np.ndarray,
        class_ids: Sequence[int] | np.ndarray,
        created: Sequence[float] | np.ndarray,
        commit: bool = False,
    ) -> list[bool]: ...

    def commit(self, token: int, keys: Sequence[bytes]) -> list[bool]: ...

    def get(self, keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]: ...

    def delete(self, keys: Sequence[bytes], not_after: float | None = None) -> int: ...

    def usage(self) -> dict[str, int]: ...

    def scrub(self, limit: int = 1024, budget_bytes: int | None = None) -> dict[str, object]: ...

    def ping(self) -> int: ...

    def status(self) -> dict[str, int]: ...

    def set_draining(self, flag: bool) -> bool: ...

    # Through a Ray handle only (the direct socket serves abort and holds by name too).

    def abort(self, token: int, keys: Sequence[bytes]) -> int: ...

    def holds(self, keys: Sequence[bytes]) -> list[bool]: ...

    def locate(self, keys: Sequence[bytes]) -> list[tuple[str, int, int] | None]:
        """Where this node's shards of ``keys`` are on disk (tools, fault injection)."""
        ...

    def compact(self, budget_bytes: int) -> dict[str, int]:
        """One compaction step now (the shell's background loop runs them anyway)."""
        ...

    def manifest(
        self, meta_shard: int | None = None, num_meta_shards: int | None = None
    ) -> pa.Table: ...


class MetaShardCalls(Protocol):
    def begin_put(self, keys: Sequence[bytes], token: int) -> list[int]: ...

    def commit(
        self,
        keys: Sequence[bytes],
        token: int,
        placements: np.ndarray,
        sizes: Sequence[int] | np.ndarray,
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

    # Through a Ray handle only.

    def lookup(
        self,
        keys: Sequence[bytes] | np.ndarray,
        down_nodes: Sequence[int] = (),
        traffic_class: str | None = None,
        lease_seconds: float | None = None,
        release_keys: Sequence[bytes] | np.ndarray | None = None,
        release_rows: np.ndarray | None = None,
    ) -> MetaReply: ...

    def referenced(self, keys: Sequence[bytes], node_id: int) -> list[bool]: ...

    def snapshot_table(self) -> pa.Table: ...


def node_target(node_id: int) -> Target[StorageNodeCalls]:
    return Target(NODE, node_id)


def meta_target(shard_id: int) -> Target[MetaShardCalls]:
    return Target(META, shard_id)
