"""The engine's KV cache as kvstore sees it: per layer, one tensor of block rows.

An engine with a paged KV cache (vLLM's) keeps, per attention layer, one tensor whose first
dimension is the block id. kvstore treats one block of one layer as one opaque row of bytes:
``KVRows`` views each layer's tensor as ``[num_blocks, row]`` (8-byte words when the row allows,
since copies of 1-byte elements run several times slower; bytes otherwise), whatever its dtype.

Which rows of layer i a load or a save touches: the request's block ids in a layer of the
full-attention group, the window's block ids of the layer's own group in a sliding-window layer
(``KVLayout`` says which layer is which: block bytes, or state bytes). Swap-in
(``kvstore.engine.swapin``) writes these rows, the save gather (``kvstore.engine.save``) reads
them; both go through this one map.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.engine.kvlayout import KVLayout
from kvstore.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

    from kvstore.engine.groups import EngineGroups


def as_ids(values: Sequence[int] | np.ndarray) -> np.ndarray:
    """Block ids as an int64 array."""
    return np.asarray(values, dtype=np.int64).reshape(-1)


def run_start(ids: np.ndarray) -> int | None:
    """``ids[0]`` when ``ids`` are consecutive ascending (copy them as one span), else None."""
    if ids.size and np.array_equal(ids, np.arange(ids[0], ids[0] + ids.size)):
        return int(ids[0])
    return None


class KVRows:
    """Per-layer row views of an engine's KV cache, in the order ``kv`` names the layers."""

    def __init__(
        self, layers: Sequence[torch.Tensor], kv: KVLayout, window_of: Sequence[int]
    ) -> None:
        if not layers:
            raise InvalidArgument("layers", "needs at least one KV cache tensor")
        if len(layers) != kv.num_layers or len(window_of) != kv.num_layers:
            raise InvalidArgument(
                "layers", f"{len(layers)} tensors for a layout of {kv.num_layers} layers"
            )
        import torch

        num_blocks = int(layers[0].shape[0])
        self.rows: list[torch.Tensor] = []
        for index, tensor in enumerate(layers):
            if int(tensor.shape[0]) != num_blocks:
                raise InvalidArgument(
                    f"layers[{index}]", f"has {tensor.shape[0]} blocks, layer 0 has {num_blocks}"
                )
            if not tensor.is_contiguous():
                raise InvalidArgument(f"layers[{index}]", "block rows must be contiguous")
            raw = tensor.view(num_blocks, -1).view(torch.uint8)
            self.rows.append(raw.view(torch.int64) if raw.shape[1] % 8 == 0 else raw)
        for layer, item in enumerate(kv.layers):
            row = self.row_bytes(layer)
            if item.block_nbytes not in (0, row) or item.state_nbytes % row:
                raise InvalidArgument(
                    f"layers[{layer}]", f"rows of {row} B do not hold the layout's layer {layer}"
                )
        self.kv = kv
        self.window_of = list(window_of)
        self.num_blocks = num_blocks
        self.device: Any = self.rows[0].device
        self.cuda = self.device.type == "cuda"

    @classmethod
    def of(cls, layers: Sequence[torch.Tensor], groups: EngineGroups | None) -> KVRows:
        """The rows of an engine's layers, grouped as ``groups`` says (None: every layer is
        full attention, one block row each)."""
        sizes = [int(t[0].numel()) * t.element_size() if len(t) else 0 for t in layers]
        if groups is None:
            return cls(layers, KVLayout.blocks_only(sizes), [-1] * len(layers))
        pages = set(sizes)
        if len(groups.layer_names) != len(layers) or pages != {groups.page_bytes}:
            raise InvalidArgument(
                "layers",
                f"{len(layers)} tensors of {sorted(pages)} B rows do not match "
                f"{len(groups.layer_names)} layers of {groups.page_bytes} B pages",
            )
        owner = groups.group_of_layer()
        sliding = groups.sliding_groups
        window_of = [sliding.index(g) if g in sliding else -1 for g in owner]
        return cls(layers, groups.kv_layout(), window_of)

    def row_bytes(self, layer: int) -> int:
        rows = self.rows[layer]
        return int(rows.shape[1]) * rows.element_size()

    @property
    def num_layers(self) -> int:
        return len(self.rows)

    def check_ids(self, ids: Sequence[int] | np.ndarray, argument: str) -> np.ndarray:
        array = as_ids(ids)
        if array.size and (array.min() < 0 or array.max() >= self.num_blocks):
            raise InvalidArgument(argument, f"must lie in [0, {self.num_blocks})")
        return array

    def ids_in_layer(
        self, layer: int, block_ids: np.ndarray, windows: Sequence[np.ndarray]
    ) -> np.ndarray:
        """The rows of ``layer`` that hold a request's ``block_ids`` (full-attention layers) or
        its window (a sliding layer: the rows of its group's window); empty when none."""
        item = self.kv.layers[layer]
        if item.block_nbytes:
            return block_ids
        if item.state_nbytes and windows:
            return windows[self.window_of[layer]]
        return as_ids(())

    def host_view(self, staged: np.ndarray, layer: int) -> np.ndarray:
        """Staged bytes of ``layer`` as ``[n, row]`` elements of the layer's row dtype."""
        rows = staged.reshape(-1, self.row_bytes(layer))
        return rows.view(np.int64) if self.rows[layer].element_size() == 8 else rows
