"""Where each model layer's bytes sit in a block payload and in a stored SWA state.

Block payload (what ``put_blocks`` stores for one 128-token block) is **layer-major**: the block-KV
bytes of the first block-KV layer, then the next one's, and so on, in model layer order; layers
without block KV (pure SWA layers, YoCo consumers) contribute nothing. A layer's slice is that
layer's compressed entries for the block (CSA: 32 entries + 32 indexer keys; HCA: 1 entry) exactly
as the engine keeps them in its paged pool. Layer-major is what lets the fetcher publish a layer
as soon as its bytes are in place, and what lets a 10+2 data shard (a contiguous tenth of the
payload) hold whole leading layers.

Stored SWA state (what ``put_swa_state`` stores) is the persisted prefix of the decode-engine state
block (docs/rules.md §4, ``kvstore.ledger.layout``): one ``[inference_ring, 1, swa_bytes]`` window
per stored SWA layer, in layer order, each in window order
(slot j holds token ``anchor − 134 + j``).

Everything is computed from one ``GeometryConfig`` each time; nothing is cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.geometry import GeometryConfig
from kvstore.ledger.layout import STORED_SWA, build_layout


@dataclass(frozen=True)
class LayerBytes:
    """One model layer's share of a block payload and of a stored state."""

    layer: int
    #: Offset and length of this layer's slice in one block payload (length 0: no block KV).
    block_offset: int
    block_nbytes: int
    #: Offset and length of this layer's SWA window in the stored state (length 0: not stored).
    state_offset: int
    state_nbytes: int

    @property
    def empty(self) -> bool:
        """Nothing to load for this layer (a YoCo consumer: rebuilt by compute)."""
        return self.block_nbytes == 0 and self.state_nbytes == 0


@dataclass(frozen=True)
class KVLayout:
    """Per-layer byte map of block payloads and stored states for one geometry."""

    layers: tuple[LayerBytes, ...]
    block_bytes: int
    state_bytes: int
    #: Shape of one stored SWA window: (inference ring, 1, swa bytes per token).
    window_shape: tuple[int, int, int]

    @classmethod
    def from_geometry(cls, geometry: GeometryConfig) -> KVLayout:
        decode = geometry.for_decode()
        state_layout = build_layout(decode)
        state_regions = {r.layer: r for r in state_layout.regions_of(STORED_SWA)}
        layers: list[LayerBytes] = []
        block_offset = 0
        for layer in range(geometry.num_layers):
            block_nbytes = geometry.block_bytes_of_layer(layer)
            region = state_regions.get(layer)
            layers.append(
                LayerBytes(
                    layer=layer,
                    block_offset=block_offset,
                    block_nbytes=block_nbytes,
                    state_offset=region.offset if region else 0,
                    state_nbytes=region.nbytes if region else 0,
                )
            )
            block_offset += block_nbytes
        state_bytes = decode.state_size_to_disk
        # The two byte maps must cover exactly what the geometry says is stored: anything else
        # would put one layer's bytes into another's slot without an error.
        if block_offset != geometry.block_bytes:
            raise InvalidArgument(
                "geometry",
                f"block layers sum to {block_offset} B, geometry says {geometry.block_bytes}",
            )
        if sum(item.state_nbytes for item in layers) != state_bytes:
            raise InvalidArgument("geometry", "stored SWA windows do not sum to state_size_to_disk")
        window = (decode.inference_ring, 1, decode.swa_bytes_per_token)
        return cls(tuple(layers), geometry.block_bytes, state_bytes, window)

    @classmethod
    def blocks_only(cls, layer_block_nbytes: list[int] | tuple[int, ...]) -> KVLayout:
        """The layout of an engine that lays out its own blocks and keeps no SWA state (a vLLM
        model: one entry per attention layer, the bytes of one block of its paged KV cache)."""
        layers: list[LayerBytes] = []
        offset = 0
        for layer, nbytes in enumerate(layer_block_nbytes):
            if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
                raise InvalidArgument(
                    "layer_block_nbytes", f"layer {layer}: must be > 0 bytes, got {nbytes!r}"
                )
            layers.append(LayerBytes(layer, offset, nbytes, 0, 0))
            offset += nbytes
        if not layers:
            raise InvalidArgument("layer_block_nbytes", "needs at least one layer")
        return cls(tuple(layers), offset, 0, (0, 1, 0))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer(self, layer: int) -> LayerBytes:
        if isinstance(layer, bool) or not isinstance(layer, int | np.integer):
            raise InvalidArgument("layer", f"must be an integer, got {type(layer).__name__}")
        if not 0 <= int(layer) < len(self.layers):
            raise InvalidArgument("layer", f"must lie in [0, {len(self.layers)}), got {layer}")
        return self.layers[int(layer)]

    @property
    def block_layers(self) -> tuple[int, ...]:
        """Layers with block KV, in payload order."""
        return tuple(item.layer for item in self.layers if item.block_nbytes)

    @property
    def state_layers(self) -> tuple[int, ...]:
        """Layers whose SWA window is in the stored state, in state order."""
        return tuple(item.layer for item in self.layers if item.state_nbytes)

    def block_slice(self, payload: np.ndarray, layer: int) -> np.ndarray:
        """The ``layer`` slice of one block payload (a view)."""
        item = self.layer(layer)
        return payload[item.block_offset : item.block_offset + item.block_nbytes]

    def state_slice(self, state: np.ndarray, layer: int) -> np.ndarray:
        """The ``layer`` window of one stored state as ``window_shape`` (a view)."""
        item = self.layer(layer)
        raw = state[item.state_offset : item.state_offset + item.state_nbytes]
        return raw.reshape(self.window_shape) if item.state_nbytes else raw

    def pack_block(self, per_layer: dict[int, np.ndarray]) -> np.ndarray:
        """Assemble one block payload from its per-layer slices (every block layer required)."""
        payload = np.empty(self.block_bytes, dtype=np.uint8)
        for layer in self.block_layers:
            piece = per_layer.get(layer)
            item = self.layers[layer]
            if piece is None or piece.size != item.block_nbytes:
                raise InvalidArgument(
                    "per_layer", f"layer {layer} needs {item.block_nbytes} bytes of block KV"
                )
            payload[item.block_offset : item.block_offset + item.block_nbytes] = piece.reshape(-1)
        return payload
