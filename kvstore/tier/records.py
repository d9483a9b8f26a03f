"""What crosses the tier seam: one record per answer, the same for every implementation.

A hit, a block read, a state read, a put and the figures of ``stats`` look the same whether they
came from the cluster (``kvstore.tier.cluster``), from files in one directory
(``kvstore.tier.files``) or over gRPC (``kvstore.api.client``), so an engine, the gateway, the
demo and the chaos load are written once against them.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.hitplan import MODES, STANDARD, HitPlan
from kvstore.keys import BlockKey, words_to_keys

#: Longest model fingerprint a layout may carry (an engine's is 32 bytes, a preset's ~400).
MAX_FINGERPRINT_BYTES = 1024


@dataclass(frozen=True)
class Layout:
    """The byte shape of one model's cache as an engine lays it out: the fingerprint its block
    keys are chained from, the exact size of one block's payload and of one SWA state.

    A tier serves many models: each request may name the layout it is made under, and the tier
    keeps each layout's blocks and states in a namespace of their own (``salt``), so under one
    layout every block has that layout's size and a payload of another size is refused before
    anything is stored. The sizes are part of the layout's identity: two engines that disagree
    on a size never share a block, whatever their fingerprints say. A request that names no
    layout is made under the tier's own (its geometry's fingerprint and sizes).
    """

    fingerprint: bytes
    block_bytes: int
    #: 0: this layout keeps no SWA state.
    state_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.fingerprint, bytes) or not (
            0 < len(self.fingerprint) <= MAX_FINGERPRINT_BYTES
        ):
            raise InvalidArgument(
                "layout.fingerprint", f"must be 1 to {MAX_FINGERPRINT_BYTES} bytes"
            )
        for name, least in (("block_bytes", 1), ("state_bytes", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidArgument(
                    f"layout.{name}", f"must be an integer ≥ {least}, got {value!r}"
                )

    @property
    def identity(self) -> bytes:
        """32 bytes naming the fingerprint and both sizes."""
        blob = b"%d:%d:" % (self.block_bytes, self.state_bytes) + self.fingerprint
        return hashlib.blake2b(blob, digest_size=32, person=b"kvstore-layout").digest()

    def salt(self, base: bytes) -> bytes:
        """The namespace of this layout inside the namespace ``base`` (a tenant's salt)."""
        return hmac.new(base, b"layout:" + self.identity, hashlib.sha256).digest()


@dataclass(frozen=True, eq=False)
class HitRequest:
    """One prompt to plan (docs/rules.md §5): its token ids (``prompt_len`` may be left 0), or the
    keys of its full blocks from the start (32-byte keys or their (n, 4) uint64 words) and its
    length. With ``take_lease`` the hit blocks are leased until read or released."""

    token_ids: Sequence[int] | np.ndarray | None = None
    block_keys: Sequence[bytes] | np.ndarray | None = None
    prompt_len: int = 0
    mode: str = STANDARD
    traffic_class: str = ""
    take_lease: bool = True
    #: The layout the keys are made under (None: the tier's own).
    layout: Layout | None = None

    def __post_init__(self) -> None:
        if (self.token_ids is None) == (self.block_keys is None):
            raise InvalidArgument("token_ids", "give token_ids or block_keys (one of them)")
        if self.token_ids is not None and self.prompt_len not in (0, len(self.token_ids)):
            raise InvalidArgument(
                "prompt_len", f"{self.prompt_len} differs from the {len(self.token_ids)} token_ids"
            )
        if self.mode not in MODES:
            raise InvalidArgument("mode", f"must be one of {', '.join(MODES)}, got {self.mode!r}")

    @property
    def length(self) -> int:
        """The prompt's length in tokens."""
        return len(self.token_ids) if self.token_ids is not None else int(self.prompt_len)

    @property
    def keys_or_tokens(self) -> Sequence[int] | Sequence[bytes] | np.ndarray:
        return self.token_ids if self.token_ids is not None else self.block_keys  # type: ignore[return-value]


@dataclass(frozen=True)
class HitAnswer:
    """A hit plan over both tiers, with where the SWA state is and what to do about it."""

    plan: HitPlan
    swa_owner: str | None
    advice: str | None  # "fetch" | "replay" (``kvstore.swa.advice``) | None: nothing to fetch
    fetch_seconds: float
    replay_seconds: float
    lease_id: str | None
    #: Keys of the blocks the engine loads: the first ``plan.hit_tokens / 128`` keys of the
    #: prompt (the lease covers the ``block_hit_tokens / 128`` blocks of the run). 32-byte keys,
    #: or their (n, 4) uint64 words (``kvstore.keys``), which a gateway passes on packed without
    #: making an object per key.
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
    """What a put did, block by block: every key asked for is in exactly one of the four."""

    #: Written by this put, now visible.
    stored: int = 0
    #: Already committed before (not rewritten), visible.
    existing: int = 0
    #: Another writer is storing them right now: visible once that writer commits, not yet.
    busy_keys: tuple[BlockKey, ...] = ()
    #: Not stored (not enough live nodes, a node failed mid-write): not visible.
    failed_keys: tuple[BlockKey, ...] = ()
    #: Of ``stored``, how many were written with fewer shards than a full stripe (nodes down or
    #: draining): visible, with less redundancy until the repair restores them. Not a fifth
    #: outcome: these are counted in ``stored`` too.
    under_redundant: int = 0

    @property
    def committed(self) -> int:
        """Blocks visible now (stored by this put or before)."""
        return self.stored + self.existing

    def committed_keys(self, keys: Sequence[bytes]) -> list[BlockKey]:
        """Which of the ``keys`` the put was asked for are visible now."""
        absent = set(self.busy_keys) | set(self.failed_keys)
        return [BlockKey(bytes(key)) for key in keys if key not in absent]


@dataclass(frozen=True)
class BlockRead:
    key: BlockKey
    payload: bytes | None  # None = miss
    miss_reason: str | None = None
    #: Served although a data shard's node was down: parity stood in.
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


def stat_number(figures: Any, key: str) -> float | None:
    """``figures[key]`` of a stats mapping (e.g. ``Stats.extra["repair"]``) as a finite number;
    None when absent or not one: a figure nobody reported must not read as 0."""
    if not isinstance(figures, Mapping):
        return None
    value = figures.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)
