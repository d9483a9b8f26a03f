"""What a direct read's first pass left of the blocks it could not finish, and those blocks
rebuilt where they lie.

With a node down, most blocks of a read lack one data shard; the other k - 1 landed in place in
the caller's buffer, each checked (header, checksum), and the careful pass of ``direct`` asks
the nodes only for the rest (the parity). ``Landed.rebuild`` then decodes the lost rows
straight into place from the rows already there and the parity (``Codec.rebuild_in_place``),
and hashes the block once against its write's payload hash: no array a shard, no second copy of
the rows that came, no per-shard parsing of shards already checked. What it cannot do that way
(fewer than k shards of one write, a damaged or stale shard among the few it needs, no ISA-L)
it leaves to the general decode, with the kept shards made whole again (``shards``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from kvstore.blockstore.readblocks import gathered, put_back
from kvstore.ec.codec import Codec
from kvstore.ec.shard import (
    HEADER_BYTES,
    PAYLOAD_HASH,
    check_shard,
    fragment_length,
    payload_hash,
)
from kvstore.errors import ECError

#: Where block ``b``'s bytes ``begin`` .. ``begin + nbytes`` lie in the read's buffer.
Pieces = Callable[[int, int, int], list[memoryview]]


class Landed:
    """The data shards of a read's blocks that landed in place with their header and checksum
    holding (``usable``: (n, k) bool), their headers (``heads``: (n, k, 64)), where each
    block's bytes went (``pieces``), and the parity shards asked ahead that came whole, not
    yet checked (``ahead``: (block, stripe index) -> shard)."""

    def __init__(
        self,
        heads: np.ndarray,
        usable: np.ndarray,
        sizes: np.ndarray,
        pieces: Pieces,
        ahead: dict[tuple[int, int], np.ndarray],
    ) -> None:
        self.heads = heads
        self.usable = usable
        self.ahead = ahead
        self._sizes = sizes
        self._pieces = pieces
        self._k = usable.shape[1]

    def shards(self, b: int) -> dict[int, np.ndarray]:
        """The usable data shards of block ``b``, each made whole again: its header, its
        fragment from where it landed, the padding (zeros, as encoded)."""
        size = int(self._sizes[b])
        fragment = fragment_length(size, self._k)
        out = {}
        for index in np.flatnonzero(self.usable[b]).tolist():
            shard = np.zeros(HEADER_BYTES + fragment, np.uint8)
            shard[:HEADER_BYTES] = self.heads[b, index]
            at = HEADER_BYTES
            begin = index * fragment
            for piece in self._pieces(b, begin, max(0, min(fragment, size - begin))):
                shard[at : at + len(piece)] = np.frombuffer(piece, np.uint8)
                at += len(piece)
            out[index] = shard
        return out

    def rebuild(
        self,
        codec: Codec,
        b: int,
        key: bytes,
        fresh: Sequence[np.ndarray | None],
        counters: Counter[str],
    ) -> bool:
        """Block ``b`` made whole where it lies from its usable data shards and the whole
        shards ``fresh`` (by stripe index; None: none) the careful pass brought, all of the
        write its usable shards name; True once it hashes to that write. False leaves the
        block to the general decode: its usable rows are as they landed."""
        usable = np.flatnonzero(self.usable[b])
        if not usable.size:
            return False
        writes = self.heads[b, usable, PAYLOAD_HASH]
        if (writes != writes[0]).any():
            return False
        write = writes[0].tobytes()
        k, size = self._k, int(self._sizes[b])
        fragment = fragment_length(size, k)
        places = self._pieces(b, 0, size)
        if len(places) == 1:
            block = np.frombuffer(places[0], np.uint8)
        else:  # cut up (a layer-major load): rebuilt whole, then put back piece by piece
            block = gathered(places, size)
        present = set(usable.tolist())
        parity: dict[int, np.ndarray] = {}
        damaged = 0
        for index, shard in enumerate(fresh):
            if shard is None:
                continue
            try:
                check_shard(shard, key=key, index=index, k=k, m=codec.m, payload_len=size)
            except ECError:
                damaged += 1
                continue
            if shard[PAYLOAD_HASH].tobytes() != write:
                continue
            if index >= k:
                parity[index] = shard[HEADER_BYTES:]
            elif index * fragment < size:
                begin = index * fragment
                block[begin : begin + fragment] = shard[HEADER_BYTES:][: size - begin]
                present.add(index)
        if not codec.rebuild_in_place(block, present, parity):
            return False
        if payload_hash(block) != write:
            return False
        if len(places) > 1:
            put_back(block, places)
        counters["corrupt_shards"] += damaged
        counters["rebuilt_in_place"] += 1
        return True
