"""Properties of the 10+2 codec: bit-exact or a clean miss, whatever is lost or damaged.

- every pattern of <= 2 missing shards (1 + 12 + 66 = 79) round-trips bit-exactly at the sizes
  of issue 3, through both backends' shards and with shards as numpy arrays, read-only arrays
  (what Ray hands back) and bytes;
- every pattern of 3 missing shards raises TooFewShards naming the block;
- a flipped bit anywhere in any shard is detected: the shard is refused on its own, and a block
  with damaged shards comes back exact or not at all, never as wrong bytes;
- reconstruct gives back exactly the shards that were lost.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.ec import HEADER_BYTES, Codec, parse_shard
from kvstore.errors import CorruptShard, TooFewShards
from kvstore.keys import key_hex

KEY = bytes(range(100, 132))
SIZES = [1, 159, 160, 4097, 100_003, 1_415_040]
UP_TO_TWO = [()] + [lost for count in (1, 2) for lost in itertools.combinations(range(12), count)]
THREE = list(itertools.combinations(range(12), 3))
SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def payload_of(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.fixture(scope="module")
def codec() -> Codec:
    return Codec()


@pytest.fixture(scope="module")
def stripes(codec: Codec) -> dict[int, tuple[bytes, list[np.ndarray]]]:
    return {size: (p := payload_of(size, size), codec.encode(p, KEY)) for size in SIZES}


def readonly(shard: np.ndarray) -> np.ndarray:
    copy = shard.copy()
    copy.flags.writeable = False
    return copy


def test_the_pattern_count_is_79() -> None:
    assert len(UP_TO_TWO) == 79 and len(set(UP_TO_TWO)) == 79
    assert len(THREE) == 220


@pytest.mark.parametrize("size", SIZES)
def test_every_loss_of_up_to_two_shards_round_trips(
    codec: Codec, stripes: dict[int, tuple[bytes, list[np.ndarray]]], size: int
) -> None:
    payload, shards = stripes[size]
    forms = [list(shards), [readonly(s) for s in shards], [s.tobytes() for s in shards]]
    for number, lost in enumerate(UP_TO_TWO):
        damaged: list[object] = list(forms[number % 3])
        for index in lost:
            damaged[index] = None
        assert codec.decode(damaged) == payload, f"size {size}, lost {lost}"
        assert codec.decode(damaged, size=size, key=KEY) == payload, f"size {size}, lost {lost}"


@pytest.mark.parametrize("size", SIZES)
def test_every_loss_of_three_shards_is_a_clean_miss(
    codec: Codec, stripes: dict[int, tuple[bytes, list[np.ndarray]]], size: int
) -> None:
    _, shards = stripes[size]
    for lost in THREE:
        damaged: list[np.ndarray | None] = list(shards)
        for index in lost:
            damaged[index] = None
        with pytest.raises(TooFewShards, match=f"block {key_hex(KEY)}: 9 usable shards"):
            codec.decode(damaged)


@pytest.mark.parametrize("size", [159, 100_003])
def test_pyeclib_fallback_round_trips_every_pattern(size: int) -> None:
    fallback = Codec(backend="pyeclib")
    payload = payload_of(size, seed=size + 1)
    shards = fallback.encode(payload, KEY)
    for lost in UP_TO_TWO:
        damaged: list[np.ndarray | None] = list(shards)
        for index in lost:
            damaged[index] = None
        assert fallback.decode(damaged) == payload, f"lost {lost}"


def test_every_header_bit_of_every_shard_is_covered(codec: Codec) -> None:
    payload = payload_of(4097, seed=5)
    shards = codec.encode(payload, KEY)
    for index, shard in enumerate(shards):
        for bit in range(HEADER_BYTES * 8):
            damaged = shard.copy()
            damaged[bit // 8] ^= 1 << (bit % 8)
            with pytest.raises(CorruptShard):
                parse_shard(damaged)
            stripe: list[np.ndarray] = list(shards)
            stripe[index] = damaged
            assert codec.decode(stripe) == payload
            assert not codec.verify(stripe)


@SETTINGS
@given(
    size=st.sampled_from(SIZES),
    shard=st.integers(0, 11),
    position=st.floats(0, 1, exclude_max=True),
    bit=st.integers(0, 7),
)
def test_a_flipped_fragment_bit_is_detected(
    codec: Codec,
    stripes: dict[int, tuple[bytes, list[np.ndarray]]],
    size: int,
    shard: int,
    position: float,
    bit: int,
) -> None:
    payload, shards = stripes[size]
    original = shards[shard]
    offset = HEADER_BYTES + int(position * (original.size - HEADER_BYTES))
    damaged = original.copy()
    damaged[offset] ^= 1 << bit
    with pytest.raises(CorruptShard, match="checksum mismatch"):
        parse_shard(damaged)
    stripe: list[np.ndarray | None] = list(shards)
    stripe[shard] = damaged
    assert codec.decode(stripe) == payload
    stripe[(shard + 5) % 12] = None  # damaged + missing = 2 down: still exact
    assert codec.decode(stripe) == payload
    stripe[(shard + 7) % 12] = None  # 3 down: a miss, never wrong bytes
    with pytest.raises(TooFewShards):
        codec.decode(stripe)


@SETTINGS
@given(
    k=st.integers(1, 12),
    m=st.integers(1, 4),
    size=st.integers(0, 20_000),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_any_damage_gives_exact_bytes_or_a_miss(
    k: int, m: int, size: int, seed: int, data: st.DataObject
) -> None:
    """Lost, bit-flipped, truncated, misplaced shards and shards of another write of the same
    key: the result is the block of a write that has k intact shards there, or a miss."""
    codec = Codec(k, m)
    payload, other = payload_of(size, seed), payload_of(size, seed + 1)
    written = codec.encode(payload, KEY)
    rewritten = codec.encode(other, KEY)
    shards: list[object] = list(written)
    total = k + m
    lost = data.draw(st.sets(st.integers(0, total - 1), max_size=total), label="lost")
    damaged = data.draw(st.sets(st.integers(0, total - 1), max_size=total), label="damaged")
    rng = np.random.default_rng(seed)
    for index in sorted(damaged):
        shard = np.array(shards[index], dtype=np.uint8)
        kind = rng.integers(0, 4)
        if kind == 0:
            shard[rng.integers(0, shard.size)] ^= 1 << int(rng.integers(0, 8))
            shards[index] = shard
        elif kind == 1:
            shards[index] = shard[: rng.integers(0, shard.size)]  # truncated
        elif kind == 2:
            shards[index] = written[(index + 1) % total]  # wrong slot
        else:
            shards[index] = rewritten[index]  # the same slot of another write
    for index in lost:
        shards[index] = None

    def intact(stripe: list[np.ndarray]) -> int:
        return sum(
            1
            for index, shard in enumerate(shards)
            if shard is not None and np.array_equal(np.asarray(shard), stripe[index])
        )

    try:
        result = codec.decode(shards)
    except TooFewShards:
        assert intact(written) < k and intact(rewritten) < k
    else:
        assert (result == payload and intact(written) >= k) or (
            result == other and intact(rewritten) >= k
        )


@SETTINGS
@given(
    size=st.sampled_from([1, 159, 4097, 100_003]),
    lost=st.sets(st.integers(0, 11), min_size=1, max_size=2),
)
def test_reconstruct_gives_back_the_lost_shards(
    codec: Codec, stripes: dict[int, tuple[bytes, list[np.ndarray]]], size: int, lost: set[int]
) -> None:
    _, shards = stripes[size]
    damaged: list[np.ndarray | None] = list(shards)
    for index in lost:
        damaged[index] = None
    rebuilt = codec.reconstruct(damaged, sorted(lost), key=KEY)
    assert sorted(rebuilt) == sorted(lost)
    for index in lost:
        assert np.array_equal(rebuilt[index], shards[index])
    healed: list[np.ndarray | None] = list(damaged)
    for index, shard in rebuilt.items():
        healed[index] = shard
    assert codec.verify(healed)
