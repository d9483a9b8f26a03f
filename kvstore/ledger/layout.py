"""The per-sequence state block: where every SWA ring and compression accumulator lives
(docs/rules.md §4).

One sequence's state is one contiguous byte block, in this order::

    [stored region:  SWA rings of the stored layers                      ]  <- persisted prefix
    [dropped region: SWA rings of the YoCo consumer layers | fp32 compression state]

- The persisted bytes are exactly the first ``state_size_to_disk`` bytes of a decode-engine (CE)
  block: truncating there excludes the whole dropped region, so no code path can write dropped
  bytes to the store by taking "the whole block".
- Which SWA layers are dropped comes from the model preset only (``consumer_swa_layers``), never
  from the runtime truncation mode: changing ``mask``/``compact``/``off`` never moves a layer.
- Every SWA layer of one engine uses that engine's ring (``GeometryConfig.store_ring``): one
  common slot mapping for all SWA layers, as the article's "consumer SWA keeps the full kvstore
  ring length" requires. On a CE, and on a PE without extra-state, that ring is the inference ring
  (134), so the stored region is ``stored layers × 134 × 528`` = ``state_size_to_disk``. On a PE
  with extra-state the rings are 396 long; ``pe_to_ce`` re-orders both SWA groups into 134-slot
  window order (and copies the compression state verbatim) before anything is persisted.
- ``finalize`` checks the offsets summed while laying out regions against the total computed by
  formula in ``GeometryConfig.state_block_bytes``. A mismatch is a ``LayoutError`` at start-up: the
  alternative is two parts of the engine disagreeing about where a region ends, i.e. silent memory
  corruption.

Ring conventions (the contract between engine, transfer and store):

- PE ring of ``R`` slots: token ``t`` lives in slot ``t % R`` (the ring's origin is token 0).
- CE block in *window order*: for a window anchored at ``a`` (the first token NOT yet in the
  window), slot ``j`` holds token ``a − W + j`` for ``W`` = inference ring = 134; i.e. slot
  ``(t − a) % W``. The window ``[a − 128, a)`` is slots 6..133, the 6 backtracking slots 0..5 hold
  ``[a − 134, a − 128)``, and the CE resumes by writing token ``a`` into slot 0. Slots of tokens
  before 0 are zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.errors import InvalidArgument, LayoutError
from kvstore.geometry import LAYER_KINDS, GeometryConfig
from kvstore.hitplan import prefill_store_position

STORED_SWA = "stored_swa"
CONSUMER_SWA = "consumer_swa"
COMPRESSION = "compression"
#: Region groups in block order; the first is the persisted prefix, the rest are dropped.
GROUPS = (STORED_SWA, CONSUMER_SWA, COMPRESSION)

_ITEMSIZE = {"uint8": 1, "float32": 4}


@dataclass(frozen=True)
class RegionSpec:
    """A region to lay out: what it holds and its shape, before it has an offset."""

    name: str
    group: str
    layer: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        count = 1
        for extent in self.shape:
            count *= extent
        return count * _ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Region:
    """A laid-out region: ``nbytes`` bytes at ``offset`` in the state block."""

    name: str
    group: str
    layer: int
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "group": self.group,
            "layer": self.layer,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "offset": self.offset,
            "nbytes": self.nbytes,
        }


@dataclass(frozen=True)
class StateBlockLayout:
    """Byte offsets of every region of one sequence's state block (build with ``build_layout``)."""

    #: SWA ring length of every SWA region in this block.
    swa_ring: int
    #: The decode-engine ring; a block is persistable as-is only when ``swa_ring`` equals it.
    inference_ring: int
    state_size_to_disk: int
    total_bytes: int
    regions: tuple[Region, ...]

    def region(self, name: str) -> Region:
        for region in self.regions:
            if region.name == name:
                return region
        raise InvalidArgument("name", f"no region {name!r} in this state block layout")

    def regions_of(self, group: str) -> tuple[Region, ...]:
        if group not in GROUPS:
            raise InvalidArgument("group", f"unknown region group {group!r}; known: {GROUPS}")
        return tuple(region for region in self.regions if region.group == group)

    def group_span(self, group: str) -> tuple[int, int]:
        """``(offset, nbytes)`` of a whole group (0 bytes at the group's place when empty)."""
        members = self.regions_of(group)
        if members:
            return members[0].offset, members[-1].end - members[0].offset
        before = [r.end for r in self.regions if GROUPS.index(r.group) < GROUPS.index(group)]
        return (max(before) if before else 0), 0

    @property
    def stored_region_bytes(self) -> int:
        return self.group_span(STORED_SWA)[1]

    @property
    def dropped_offset(self) -> int:
        """Where the dropped region starts (= the stored region's length)."""
        return self.stored_region_bytes

    @property
    def persistable(self) -> bool:
        """True when the first ``state_size_to_disk`` bytes are the stored layers' windows."""
        return self.swa_ring == self.inference_ring

    def new_block(self) -> np.ndarray:
        """A zeroed state block (uint8) of this layout's size."""
        return np.zeros(self.total_bytes, dtype=np.uint8)

    def view(self, block: np.ndarray, name: str) -> np.ndarray:
        """The region ``name`` of ``block`` as a typed array of its shape (shares memory)."""
        region = self.region(name)
        raw = self._check_block(block, "block")[region.offset : region.end]
        return raw.view(np.dtype(region.dtype)).reshape(region.shape)

    def persisted_bytes(self, block: np.ndarray) -> np.ndarray:
        """The bytes to persist: exactly the first ``state_size_to_disk`` bytes of ``block``."""
        if not self.persistable:
            raise LayoutError(
                f"a block with {self.swa_ring}-slot SWA rings is not in inference layout "
                f"({self.inference_ring} slots): re-order it with pe_to_ce before persisting"
            )
        return self._check_block(block, "block")[: self.state_size_to_disk]

    def to_dict(self) -> dict[str, Any]:
        groups: dict[str, dict[str, int]] = {}
        for group in GROUPS:
            offset, nbytes = self.group_span(group)
            count = len(self.regions_of(group))
            groups[group] = {"offset": offset, "nbytes": nbytes, "regions": count}
        return {
            "swa_ring": self.swa_ring,
            "inference_ring": self.inference_ring,
            "state_size_to_disk": self.state_size_to_disk,
            "total_bytes": self.total_bytes,
            "dropped_offset": self.dropped_offset,
            "groups": groups,
            "regions": [region.to_dict() for region in self.regions],
        }

    def _check_block(self, block: np.ndarray, argument: str) -> np.ndarray:
        if not isinstance(block, np.ndarray) or block.dtype != np.uint8 or block.ndim != 1:
            raise InvalidArgument(argument, "must be a one-dimensional uint8 numpy array")
        if block.size != self.total_bytes:
            raise InvalidArgument(
                argument, f"has {block.size} bytes, this layout needs {self.total_bytes}"
            )
        return block


# --- laying out ---------------------------------------------------------------------------------


def swa_region_name(layer: int) -> str:
    return f"swa.{layer}"


def plan_regions(geometry: GeometryConfig) -> list[RegionSpec]:
    """The regions of ``geometry``'s state block, in block order, without offsets."""
    ring, width = geometry.store_ring, geometry.swa_bytes_per_token
    specs = [
        RegionSpec(swa_region_name(layer), group, layer, (ring, 1, width), "uint8")
        for group, layers in (
            (STORED_SWA, geometry.stored_swa_layers),
            (CONSUMER_SWA, geometry.consumer_swa_layers),
        )
        for layer in layers
    ]
    for layer, kind_name in enumerate(geometry.layer_kinds):
        kind = LAYER_KINDS[kind_name]
        if not kind.compress_ratio:
            continue
        if kind.has_indexer:
            shape = geometry.index_state_shape()[1:]
            specs.append(
                RegionSpec(f"{kind_name}.index_state.{layer}", COMPRESSION, layer, shape, "float32")
            )
        shape = geometry.compressed_state_shape(kind_name)[1:]
        specs.append(
            RegionSpec(
                f"{kind_name}.compressed_state.{layer}", COMPRESSION, layer, shape, "float32"
            )
        )
    return specs


def finalize(
    specs: Sequence[RegionSpec],
    *,
    swa_ring: int,
    inference_ring: int,
    state_size_to_disk: int,
    expected_total_bytes: int,
) -> StateBlockLayout:
    """Assign offsets to ``specs`` in order and check the result against the precomputed sizes.

    Raises ``LayoutError`` when the summed offsets drift from ``expected_total_bytes``, when groups
    are out of order (the persisted prefix must come first), when a name repeats, or when an fp32
    region would be misaligned.
    """
    regions: list[Region] = []
    offset = 0
    names: set[str] = set()
    last_group = 0
    for spec in specs:
        if spec.group not in GROUPS:
            raise LayoutError(f"region {spec.name!r} has unknown group {spec.group!r}")
        group_index = GROUPS.index(spec.group)
        if group_index < last_group:
            raise LayoutError(
                f"region {spec.name!r} ({spec.group}) comes after a {GROUPS[last_group]} region: "
                "the persisted stored region must precede the whole dropped region"
            )
        last_group = group_index
        if spec.name in names:
            raise LayoutError(f"region {spec.name!r} is laid out twice")
        names.add(spec.name)
        if offset % _ITEMSIZE[spec.dtype]:
            raise LayoutError(
                f"region {spec.name!r} ({spec.dtype}) would start misaligned at {offset}"
            )
        regions.append(
            Region(spec.name, spec.group, spec.layer, spec.shape, spec.dtype, offset, spec.nbytes)
        )
        offset += spec.nbytes
    if offset != expected_total_bytes:
        raise LayoutError(
            f"state block regions sum to {offset} bytes but the geometry says "
            f"{expected_total_bytes}: layout and size formula disagree"
        )
    layout = StateBlockLayout(swa_ring, inference_ring, state_size_to_disk, offset, tuple(regions))
    if layout.persistable and layout.stored_region_bytes != state_size_to_disk:
        raise LayoutError(
            f"stored region is {layout.stored_region_bytes} bytes but state_size_to_disk is "
            f"{state_size_to_disk}: truncating at state_size_to_disk would not split stored "
            "from dropped"
        )
    return layout


def build_layout(geometry: GeometryConfig) -> StateBlockLayout:
    """The state block layout of ``geometry``'s engine (its SWA rings are ``store_ring`` long)."""
    return finalize(
        plan_regions(geometry),
        swa_ring=geometry.store_ring,
        inference_ring=geometry.inference_ring,
        state_size_to_disk=geometry.state_size_to_disk,
        expected_total_bytes=geometry.state_block_bytes,
    )


# --- PE -> CE transfer ----------------------------------------------------------------------------


def window_token_order(anchor: int, window_ring: int) -> np.ndarray:
    """Token held by each slot of a CE ring in window order: ``anchor − W + j`` for slot ``j``."""
    return np.arange(anchor - window_ring, anchor, dtype=np.int64)


def pe_to_ce(
    pe_block: np.ndarray,
    pe_geometry: GeometryConfig,
    seq_len: int,
    anchor: int | None = None,
) -> np.ndarray:
    """Re-order a prefill engine's state block into the decode engine's block (docs/rules.md §4).

    ``pe_block`` is in ``build_layout(pe_geometry)`` layout; tokens ``0 .. seq_len − 1`` have been
    written into its SWA rings (token ``t`` at slot ``t % store_ring``). Both SWA groups, stored
    and consumer, are re-ordered into window order ending at ``anchor`` (default: the prefill store
    position ``floor((seq_len − 1) / 128) · 128``); the fp32 compression state is copied verbatim.
    Returns a new block in ``build_layout(pe_geometry.for_decode())`` layout, whose first
    ``state_size_to_disk`` bytes are what to persist.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise InvalidArgument("seq_len", f"must be a positive integer, got {seq_len!r}")
    if anchor is None:
        anchor = prefill_store_position(seq_len, block_tokens=pe_geometry.block_tokens)
        if anchor is None:
            raise InvalidArgument(
                "seq_len",
                f"{seq_len} tokens have no aligned store position (needs more than "
                f"{pe_geometry.block_tokens}); pass anchor to transfer anyway",
            )
    if isinstance(anchor, bool) or not isinstance(anchor, int) or not 0 < anchor <= seq_len:
        raise InvalidArgument(
            "anchor", f"must be an integer in [1, seq_len={seq_len}], got {anchor!r}"
        )
    pe_layout = build_layout(pe_geometry)
    ce_geometry = pe_geometry.for_decode()
    ce_layout = build_layout(ce_geometry)
    ring, window_ring = pe_layout.swa_ring, ce_layout.swa_ring
    tokens = window_token_order(anchor, window_ring)
    oldest_kept = seq_len - ring  # tokens before this were overwritten in the PE ring
    if tokens[0] < oldest_kept:
        raise InvalidArgument(
            "anchor",
            f"window [{tokens[0]}, {anchor}) needs token {tokens[0]}, but a {ring}-slot ring "
            f"written up to token {seq_len - 1} keeps only tokens >= {oldest_kept}",
        )
    pe_layout._check_block(pe_block, "pe_block")
    ce_block = ce_layout.new_block()
    valid = tokens >= 0
    source_slots = tokens[valid] % ring
    for region in ce_layout.regions:
        source = pe_layout.region(region.name)
        if region.group == COMPRESSION:
            if source.nbytes != region.nbytes:
                raise LayoutError(f"compression region {region.name!r} differs between PE and CE")
            ce_block[region.offset : region.end] = pe_block[source.offset : source.end]
            continue
        pe_ring = pe_layout.view(pe_block, region.name)
        ce_ring = ce_layout.view(ce_block, region.name)
        ce_ring[valid] = pe_ring[source_slots]
    return ce_block
