"""Device pools: real tensors behind the engine's two ledgers (SPEC §2, §3).

- **Paged block pool** (behind ``PagedBlockLedger``): one ``[num_blocks, layer block bytes]``
  uint8 tensor per block-KV layer. A sequence's block table names rows of these tensors; a load
  scatters staged blocks into the rows of the table, a save gathers them.
- **State slots** (behind ``StateSlotLedger``): per layer the SWA cache ``[S, ring, 1, 528]``
  uint8 (every layer, stored and YoCo-consumer alike), per compressed layer the fp32 accumulators
  (``[S, ring, 2, dim]``, CSA also the index-attn state). A load writes only the stored region
  (the stored layers' windows); the dropped region is rebuilt by compute, never loaded.
- **Decode copy region**: per stored layer a second ``[S, ring, 1, 528]`` tensor. When a decoding
  sequence crosses a 128-token boundary its ring is copied here (device to device, in the step);
  the state stored at request end is read from this copy, so the save never races the ring the
  decode keeps writing (SPEC §6).

Ring convention: each slot has an *origin* token; token t sits in ring slot ``(t − origin) % R``.
A fresh sequence has origin 0 (the prefill engine's ``t % R``). Loading a window anchored at a
sets origin = a, so the stored window (slot j = token a − 134 + j) lands in the ring's last 134
slots as one contiguous copy, and on a decode engine (R = 134) it is a verbatim copy, the
window-order convention of ``kvstore.ledger.layout``.

The pools also remember which blocks hold *loaded* content (the key they were loaded under): a
block that failed to load is never marked, whatever bytes it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.errors import InvalidArgument, LayoutError
from kvstore.geometry import LAYER_KINDS, GeometryConfig
from kvstore.gpu._torch import torch_module
from kvstore.gpu.kvlayout import KVLayout
from kvstore.keys import KEY_BYTES, BlockKey, check_key
from kvstore.ledger.blocks import PagedBlockLedger
from kvstore.ledger.slots import StateSlotLedger

if TYPE_CHECKING:
    import torch


class DevicePools:
    """Block and state tensors on one device, plus the host-side facts swap-in and save need."""

    def __init__(
        self,
        geometry: GeometryConfig,
        num_blocks: int,
        *,
        device: str = "cpu",
        block_ledger: PagedBlockLedger | None = None,
        slot_ledger: StateSlotLedger | None = None,
    ) -> None:
        th = torch_module()
        self.geometry = geometry
        self.kv = KVLayout.from_geometry(geometry)
        self.device = th.device(device)
        if self.device.type == "cuda" and not th.cuda.is_available():
            raise InvalidArgument("device", f"{device}: CUDA is not available here")
        self.blocks = block_ledger if block_ledger is not None else PagedBlockLedger(num_blocks)
        self.slots = (
            slot_ledger if slot_ledger is not None else StateSlotLedger(geometry.num_state_seqs)
        )
        if self.blocks.num_blocks != num_blocks:
            raise InvalidArgument(
                "block_ledger", f"has {self.blocks.num_blocks} blocks, pools have {num_blocks}"
            )
        if self.slots.num_slots != geometry.num_state_seqs:
            raise InvalidArgument(
                "slot_ledger",
                f"has {self.slots.num_slots} slots, geometry has {geometry.num_state_seqs}",
            )
        self.num_blocks = num_blocks
        if self.ring < self.window_ring:
            raise LayoutError(f"SWA ring {self.ring} is shorter than the stored window")

        def zeros(shape: tuple[int, ...], dtype: Any) -> torch.Tensor:
            return th.zeros(shape, dtype=dtype, device=self.device)

        u8, f32 = th.uint8, th.float32
        self.block_kv: dict[int, torch.Tensor] = {
            layer: zeros((num_blocks, self.kv.layers[layer].block_nbytes), u8)
            for layer in self.kv.block_layers
        }
        swa_shape = geometry.swa_cache_shape()
        self.swa: list[torch.Tensor] = [zeros(swa_shape, u8) for _ in range(geometry.num_layers)]
        self.snapshot: dict[int, torch.Tensor] = {
            layer: zeros(swa_shape, u8) for layer in self.kv.state_layers
        }
        self.index_state: dict[int, torch.Tensor] = {}
        self.compressed_state: dict[int, torch.Tensor] = {}
        for layer, kind in enumerate(geometry.layer_kinds):
            if not LAYER_KINDS[kind].compress_ratio:
                continue
            if LAYER_KINDS[kind].has_indexer:
                self.index_state[layer] = zeros(geometry.index_state_shape(), f32)
            self.compressed_state[layer] = zeros(geometry.compressed_state_shape(kind), f32)
        # Which rows hold loaded content, and under which key: arrays, so marking a whole load
        # is two vectorised writes (the copy thread must not hold the GIL for long).
        self._loaded = np.zeros(num_blocks, dtype=bool)
        self._loaded_keys = np.zeros((num_blocks, KEY_BYTES), dtype=np.uint8)
        self._origin = np.zeros(geometry.num_state_seqs, dtype=np.int64)
        # Per slot: (copy position, ring origin at copy time) of the last decode snapshot.
        self._snapshot_at: list[tuple[int, int] | None] = [None] * geometry.num_state_seqs
        self._state_loaded_at: list[int | None] = [None] * geometry.num_state_seqs

    # --- shapes ----------------------------------------------------------------------------

    @property
    def ring(self) -> int:
        """This engine's SWA ring (134 on a decode engine, 396 on a prefill engine with extra)."""
        return self.geometry.store_ring

    @property
    def window_ring(self) -> int:
        """Slots of a stored window: window + backtracking (134)."""
        return self.geometry.inference_ring

    @property
    def num_slots(self) -> int:
        return self.geometry.num_state_seqs

    def nbytes(self) -> int:
        tensors = [*self.block_kv.values(), *self.swa, *self.snapshot.values()]
        tensors += [*self.index_state.values(), *self.compressed_state.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    # --- checks ----------------------------------------------------------------------------

    def check_block_ids(self, block_ids: Any, argument: str = "block_ids") -> np.ndarray:
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise InvalidArgument(argument, f"must lie in [0, {self.num_blocks})")
        return ids

    def check_slot(self, slot: object) -> int:
        if isinstance(slot, bool) or not isinstance(slot, int | np.integer):
            raise InvalidArgument("slot", f"must be an integer, got {type(slot).__name__}")
        if not 0 <= int(slot) < self.num_slots:
            raise InvalidArgument("slot", f"must lie in [0, {self.num_slots}), got {slot}")
        return int(slot)

    # --- block pool ------------------------------------------------------------------------

    def block_layer(self, layer: int) -> torch.Tensor:
        if layer not in self.block_kv:
            raise InvalidArgument("layer", f"layer {layer} has no block KV")
        return self.block_kv[layer]

    def read_blocks(self, layer: int, block_ids: Any) -> torch.Tensor:
        """``[len(block_ids), layer bytes]``: the rows of ``block_ids`` (a copy)."""
        ids = self.check_block_ids(block_ids)
        index = torch_module().as_tensor(ids, device=self.device)
        return self.block_layer(layer).index_select(0, index)

    def write_blocks(self, layer: int, block_ids: Any, rows: torch.Tensor) -> None:
        """Scatter ``rows`` (``[n, layer bytes]``, any device) into the pool rows ``block_ids``."""
        ids = self.check_block_ids(block_ids)
        pool = self.block_layer(layer)
        if tuple(rows.shape) != (ids.size, pool.shape[1]):
            raise InvalidArgument(
                "rows", f"shape {tuple(rows.shape)}, expected {(ids.size, pool.shape[1])}"
            )
        index = torch_module().as_tensor(ids, device=self.device)
        pool.index_copy_(0, index, rows.to(self.device, non_blocking=True))

    # --- loaded markers ---------------------------------------------------------------------

    def mark_loaded(self, block_ids: Any, keys: Sequence[bytes] | np.ndarray) -> None:
        """Rows ``block_ids`` now hold the content of ``keys`` (one key per row: 32-byte keys,
        or an ``[n, 32]`` uint8 array of them, see ``key_rows``)."""
        ids = self.check_block_ids(block_ids)
        rows = keys if isinstance(keys, np.ndarray) else key_rows(keys)
        if rows.shape != (ids.size, KEY_BYTES) or rows.dtype != np.uint8:
            raise InvalidArgument("keys", f"{rows.shape[0]} keys for {ids.size} blocks")
        self._loaded_keys[ids] = rows
        self._loaded[ids] = True

    def forget_loaded(self, block_ids: Any) -> None:
        self._loaded[self.check_block_ids(block_ids)] = False

    def loaded_key(self, block_id: int) -> BlockKey | None:
        """The key ``block_id`` was loaded under (None: not loaded, or the load failed)."""
        row = int(self.check_block_ids([block_id])[0])
        return BlockKey(self._loaded_keys[row].tobytes()) if self._loaded[row] else None

    def is_loaded(self, block_id: int) -> bool:
        return self.loaded_key(block_id) is not None

    # --- state slots -------------------------------------------------------------------------

    def ring_origin(self, slot: int) -> int:
        return int(self._origin[self.check_slot(slot)])

    def set_ring_origin(self, slot: int, origin: int) -> None:
        """Which token sits in ring slot 0 of ``slot`` (the engine's write convention)."""
        self._origin[self.check_slot(slot)] = int(origin)

    def ring_slots(self, slot: int, tokens: np.ndarray, *, origin: int | None = None) -> np.ndarray:
        """Ring positions of ``tokens`` in ``slot``: ``(t − origin) % ring``."""
        base = self.ring_origin(slot) if origin is None else origin
        return np.mod(np.asarray(tokens, dtype=np.int64) - base, self.ring)

    def window_tokens(self, anchor: int) -> np.ndarray:
        """Tokens of the stored window anchored at ``anchor``: slot j holds ``anchor − 134 + j``."""
        return np.arange(anchor - self.window_ring, anchor, dtype=np.int64)

    def write_window(self, layer: int, slot: int, window: torch.Tensor) -> None:
        """Put a stored window into ``slot``'s ring for ``layer``, at origin = its anchor.

        With origin = anchor, window slot j (token anchor − 134 + j) goes to ring slot
        ``(j − 134) % ring``: the ring's last 134 slots, one contiguous copy.
        """
        slot = self.check_slot(slot)
        if tuple(window.shape) != self.kv.window_shape:
            raise InvalidArgument("window", f"shape {tuple(window.shape)}, expected window shape")
        start = self.ring - self.window_ring
        # Straight into the ring (host → device when ``window`` is on the host, async when it
        # is pinned): no intermediate device buffer.
        self.swa[layer][slot, start:].copy_(window, non_blocking=True)

    def note_state_loaded(self, slot: int, anchor: int | None) -> None:
        self._state_loaded_at[self.check_slot(slot)] = anchor

    def state_loaded_at(self, slot: int) -> int | None:
        """Anchor of the window last loaded into ``slot`` (None: no loaded state)."""
        return self._state_loaded_at[self.check_slot(slot)]

    def window_positions(
        self, slot: int, anchor: int, *, written: int, from_snapshot: bool = False
    ) -> np.ndarray:
        """Ring positions holding the stored window anchored at ``anchor``, in window order.

        ``written`` is how many tokens had been written into the ring (the sequence length);
        with ``from_snapshot`` the decode copy's own position is used instead. The window's 128
        tokens ``[anchor − 128, anchor)`` must still be in the ring; the 6 backtracking slots
        may already hold newer tokens (the ≤ 5-token decode overrun the spare slots absorb,
        SPEC §6). Raises ``InvalidArgument`` naming the anchor when the window is not there.
        """
        slot = self.check_slot(slot)
        origin = self.ring_origin(slot)
        if from_snapshot:
            info = self._snapshot_at[slot]
            if info is None:
                raise InvalidArgument("slot", f"slot {slot} has no decode snapshot")
            written, origin = info
        window_start = anchor - self.geometry.window
        if not (0 < anchor <= written and window_start >= written - self.ring):
            raise InvalidArgument(
                "anchor",
                f"window [{window_start}, {anchor}) is not in a {self.ring}-slot ring written up "
                f"to token {written}",
            )
        return self.ring_slots(slot, self.window_tokens(anchor), origin=origin)

    def gather_window(
        self, layer: int, slot: int, anchor: int, *, written: int, from_snapshot: bool = False
    ) -> torch.Tensor:
        """The stored window anchored at ``anchor`` read out of ``slot``'s ring (or its decode
        copy): ``[134, 1, swa bytes]`` in window order, on the pools' device."""
        positions = self.window_positions(
            slot, anchor, written=written, from_snapshot=from_snapshot
        )
        source = self.snapshot[layer] if from_snapshot else self.swa[layer]
        index = torch_module().as_tensor(positions, device=self.device)
        return source[self.check_slot(slot)].index_select(0, index)

    def snapshot_window(self, slot: int, position: int) -> None:
        """Decode boundary copy: copy ``slot``'s stored-layer rings into the copy region.

        ``position`` is the sequence length at the copy (a boundary plus ≤ 5 tokens). Runs on the
        caller's (compute) stream: a device-to-device copy inside the step, no host sync.
        """
        slot = self.check_slot(slot)
        for layer, copy in self.snapshot.items():
            copy[slot].copy_(self.swa[layer][slot])
        self._snapshot_at[slot] = (int(position), self.ring_origin(slot))

    def snapshot_position(self, slot: int) -> int | None:
        info = self._snapshot_at[self.check_slot(slot)]
        return None if info is None else info[0]

    def reset_slot(self, slot: int) -> None:
        """Forget a slot's origin, snapshot and loaded state (when its sequence ends)."""
        slot = self.check_slot(slot)
        self._origin[slot] = 0
        self._snapshot_at[slot] = None
        self._state_loaded_at[slot] = None


def key_rows(keys: Sequence[bytes]) -> np.ndarray:
    """Validated 32-byte keys as an ``[n, 32]`` uint8 array."""
    joined = b"".join(check_key(key, f"keys[{i}]") for i, key in enumerate(keys))
    return np.frombuffer(joined, dtype=np.uint8).reshape(-1, KEY_BYTES)
