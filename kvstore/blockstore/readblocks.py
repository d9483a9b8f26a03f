"""What a direct read is asked for and where its blocks land: ``ReadBlocks``, a read's blocks
as the arrays a lease holds (keys, shard placements, sizes), and ``Spread``, a layer-major
landing (each block cut at the layer boundaries into its rows of a staging region).
Importable without Ray or any server module."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.blockstore.records import BlockLocation


@dataclass(frozen=True)
class Spread:
    """Where a read's blocks land when not end to end: each block is cut into ``segments``
    ``(offset in the block, bytes, where row 0's piece goes)``, which tile the block from byte
    0, and block i's piece of a segment goes ``rows[i]`` pieces further on. A load's staging
    region is one segment per layer (that layer's slice of every block, block after block:
    ``kvstore.engine.staging``), so the shards land layer-major with no copy after them."""

    segments: tuple[tuple[int, int, int], ...]
    rows: tuple[int, ...]

    @property
    def block_bytes(self) -> int:
        return sum(length for _, length, _ in self.segments)

    def check(self, sizes: np.ndarray, room: int) -> None:
        """Raise ``ValueError`` unless every block fits the segments and no two pieces of the
        read overlap or leave ``room`` bytes."""
        if len(self.rows) != len(sizes):
            raise ValueError(f"spread: {len(self.rows)} rows for {len(sizes)} blocks")
        at = 0
        for offset, length, base in self.segments:
            if offset != at or length <= 0 or base < 0:
                raise ValueError("spread: segments must tile the block from byte 0, in order")
            at += length
        if (sizes != at).any():
            raise ValueError(f"spread: every block must be {at} bytes")
        rows = np.asarray(self.rows, np.int64)
        if rows.size and (rows.min() < 0 or np.unique(rows).size != rows.size):
            raise ValueError("spread: rows must be distinct and >= 0")
        top = int(rows.max(initial=-1)) + 1
        spans = sorted((base, base + top * length) for _, length, base in self.segments)
        if spans and spans[-1][1] > room:
            raise ValueError(f"out: {room} bytes do not hold the blocks where they go")
        if any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False)):
            raise ValueError("spread: two segments overlap (one would overwrite the other)")

    def pieces(self, view: memoryview, row: int, begin: int, nbytes: int) -> list[memoryview]:
        """Where bytes ``begin`` .. ``begin + nbytes`` of the block at ``row`` go, in order."""
        out = []
        end = begin + nbytes
        for offset, length, base in self.segments:
            lo, hi = max(begin, offset), min(end, offset + length)
            if lo < hi:
                at = base + row * length + lo - offset
                out.append(view[at : at + hi - lo])
        return out


class ReadBlocks:
    """A read's blocks as arrays, as a lease (``Lease``) and an engine's grant hold them: each
    block's key (``keys``: (n, 32) uint8, or (n, 4) uint64 words, ``kvstore.keys``), the node
    of each of its shards (``placements``: (n, stripe width or fewer), -1 where none) and its
    size. ``of`` builds one from ``BlockLocation`` objects; a caller that has the arrays hands
    them on, with no Python object a block."""

    __slots__ = ("keys", "placements", "sizes")

    def __init__(self, keys: np.ndarray, placements: np.ndarray, sizes: np.ndarray) -> None:
        sizes = np.asarray(sizes)
        keys = np.asarray(keys)
        placements = np.asarray(placements)
        n = len(sizes)
        if keys.ndim == 2 and keys.dtype == np.uint64 and keys.shape[1] == 4:
            keys = np.ascontiguousarray(keys).view(np.uint8)
        if sizes.ndim != 1 or not np.issubdtype(sizes.dtype, np.integer):
            raise ValueError(
                f"blocks: sizes must be integers, one per block, (n,): {sizes.shape} {sizes.dtype}"
            )
        if keys.shape != (n, 32) or keys.dtype != np.uint8:
            raise ValueError(
                f"blocks: keys of {n} blocks must be (n, 32) uint8 or (n, 4) uint64: "
                f"{keys.shape} {keys.dtype}"
            )
        if placements.ndim != 2 or len(placements) != n:
            raise ValueError(
                f"blocks: placements of {n} blocks must be (n, width): {placements.shape}"
            )
        if not np.issubdtype(placements.dtype, np.integer):
            raise ValueError(f"blocks: placements must be node ids (integers): {placements.dtype}")
        self.keys = keys
        self.placements = placements
        self.sizes = sizes.astype(np.int64, copy=False)

    @classmethod
    def of(cls, blocks: Sequence[BlockLocation]) -> ReadBlocks:
        n = len(blocks)
        keys = b"".join(block.key for block in blocks)
        if len(keys) != 32 * n:
            raise ValueError("blocks: every key must be 32 bytes")
        rows = [block.placement for block in blocks]
        width = max(map(len, rows), default=0)
        if all(len(row) == width for row in rows):
            placements = np.array(rows, np.int64).reshape(n, width)
        else:
            placements = np.full((n, width), -1, np.int64)
            for b, row in enumerate(rows):
                placements[b, : len(row)] = row
        sizes = np.fromiter((block.size for block in blocks), np.int64, n)
        return cls(np.frombuffer(keys, np.uint8).reshape(n, 32), placements, sizes)

    def __len__(self) -> int:
        return len(self.sizes)


def gathered(places: list[memoryview], size: int) -> np.ndarray:
    """A block cut into ``places`` (``Spread.pieces``), copied whole into an array of its own."""
    block = np.empty(size, np.uint8)
    at = 0
    for place in places:
        block[at : at + len(place)] = np.frombuffer(place, np.uint8)
        at += len(place)
    return block


def put_back(block: np.ndarray, places: list[memoryview]) -> None:
    """``block`` (whole) cut up again into ``places``, in order."""
    at = 0
    for place in places:
        place[:] = block[at : at + len(place)].data
        at += len(place)
