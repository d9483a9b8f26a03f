"""An engine's KV-cache groups as kvstore serves them: what goes to which tier, in which bytes.

vLLM's hybrid KV-cache manager splits a model's attention layers into groups that share one
block table each: full-attention groups (every block of the prefix is kept) and sliding-window
groups (only the blocks of the last window are kept; earlier entries of their table are the null
block). All groups have the same page (one block of one layer, in bytes), and groups alias the
same memory: block id ``b`` of group ``g`` is a row of the layers of ``g`` only. ``EngineGroups``
is that description with no engine imported, and everything kvstore derives from it:

- **Blocks** (the erasure-coded block tier): one payload per 128-token block of the one
  full-attention group, layer-major over its layers (``KVLayout``), under the key chained from
  ``group_fingerprint`` — one key per (group, block).
- **Window state** (the SWA tier, docs/rules.md §11): at a store position p, the rows of every
  sliding-window layer for the ``window_blocks`` blocks that end at p (what a query at p attends
  to), layer-major over the sliding layers. One state serves one position: a shorter hit finds
  the state stored at its own position (``exact-window`` hit mode), never a slice of a longer one.
- **Layout** (``kvstore.tier.records.Layout``): the fingerprint and both exact sizes, which the
  tier uses to keep this model's blocks and states apart from every other model's.

Models kvstore cannot serve exactly are refused here, at start-up, with the reason: more than
one full-attention group, sliding groups of different windows, and any other kind of group
(Mamba state, cross attention, chunked local attention).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvstore.engine.kvlayout import KVLayout, LayerBytes
from kvstore.errors import ConfigError
from kvstore.hitplan import EXACT_WINDOW, FULL_ATTENTION
from kvstore.tier.records import Layout

FULL = "full"
SLIDING = "sliding"


@dataclass(frozen=True)
class CacheGroup:
    """One KV-cache group: its kind, its layers (indexes into ``EngineGroups.layer_names``)
    and, for a sliding group, its window in tokens."""

    kind: str
    layers: tuple[int, ...]
    window: int | None = None


@dataclass(frozen=True)
class EngineGroups:
    """The groups of one engine's KV cache (in the engine's group order)."""

    block_tokens: int
    #: Bytes of one block of one layer (the same in every group).
    page_bytes: int
    #: Every attention layer, in model order.
    layer_names: tuple[str, ...]
    groups: tuple[CacheGroup, ...]

    def __post_init__(self) -> None:
        kinds = [group.kind for group in self.groups]
        unknown = sorted(set(kinds) - {FULL, SLIDING})
        if unknown:
            raise ConfigError("kv_cache_groups", f"kvstore cannot serve {unknown[0]} groups")
        if kinds.count(FULL) != 1:
            raise ConfigError(
                "kv_cache_groups",
                f"kvstore serves models with exactly one full-attention KV cache group, this "
                f"one has {kinds.count(FULL)}",
            )
        windows = {group.window for group in self.groups if group.kind == SLIDING}
        if any(window is None or window < 1 for window in windows):
            raise ConfigError("sliding_window", "a sliding-window group needs a window ≥ 1")
        if len(windows) > 1:
            raise ConfigError(
                "kv_cache_groups",
                f"kvstore serves one sliding window per model, this one has {len(windows)}",
            )
        seen = sorted(layer for group in self.groups for layer in group.layers)
        if seen != list(range(len(self.layer_names))):
            raise ConfigError("kv_cache_groups", "every layer must be in exactly one group")

    # --- which group is which -----------------------------------------------------------

    @property
    def full_group(self) -> int:
        return next(i for i, group in enumerate(self.groups) if group.kind == FULL)

    @property
    def sliding_groups(self) -> tuple[int, ...]:
        return tuple(i for i, group in enumerate(self.groups) if group.kind == SLIDING)

    @property
    def hybrid(self) -> bool:
        return bool(self.sliding_groups)

    @property
    def hit_mode(self) -> str:
        """The hit rule this model needs: a sliding window makes a hit depend on its state."""
        return EXACT_WINDOW if self.hybrid else FULL_ATTENTION

    @property
    def window_blocks(self) -> int:
        """Blocks a query at a block boundary attends to in a sliding layer (0: no window):
        the window's other ``window − 1`` tokens, in whole blocks."""
        if not self.hybrid:
            return 0
        window = self.groups[self.sliding_groups[0]].window
        assert window is not None
        return max(1, -(-(window - 1) // self.block_tokens))

    def group_of_layer(self) -> tuple[int, ...]:
        """For each layer (model order), the index of its group."""
        owner = [0] * len(self.layer_names)
        for index, group in enumerate(self.groups):
            for layer in group.layers:
                owner[layer] = index
        return tuple(owner)

    # --- bytes ---------------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        return self.page_bytes * len(self.groups[self.full_group].layers)

    @property
    def state_bytes(self) -> int:
        sliding = sum(len(self.groups[g].layers) for g in self.sliding_groups)
        return self.page_bytes * self.window_blocks * sliding

    def kv_layout(self) -> KVLayout:
        """Where each layer's bytes sit in a block payload and in a window state."""
        owner = self.group_of_layer()
        layers: list[LayerBytes] = []
        block_at = state_at = 0
        state_nbytes = self.page_bytes * self.window_blocks
        for layer in range(len(self.layer_names)):
            if self.groups[owner[layer]].kind == FULL:
                layers.append(LayerBytes(layer, block_at, self.page_bytes, 0, 0))
                block_at += self.page_bytes
            else:
                layers.append(LayerBytes(layer, 0, 0, state_at, state_nbytes))
                state_at += state_nbytes
        return KVLayout(tuple(layers), block_at, state_at, (self.window_blocks, 1, self.page_bytes))

    def layout(self, fingerprint: bytes) -> Layout:
        """The tier layout of an engine whose layout fingerprint is ``fingerprint``."""
        return Layout(fingerprint, self.block_bytes, self.state_bytes)

    def group_fingerprint(self, fingerprint: bytes) -> bytes:
        """What the full-attention group's block keys are chained from: the engine's
        fingerprint bound to the group, so each (group, block) has a key of its own."""
        label = b"kvstore-group:%d:" % self.full_group
        return hashlib.blake2b(label + fingerprint, digest_size=32).digest()
