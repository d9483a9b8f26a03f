"""What readers check across a stripe's shards (``kvstore.ec.shard``): grouping by the payload
hash, so shards of two writes of one key are never combined, and the vectorised header check
for fragments read straight into a block."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvstore.ec import Codec
from kvstore.ec.shard import (
    HEADER_BYTES,
    PAYLOAD_HASH,
    payload_hash,
    writes_by_payload,
)
from kvstore.errors import TooFewShards

CODEC = Codec(10, 2)
BLOCK = 113_920


def _key(i: int) -> bytes:
    return hashlib.blake2b(b"groups" + i.to_bytes(8, "little"), digest_size=32).digest()


def _payload(i: int, size: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def test_payload_hash_is_what_every_shard_of_the_write_carries() -> None:
    payload = _payload(1)
    shards = CODEC.encode(payload, _key(1))
    assert len(payload_hash(payload)) == 8
    assert {shard[PAYLOAD_HASH].tobytes() for shard in shards} == {payload_hash(payload)}
    assert payload_hash(payload.tobytes()) == payload_hash(memoryview(payload))


def test_shards_of_two_writes_of_one_key_are_never_combined() -> None:
    key = _key(1)
    old, new = _payload(1), _payload(2)
    stripe: list[np.ndarray | None] = list(CODEC.encode(old, key))
    foreign = CODEC.encode(new, key)
    for index in (1, 4, 11):  # each shard valid on its own, of a re-put of the same key
        stripe[index] = foreign[index]
    stripe[6] = None  # missing
    groups, corrupt = writes_by_payload(stripe)
    assert corrupt == 0
    assert groups == [
        (payload_hash(old), [0, 2, 3, 5, 7, 8, 9, 10]),  # the largest group first
        (payload_hash(new), [1, 4, 11]),
    ]
    # a reader decodes one group only: 8 shards of the old write are a miss, not a mix
    group = [shard if i in groups[0][1] else None for i, shard in enumerate(stripe)]
    with pytest.raises(TooFewShards):
        CODEC.decode(group, size=BLOCK, key=key)
    # identical bytes written twice are one write: their shards stay interchangeable
    twice = [*CODEC.encode(old, key)[:6], *CODEC.encode(old.copy(), key)[6:]]
    assert writes_by_payload(twice) == ([(payload_hash(old), list(range(12)))], 0)


def test_a_damaged_or_short_header_counts_as_corrupt_and_is_left_out() -> None:
    payload = _payload(3)
    shards = [shard.copy() for shard in CODEC.encode(payload, _key(3))]
    shards[2][9] ^= 1  # magic
    shards[5][13] = 9  # a version this reader does not know
    stripe: list[np.ndarray | None] = list(shards)
    stripe[7] = shards[7][: HEADER_BYTES - 1]  # shorter than a header
    groups, corrupt = writes_by_payload(stripe)
    assert corrupt == 3
    assert groups == [(payload_hash(payload), [0, 1, 3, 4, 6, 8, 9, 10, 11])]
    assert writes_by_payload([None] * 12) == ([], 0)


def _heads(keys: list[bytes], payloads: list[np.ndarray]) -> np.ndarray:
    heads = np.zeros((len(keys), 10, HEADER_BYTES), dtype=np.uint8)
    for b, (key, payload) in enumerate(zip(keys, payloads, strict=True)):
        for i, shard in enumerate(CODEC.encode(payload, key)[:10]):
            heads[b, i] = shard[:HEADER_BYTES]
    return heads
