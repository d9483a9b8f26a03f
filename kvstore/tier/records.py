"""What crosses the tier seam: one record per answer, the same for every implementation.

A hit, a block read, a state read, a put and the figures of ``stats`` look the same whether they
came from the cluster (``kvstore.tier.cluster``), from files in one directory
(``kvstore.tier.files``) or over gRPC (``kvstore.api.client``), so an engine, the gateway, the
demo and the chaos load are written once against them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.hitplan import MODES, STANDARD, HitPlan
from kvstore.keys import (
    BLOCK_TOKENS,
    BlockKey,
    block_key_words,
    key_words,
    words_to_keys,
)

#: Longest model fingerprint a layout may carry (an engine's is 32 bytes, a preset's ~400).
MAX_FINGERPRINT_BYTES = 1024
#: Longest traffic class name a request may carry.
MAX_CLASS_CHARS = 64


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


@dataclass(frozen=True)
class LeaseTag:
    """Who holds a lease, kept with it in the tier's one lease table (``kvstore.tier.leases``)."""

    #: The tenant that took it ("": the tier's own callers, an engine in the same process).
    tenant: str = ""
    #: The most leases the tenant may hold at once (None: no cap but the table's own bound).
    cap: int | None = None
    #: The caller's keys whose blocks the lease holds in the shared namespace (docs/rules.md
    #: §10): a read with the lease finds them there.
    shared: frozenset[bytes] = frozenset()


#: The tag of a lease taken by the tier's own callers.
UNTAGGED = LeaseTag()


def check_rate(name: str, rate: object) -> None:
    """``InvalidArgument`` unless ``rate`` is a finite number ≥ 0 (0: not known)."""
    if (
        isinstance(rate, bool)
        or not isinstance(rate, int | float | np.floating | np.integer)
        or not math.isfinite(rate)
        or rate < 0
    ):
        raise InvalidArgument(name, f"must be a finite rate ≥ 0 (0: none), got {rate!r}")


@dataclass(frozen=True, eq=False)
class HitRequest:
    """One prompt to plan (docs/rules.md §5): its token ids (``prompt_len`` may be left 0), or the
    keys of its full blocks from the start (32-byte keys or their (n, 4) uint64 words) and its
    length. With ``take_lease`` the hit blocks are leased until read or released.

    The one checked form of a hit request: made (at an API edge or by an engine), it is valid,
    and every layer behind (a tenant's view, the tier, the hit query) takes it as given. (That
    its keys never repeat is the hit query's to check, on the keys it would lease: a check
    here would cost every client a sort per request for a rule only the tier's leases need.) Block
    keys are held as (n, 4) words from here on; a request of token ids is hashed once, by the
    layer that knows its layout's fingerprint (``words``).
    """

    token_ids: Sequence[int] | np.ndarray | None = None
    block_keys: Sequence[bytes] | np.ndarray | None = None
    prompt_len: int = 0
    mode: str = STANDARD
    traffic_class: str = ""
    take_lease: bool = True
    #: The layout the keys are made under (None: the tier's own).
    layout: Layout | None = None
    #: Whose request this is: its lease is kept for this holder, its lookup counted for it.
    holder: LeaseTag = UNTAGGED
    #: Whether the tier counts this lookup in its hit figures; False for the parts of a larger
    #: lookup (a tenant's shared and own namespaces), which the caller counts once.
    counted: bool = True
    #: Ask for the lease's read capability (``DirectGrant``) with the answer: the caller reads
    #: the blocks straight from the storage nodes. Opt-in: a grant of a long prompt weighs
    #: hundreds of KB that a caller reading through ``get_blocks`` would carry for nothing.
    direct: bool = False
    #: The asking engine's own measured prefill rate for this layout, tokens per second (0:
    #: none yet): the tier keeps it for engines that have none (``kvstore.tier.prefill``).
    prefill_tokens_per_s: float = 0.0

    def __post_init__(self) -> None:
        if (self.token_ids is None) == (self.block_keys is None):
            raise InvalidArgument("token_ids", "give token_ids or block_keys (one of them)")
        check_rate("prefill_tokens_per_s", self.prefill_tokens_per_s)
        if self.mode not in MODES:
            raise InvalidArgument("mode", f"must be one of {', '.join(MODES)}, got {self.mode!r}")
        _check_class(self.traffic_class)
        length = self.prompt_len
        if isinstance(length, bool) or not isinstance(length, int | np.integer) or length < 0:
            raise InvalidArgument("prompt_len", f"must be an integer ≥ 0, got {length!r}")
        if self.token_ids is not None:
            if isinstance(self.token_ids, str | bytes | bytearray):
                raise InvalidArgument(
                    "token_ids", f"must be integers, got {type(self.token_ids).__name__}"
                )
            if length not in (0, len(self.token_ids)):
                raise InvalidArgument(
                    "prompt_len", f"{length} differs from the {len(self.token_ids)} token_ids"
                )
            object.__setattr__(self, "prompt_len", len(self.token_ids))
            return
        words = key_words(self.block_keys, "block_keys")  # type: ignore[arg-type]
        full_blocks = int(length) // BLOCK_TOKENS
        if words.shape[0] > full_blocks:
            raise InvalidArgument(
                "prompt_len",
                f"{length} tokens cannot hold the {words.shape[0]} blocks of block_keys "
                f"({words.shape[0] * BLOCK_TOKENS} tokens)",
            )
        object.__setattr__(self, "block_keys", words)
        object.__setattr__(self, "prompt_len", int(length))

    @property
    def length(self) -> int:
        """The prompt's length in tokens."""
        return self.prompt_len

    def block_count(self) -> int:
        """How many full blocks the lookup covers (its keys, or its token ids' full blocks):
        what it costs the tier."""
        if self.block_keys is not None:
            return int(self.block_keys.shape[0])  # type: ignore[union-attr]
        return self.prompt_len // BLOCK_TOKENS

    def words(self, fingerprint: bytes, blocks: int | None = None) -> np.ndarray:
        """The keys of the prompt's first ``blocks`` full blocks (all: None) as (n, 4) words:
        the keys given, or the token ids hashed under ``fingerprint`` (blocks past ``blocks``
        are never hashed)."""
        if self.block_keys is not None:
            given: np.ndarray = self.block_keys  # type: ignore[assignment]
            return given if blocks is None else given[:blocks]
        tokens = self.token_ids
        assert tokens is not None
        if blocks is not None:
            tokens = tokens[: blocks * BLOCK_TOKENS]
        return block_key_words(fingerprint, tokens)

    def with_words(self, words: np.ndarray, **changes: Any) -> HitRequest:
        """This request for the keys ``words`` instead: the same prompt's blocks under another
        name, one for one (a tenant's namespace, its layout's). Not checked again: the keys
        are the checked ones renamed, so every rule held of them holds of these."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields.update(changes, token_ids=None, block_keys=words)
        request = object.__new__(HitRequest)
        for name, value in fields.items():
            object.__setattr__(request, name, value)
        return request


def _check_class(name: object) -> None:
    if not isinstance(name, str):
        raise InvalidArgument("traffic_class", f"must be text, got {type(name).__name__}")
    if len(name) > MAX_CLASS_CHARS:
        raise InvalidArgument(
            "traffic_class", f"at most {MAX_CLASS_CHARS} characters, got {len(name)}"
        )
    if name and not name.isprintable():
        raise InvalidArgument("traffic_class", "must be printable text")


@dataclass(frozen=True, eq=False)
class DirectGrant:
    """What lets an engine read a lease's hit blocks straight from the storage nodes
    (``kvstore.blockstore.direct``): the lease's read capability (``ReadCapability.encode()``;
    the cluster read key stays in the cluster), and per hit block, in the order of the answer's
    hit keys, its key as the tier stores it (a tenant's keys are renamed into its namespace:
    the engine knows only its own), its shards' nodes and its size; the nodes' engine read
    sockets and the stripe geometry."""

    capability: bytes
    #: (n, 4) uint64 words: the stored keys of the hit blocks (``kvstore.keys``).
    keys: np.ndarray
    #: (n, k + m) int32: node id per shard index; -1: lost.
    placements: np.ndarray
    #: (n,) int64: each block's payload size.
    sizes: np.ndarray
    #: node id -> (host, port) of its engine read socket.
    endpoints: Mapping[int, tuple[str, int]]
    k: int
    m: int

    def __post_init__(self) -> None:
        n = int(self.keys.shape[0])
        if (
            self.keys.shape != (n, 4)
            or self.placements.shape != (n, self.k + self.m)
            or self.sizes.shape != (n,)
        ):
            raise InvalidArgument(
                "direct",
                f"keys {self.keys.shape}, placements {self.placements.shape} and sizes "
                f"{self.sizes.shape} do not describe the same {n} blocks of {self.k}+{self.m}",
            )

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    def part(self, first: int, last: int) -> DirectGrant:
        """The grant of blocks ``first`` to ``last`` (exclusive) only (the same capability:
        a load of part of a hit reads with the whole lease's)."""
        return dataclasses.replace(
            self,
            keys=self.keys[first:last],
            placements=self.placements[first:last],
            sizes=self.sizes[first:last],
        )

    def blocks(self) -> list[tuple[BlockKey, tuple[int, ...], int]]:
        """(stored key, placement, size) per block, as ``BlockLocation`` takes them."""
        return [
            (key, tuple(row), size)
            for key, row, size in zip(
                words_to_keys(self.keys), self.placements.tolist(), self.sizes.tolist(), strict=True
            )
        ]


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
    #: With a lease asked for ``direct``ly: what reads its hit blocks from the storage nodes
    #: (None: read through ``get_blocks``; the tier has no read key, or the grant would not fit).
    direct: DirectGrant | None = None
    #: The median prefill rate engines of this tenant reported for this layout, tokens per
    #: second (0: none reported): a fresh engine's compute estimate (``kvstore.engine.worth``).
    prefill_tokens_per_s: float = 0.0
    #: How many of the prompt's full blocks, from its start, the tier holds (past the cap too:
    #: the engine computes those and need not save them again); 0: none, or not looked up.
    stored_blocks: int = 0

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
    #: A miss: what became of its shards, in words (which came, which nodes failed or did not
    #: answer in time), where the tier knows.
    miss_detail: str | None = None

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
