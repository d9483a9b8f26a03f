"""``_shardsums.check_sums`` (``kvstore/blockstore/_shardsums.c``): many shards' checksums in
one call, each over its header from byte 8 on, its pieces wherever they landed and its zero
padding; against xxhash, the writer's hash."""

from __future__ import annotations

import random

import numpy as np
import pytest
import xxhash

from kvstore.blockstore import direct
from kvstore.ec.shard import CHECKED_FROM, HEADER_BYTES

sums = direct._sums


def _sealed(head: np.ndarray, pieces: list[np.ndarray], pad: int) -> None:
    """Write into ``head`` the checksum its writer would have: xxh3-64, big-endian."""
    digest = xxhash.xxh3_64(head[CHECKED_FROM:].tobytes())
    for piece in pieces:
        digest.update(piece.tobytes())
    digest.update(bytes(pad))
    head[:CHECKED_FROM] = np.frombuffer(digest.digest(), np.uint8)


def test_the_extension_is_built() -> None:
    assert sums is not None  # the CI machine builds it; direct.py's loop serves without it


def test_every_shard_is_hashed_from_its_pieces_and_padding_and_a_changed_byte_fails() -> None:
    assert sums is not None
    rng = random.Random(7)
    data = np.frombuffer(rng.randbytes(1 << 20), np.uint8).copy()
    shards, width = 200, 3
    heads = np.frombuffer(rng.randbytes(shards * HEADER_BYTES), np.uint8).reshape(shards, -1).copy()
    at = np.zeros((shards, width), np.int64)
    lengths = np.zeros((shards, width), np.int64)
    pads = np.array([rng.choice([0, 0, 1, 63, 5000, 9000]) for _ in range(shards)], np.int64)
    for s in range(shards):
        for p in range(width):
            n = rng.choice([0, 1, 64, 4095, 11_000, 70_000])
            at[s, p] = rng.randrange(len(data) - n + 1)
            lengths[s, p] = n
        _sealed(
            heads[s], [data[a : a + n] for a, n in zip(at[s], lengths[s], strict=True)], pads[s]
        )
    ok = np.zeros(shards, np.uint8)
    head_at = np.arange(shards, dtype=np.int64) * HEADER_BYTES
    sums.check_sums(heads, head_at, data, at, lengths, pads, ok)
    assert ok.all()
    # One byte changed in a piece, in the header's covered part or in the stored sum, or one
    # zero byte of padding more: that shard fails, the others hold.
    wrong = heads.copy()
    wrong[3, CHECKED_FROM + 5] ^= 1
    wrong[4, 0] ^= 0x80
    longer = pads.copy()
    longer[5] += 1
    hit = int(np.flatnonzero(lengths[6])[0])
    data[at[6, hit] + lengths[6, hit] - 1] ^= 0xFF
    sums.check_sums(wrong, head_at, data, at, lengths, longer, ok)
    assert not ok[[3, 4, 5, 6]].any()
    for s in range(shards):  # the others as xxhash has them (a changed byte may be shared)
        digest = xxhash.xxh3_64(wrong[s, CHECKED_FROM:].tobytes())
        for a, n in zip(at[s], lengths[s], strict=True):
            digest.update(data[a : a + n].tobytes())
        digest.update(bytes(int(longer[s])))
        assert bool(ok[s]) == (digest.digest() == wrong[s, :CHECKED_FROM].tobytes()), s
    assert ok.sum() > shards // 2  # most hold: a check that fails everything fails here


def test_a_place_outside_the_buffers_is_refused_not_read() -> None:
    assert sums is not None
    heads = np.zeros((2, HEADER_BYTES), np.uint8)
    data = np.zeros(1000, np.uint8)
    ok = np.zeros(2, np.uint8)
    good = dict(
        head_at=np.array([0, 64]),
        at=np.array([[0], [500]]),
        lengths=np.array([[500], [500]]),
        pads=np.array([0, 0]),
    )
    for name, value in [
        ("head_at", np.array([0, 65])),
        ("head_at", np.array([-64, 0])),
        ("at", np.array([[0], [501]])),
        ("at", np.array([[-1], [0]])),
        ("lengths", np.array([[500], [-1]])),
        ("pads", np.array([0, -1])),
    ]:
        args = {**good, name: value}
        with pytest.raises(ValueError, match="outside"):
            sums.check_sums(
                heads, args["head_at"], data, args["at"], args["lengths"], args["pads"], ok
            )
    with pytest.raises(ValueError, match="expected"):
        sums.check_sums(
            heads,
            good["head_at"],
            data,
            good["at"],
            good["lengths"],
            good["pads"],
            np.zeros(3, np.uint8),
        )
