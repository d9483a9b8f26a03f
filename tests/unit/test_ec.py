"""kvstore.ec: the 10+2 codec, its shard header, its two backends and its field arithmetic."""

from __future__ import annotations

import ctypes
import itertools
import os
import pickle
import struct
import threading

import numpy as np
import pytest
import xxhash

from kvstore.ec import (
    HEADER_BYTES,
    MAGIC,
    VERSION,
    Codec,
    ShardHeader,
    check_shard,
    fragment_length,
    gf256,
    parse_shard,
    shard_length,
)
from kvstore.ec.backends import IsalBackend, find_isal_library
from kvstore.ec.shard import INDEX_OFFSET, LAYOUT, PAYLOAD_HASH
from kvstore.errors import (
    ConfigError,
    CorruptShard,
    ECError,
    InvalidArgument,
    ShardSizeMismatch,
    TooFewShards,
)
from kvstore.geometry import GeometryConfig
from kvstore.keys import key_hex

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
#: One V4.1-Flash block (114,048 B): 10 fragments of 11,405 B, padded to 11,456.
BLOCK = GeometryConfig.default().block_bytes
#: A block of exactly 10 64-byte-aligned fragments (11,392 B each: no padding).
ALIGNED = 113_920


def payload_of(size: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.fixture(scope="module")
def codec() -> Codec:
    return Codec()


@pytest.fixture(scope="module")
def fallback() -> Codec:
    return Codec(backend="pyeclib")


def restamp(shard: np.ndarray) -> np.ndarray:
    """Recompute a shard's checksum after a deliberate edit (a writer that lies consistently)."""
    fixed = shard.copy()
    fixed[:8] = np.frombuffer(xxhash.xxh3_64_digest(fixed[8:].tobytes()), dtype=np.uint8)
    return fixed


# --- construction ----------------------------------------------------------------------------


def test_default_is_10_plus_2_on_isal(codec: Codec) -> None:
    assert (codec.k, codec.m, codec.total) == (10, 2, 12)
    # The pyeclib wheel bundles ISA-L: a plain pip install gets the direct path.
    assert codec.backend == "isal"
    assert find_isal_library() is not None


@pytest.mark.parametrize(
    ("k", "m", "field"),
    [
        (0, 2, "k"),
        (10, 0, "m"),
        (-1, 2, "k"),
        (10, -3, "m"),
        (True, 2, "k"),
        (2.0, 2, "k"),
        (30, 3, "m"),
        ("10", 2, "k"),
    ],
)
def test_bad_geometry_is_a_config_error(k: object, m: object, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Codec(k=k, m=m)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_unknown_backend_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="backend"):
        Codec(backend="reedsolo")


@pytest.mark.parametrize(("k", "m"), [(1, 1), (4, 2), (6, 3), (10, 2), (12, 4), (28, 4)])
def test_other_geometries_round_trip(k: int, m: int) -> None:
    codec = Codec(k, m)
    payload = payload_of(10_007, seed=k * 100 + m)
    shards = codec.encode(payload, KEY)
    assert len(shards) == k + m
    patterns = list(itertools.combinations(range(k + m), m))
    rng = np.random.default_rng(k * 100 + m)
    for pick in rng.permutation(len(patterns))[:300]:  # every pattern for small codes
        lost = patterns[pick]
        damaged: list[np.ndarray | None] = list(shards)
        for index in lost:
            damaged[index] = None
        assert codec.decode(damaged) == payload
    with pytest.raises(TooFewShards):
        codec.decode([None] * (m + 1) + list(shards[m + 1 :]))


def test_codec_pickles_for_ray_actors(codec: Codec) -> None:
    clone = pickle.loads(pickle.dumps(codec))
    assert (clone.k, clone.m, clone.backend) == (codec.k, codec.m, codec.backend)
    payload = payload_of(5000)
    assert clone.decode(codec.encode(payload, KEY)) == payload


# --- encode ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "expected"), [(BLOCK, 11_456), (ALIGNED, 11_392)])
def test_shards_are_uint8_arrays_of_header_plus_fragment(
    codec: Codec, size: int, expected: int
) -> None:
    shards = codec.encode(payload_of(size), KEY)
    fragment = fragment_length(size, 10)
    assert fragment == expected and fragment % 64 == 0
    for shard in shards:
        assert isinstance(shard, np.ndarray) and shard.dtype == np.uint8 and shard.ndim == 1
        assert shard.size == HEADER_BYTES + fragment == shard_length(size, 10)
        assert codec.shard_length(size) == shard.size


def test_data_shards_hold_the_payload_verbatim(codec: Codec) -> None:
    payload = payload_of(BLOCK, seed=3)
    shards = codec.encode(payload, KEY)
    joined = b"".join(shard[HEADER_BYTES:].tobytes() for shard in shards[:10])
    # Systematic: a healthy read is a concatenation (the last fragment zero-padded).
    assert joined[:BLOCK] == payload and not any(joined[BLOCK:])


@pytest.mark.parametrize(
    "make",
    [
        bytes,
        bytearray,
        memoryview,
        lambda raw: np.frombuffer(raw, dtype=np.uint8),
        lambda raw: np.frombuffer(raw, dtype=np.uint16).reshape(50, -1),
        lambda raw: np.repeat(np.frombuffer(raw, dtype=np.uint8), 2)[::2],  # strided
    ],
    ids=["bytes", "bytearray", "memoryview", "ndarray", "ndarray-u16-2d", "strided"],
)
def test_encode_accepts_any_buffer(codec: Codec, make: object) -> None:
    raw = payload_of(20_000, seed=7)
    shards = codec.encode(make(raw), KEY)  # type: ignore[operator]
    assert codec.decode(shards) == raw


@pytest.mark.parametrize("bad", [None, "text", 42, [1, 2, 3], np.array([object()])])
def test_encode_rejects_non_buffers(codec: Codec, bad: object) -> None:
    with pytest.raises(InvalidArgument, match="payload"):
        codec.encode(bad, KEY)


@pytest.mark.parametrize("bad", [b"short", "x" * 32, None, 12])
def test_encode_rejects_bad_keys(codec: Codec, bad: object) -> None:
    with pytest.raises(InvalidArgument, match="key"):
        codec.encode(b"payload", bad)  # type: ignore[arg-type]


def test_encoding_is_deterministic(codec: Codec) -> None:
    payload = payload_of(4097)
    first, second = codec.encode(payload, KEY), codec.encode(payload, KEY)
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))


def test_empty_payload_round_trips(codec: Codec) -> None:
    shards = codec.encode(b"", KEY)
    assert parse_shard(shards[0]).payload_len == 0
    assert codec.decode([None, None] + shards[2:]) == b""


# --- header ----------------------------------------------------------------------------------


def test_header_layout_is_the_documented_one(codec: Codec) -> None:
    payload = payload_of(BLOCK, seed=1)
    shards = codec.encode(payload, KEY)
    shard = shards[11]
    (stored, magic, index, version, k, m, size, payload_hash, key) = LAYOUT.unpack_from(shard)
    assert LAYOUT.size == HEADER_BYTES == 64
    assert magic == MAGIC == b"KVEC" and version == VERSION == 1
    assert (index, k, m, size, key) == (11, 10, 2, BLOCK, KEY)
    assert shard[INDEX_OFFSET] == 11  # the storage nodes read the index from here
    assert payload_hash == xxhash.xxh3_64_digest(payload)
    assert all(bytes(s[PAYLOAD_HASH]) == payload_hash for s in shards)
    assert stored == xxhash.xxh3_64_digest(shard[8:].tobytes())


def test_parse_shard_reports_every_field(codec: Codec) -> None:
    payload = payload_of(100_003, seed=2)
    shards = codec.encode(payload, KEY)
    header = parse_shard(shards[4])
    assert header == ShardHeader(
        key=KEY,
        index=4,
        k=10,
        m=2,
        payload_len=100_003,
        fragment_len=fragment_length(100_003, 10),
        checksum=int.from_bytes(bytes(shards[4][:8]), "big"),
        version=1,
        payload_hash=xxhash.xxh3_64_intdigest(payload),
    )
    assert header.shard_len == shards[4].size
    assert not header.is_parity and parse_shard(shards[10]).is_parity
    # Any buffer type parses the same.
    assert parse_shard(shards[4].tobytes()) == header
    assert parse_shard(memoryview(shards[4].tobytes())) == header


def test_flipped_bits_in_header_and_fragment_are_caught(codec: Codec) -> None:
    shard = codec.encode(payload_of(3000), KEY)[5]
    for bit in [0, 7, 8 * 8, 8 * 12 + 3, 8 * 20, 8 * 40, 8 * 64, shard.size * 8 - 1]:
        damaged = shard.copy()
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptShard, match="shard"):
            parse_shard(damaged)


def test_truncated_and_extended_shards_are_caught(codec: Codec) -> None:
    shard = codec.encode(payload_of(3000), KEY)[2]
    for length in (0, 10, 63, 64, 65, shard.size - 1):
        with pytest.raises(CorruptShard):
            parse_shard(shard[:length])
    with pytest.raises(CorruptShard, match="truncated or extended"):
        parse_shard(np.concatenate([shard, np.zeros(64, dtype=np.uint8)]))


def test_bad_magic_version_and_geometry_are_named(codec: Codec) -> None:
    shard = codec.encode(payload_of(3000), KEY)[0]
    bad_magic = shard.copy()
    bad_magic[8:12] = np.frombuffer(b"NOPE", dtype=np.uint8)
    with pytest.raises(CorruptShard, match="bad magic"):
        parse_shard(bad_magic)
    bad_version = restamp(shard)
    bad_version[13] = 2
    with pytest.raises(CorruptShard, match="unsupported version 2"):
        parse_shard(restamp(bad_version))
    bad_index = shard.copy()
    bad_index[INDEX_OFFSET] = 12
    with pytest.raises(CorruptShard, match="impossible geometry"):
        parse_shard(restamp(bad_index))


def test_check_shard_expectations_name_block_and_shard(codec: Codec) -> None:
    shard = codec.encode(payload_of(3000), KEY)[3]
    assert check_shard(shard, key=KEY, index=3, k=10, m=2, payload_len=3000).index == 3
    block = key_hex(OTHER_KEY)
    with pytest.raises(CorruptShard, match=f"block {block} shard 3: belongs to block"):
        check_shard(shard, key=OTHER_KEY)
    with pytest.raises(CorruptShard, match="shard 4: header says shard index 3"):
        check_shard(shard, index=4)
    with pytest.raises(CorruptShard, match="k=10, expected k=8"):
        check_shard(shard, k=8)
    with pytest.raises(CorruptShard, match="m=2, expected m=4"):
        check_shard(shard, m=4)
    with pytest.raises(ShardSizeMismatch, match=f"block {key_hex(KEY)} shard 3: payload length"):
        check_shard(shard, payload_len=3001)
    with pytest.raises(InvalidArgument, match="key"):
        check_shard(shard, key=b"short")


def test_errors_are_ec_errors_with_grpc_codes() -> None:
    for error in (TooFewShards, CorruptShard, ShardSizeMismatch):
        assert issubclass(error, ECError)
    assert TooFewShards.grpc_status == "UNAVAILABLE"
    assert CorruptShard.grpc_status == "DATA_LOSS"


# --- decode ----------------------------------------------------------------------------------


def test_decode_accepts_bytes_readonly_arrays_and_memoryviews(codec: Codec) -> None:
    payload = payload_of(BLOCK, seed=5)
    shards = codec.encode(payload, KEY)
    readonly = []
    for shard in shards:
        view = shard.copy()
        view.flags.writeable = False  # what ray.get hands back
        readonly.append(view)
    mixed: list[object] = [None, None] + [
        [bytes, memoryview, lambda s: s][i % 3](s) for i, s in enumerate(shards[2:])
    ]
    assert codec.decode(readonly) == payload
    assert codec.decode([None, None] + readonly[2:]) == payload
    assert codec.decode(mixed, size=BLOCK, key=KEY) == payload


def test_decode_validates_its_arguments(codec: Codec) -> None:
    shards = codec.encode(payload_of(1000), KEY)
    with pytest.raises(InvalidArgument, match="shards"):
        codec.decode(shards[:11])
    with pytest.raises(InvalidArgument, match="size"):
        codec.decode(shards, size=-1)
    with pytest.raises(InvalidArgument, match="size"):
        codec.decode(shards, size="1000")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="key"):
        codec.decode(shards, key=b"short")
    with pytest.raises(InvalidArgument, match=r"shards\[3\]"):
        codec.decode(shards[:3] + ["not a buffer"] + shards[4:])


def test_size_and_key_expectations_turn_a_mismatch_into_a_miss(codec: Codec) -> None:
    shards = codec.encode(payload_of(1000), KEY)
    with pytest.raises(TooFewShards, match=f"block {key_hex(KEY)}"):
        codec.decode(shards, size=999)
    with pytest.raises(TooFewShards, match=f"block {key_hex(OTHER_KEY)}") as caught:
        codec.decode(shards, key=OTHER_KEY)
    assert "belongs to block" in str(caught.value)


def test_too_few_shards_names_the_block_and_each_shard(codec: Codec) -> None:
    shards: list[np.ndarray | None] = list(codec.encode(payload_of(5000), KEY))
    shards[1] = None
    damaged = shards[7]
    assert damaged is not None
    damaged = damaged.copy()
    damaged[200] ^= 0x10
    shards[7] = damaged
    shards[9] = shards[9][:-1]  # type: ignore[index]
    with pytest.raises(TooFewShards) as caught:
        codec.decode(shards)
    message = str(caught.value)
    assert f"block {key_hex(KEY)}" in message and "9 usable shards of 12, need 10" in message
    assert "[1] missing" in message
    assert "shard 7: checksum mismatch" in message
    assert "shard 9: length" in message


def test_shards_in_the_wrong_slot_are_treated_as_missing(codec: Codec) -> None:
    payload = payload_of(BLOCK, seed=9)
    shards = codec.encode(payload, KEY)
    swapped = list(shards)
    swapped[3], swapped[4] = shards[4], shards[3]
    assert codec.decode(swapped) == payload  # 3 and 4 rejected, 10 left
    swapped[5], swapped[6] = shards[6], shards[5]
    with pytest.raises(TooFewShards, match="header says shard index"):
        codec.decode(swapped)


def test_a_stray_shard_first_does_not_hide_the_block(codec: Codec) -> None:
    # The first valid shard decides the fast path; a stray one there must not make the rest
    # look wrong: the general path groups shards by stripe and takes the one with k members.
    payload = payload_of(8000, seed=11)
    stray = codec.encode(payload_of(8000, seed=12), OTHER_KEY)
    shards = codec.encode(payload, KEY)
    assert codec.decode([stray[0]] + shards[1:]) == payload
    assert codec.decode([stray[0], stray[1]] + shards[2:]) == payload
    with pytest.raises(TooFewShards, match="another stripe"):
        codec.decode([stray[0], stray[1], stray[2]] + shards[3:])


def test_shards_of_two_different_writes_are_never_combined(codec: Codec) -> None:
    # Same key, same size, different bytes (say, a re-put with nondeterministic kernels):
    # every shard is valid on its own, but a mix would decode to bytes nobody wrote.
    first, second = payload_of(BLOCK, seed=20), payload_of(BLOCK, seed=21)
    a, b = codec.encode(first, KEY), codec.encode(second, KEY)
    half = a[:6] + b[6:]
    with pytest.raises(TooFewShards, match="another stripe"):
        codec.decode(half)
    assert codec.decode(a[:10] + b[10:]) == first
    assert codec.decode(b[:2] + a[2:]) == first
    # Two writes of identical bytes stay interchangeable.
    again = codec.encode(first, KEY)
    assert codec.decode(a[:6] + again[6:]) == first


def test_a_shard_that_checksums_wrong_bytes_is_outvoted(codec: Codec) -> None:
    # A writer bug: parity 10 holds wrong bytes under a valid checksum. Per-shard checks pass,
    # so only the payload hash can tell; decode must find k shards that agree with it.
    for size in (BLOCK, 100_003):
        payload = payload_of(size, seed=90)
        shards = codec.encode(payload, KEY)
        lying = shards[10].copy()
        lying[HEADER_BYTES + 7] ^= 0x5A
        lying = restamp(lying)
        assert parse_shard(lying).index == 10
        one_lost: list[object] = [None] + shards[1:10] + [lying, shards[11]]
        assert codec.decode(one_lost) == payload
        target = bytearray(size)
        assert codec.decode_into(one_lost, target) == size and bytes(target) == payload
        two_lost: list[object] = [None, None] + shards[2:10] + [lying, shards[11]]
        with pytest.raises(TooFewShards, match="decode to the payload hash"):
            codec.decode(two_lost)


def test_decode_into_writes_a_staging_buffer(codec: Codec) -> None:
    for size in (BLOCK, 100_003, 7):
        payload = payload_of(size, seed=size)
        shards = codec.encode(payload, KEY)
        for lost in ((), (0,), (0, 9), (9, 11)):
            damaged: list[np.ndarray | None] = list(shards)
            for index in lost:
                damaged[index] = None
            target = np.full(size + 100, 0xEE, dtype=np.uint8)
            assert codec.decode_into(damaged, target, key=KEY) == size
            assert target[:size].tobytes() == payload
            assert (target[size:] == 0xEE).all()  # nothing written past the block
    shards = codec.encode(payload_of(BLOCK), KEY)
    with pytest.raises(InvalidArgument, match="out: holds 10 bytes"):
        codec.decode_into(shards, bytearray(10))
    with pytest.raises(InvalidArgument, match="writable"):
        codec.decode_into(shards, bytes(BLOCK))


def test_concurrent_decodes_share_one_codec(codec: Codec) -> None:
    payloads = [payload_of(BLOCK, seed=30 + i) for i in range(4)]
    stripes = [codec.encode(p, KEY) for p in payloads]
    failures: list[str] = []

    def work(worker: int) -> None:
        for round_ in range(40):
            which = (worker + round_) % len(payloads)
            shards: list[np.ndarray | None] = list(stripes[which])
            lost = list(itertools.combinations(range(12), 2))[(worker * 7 + round_) % 66]
            for index in lost:
                shards[index] = None
            if codec.decode(shards) != payloads[which]:
                failures.append(f"worker {worker} round {round_}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


# --- reconstruct and verify --------------------------------------------------------------------


@pytest.mark.parametrize("wanted", [[0], [0, 1], [3, 10], [10, 11], [11], [9, 5]])
def test_reconstruct_rebuilds_identical_shards(codec: Codec, wanted: list[int]) -> None:
    payload = payload_of(100_003, seed=40)
    shards = codec.encode(payload, KEY)
    damaged: list[np.ndarray | None] = list(shards)
    for index in wanted:
        damaged[index] = None
    rebuilt = codec.reconstruct(damaged, wanted, key=KEY)
    assert sorted(rebuilt) == sorted(wanted)
    for index, shard in rebuilt.items():
        assert np.array_equal(shard, shards[index])
        assert check_shard(shard, key=KEY, index=index).payload_len == 100_003


def test_reconstruct_of_present_shards_and_arguments(codec: Codec) -> None:
    shards = codec.encode(payload_of(2000), KEY)
    rebuilt = codec.reconstruct(shards, [2, 2, 11])
    assert sorted(rebuilt) == [2, 11]
    assert np.array_equal(rebuilt[2], shards[2]) and np.array_equal(rebuilt[11], shards[11])
    assert codec.reconstruct(shards, []) == {}
    with pytest.raises(InvalidArgument, match="wanted_indices"):
        codec.reconstruct(shards, [12])
    with pytest.raises(InvalidArgument, match="wanted_indices"):
        codec.reconstruct(shards, [True])
    with pytest.raises(InvalidArgument, match="wanted_indices"):
        codec.reconstruct(shards, 3)  # type: ignore[arg-type]
    with pytest.raises(TooFewShards):
        codec.reconstruct([None, None, None] + shards[3:], [0])


def test_verify_checks_presence_checksums_and_parity(codec: Codec) -> None:
    payload = payload_of(100_003, seed=50)
    shards = codec.encode(payload, KEY)
    assert codec.verify(shards) and codec.verify(shards, key=KEY)
    assert not codec.verify(shards, key=OTHER_KEY)
    assert not codec.verify([None] + shards[1:])
    flipped = shards[10].copy()
    flipped[100] ^= 1
    assert not codec.verify(shards[:10] + [flipped, shards[11]])
    # A parity shard that is internally valid but wrong: only the parity check sees it.
    lying = shards[11].copy()
    lying[HEADER_BYTES] ^= 0xFF
    lying = restamp(lying)
    assert parse_shard(lying).index == 11
    assert not codec.verify(shards[:11] + [lying])
    assert codec.decode(shards[:11] + [lying]) == payload  # decode never needed it
    with pytest.raises(InvalidArgument, match="shards"):
        codec.verify(shards[:5])


def test_verify_rejects_nonzero_padding(codec: Codec) -> None:
    shards = codec.encode(payload_of(1001), KEY)  # fragment 128, payload ends in row 7
    padded = shards[9].copy()
    padded[HEADER_BYTES + 5] = 1
    assert not codec.verify(shards[:9] + [restamp(padded)] + shards[10:])


# --- backends and field arithmetic ---------------------------------------------------------------


def test_both_backends_write_identical_shards(codec: Codec, fallback: Codec) -> None:
    assert fallback.backend == "pyeclib"
    for size in (1, 160, 4097, BLOCK):
        payload = payload_of(size, seed=size)
        ours, theirs = codec.encode(payload, KEY), fallback.encode(payload, KEY)
        assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_backends_decode_each_others_shards(codec: Codec, fallback: Codec) -> None:
    payload = payload_of(100_003, seed=60)
    for writer, reader in ((codec, fallback), (fallback, codec)):
        shards = writer.encode(payload, KEY)
        for lost in ((0, 1), (4, 11), (10, 11), (9,)):
            damaged: list[np.ndarray | None] = list(shards)
            for index in lost:
                damaged[index] = None
            assert reader.decode(damaged) == payload
        rebuilt = reader.reconstruct([None] + shards[1:10] + [None, shards[11]], [0, 10])
        assert np.array_equal(rebuilt[0], shards[0]) and np.array_equal(rebuilt[10], shards[10])
        assert reader.verify(shards)


def _isal() -> ctypes.CDLL:
    library = find_isal_library()
    assert library is not None
    return ctypes.CDLL(library)


def test_gf_multiplication_matches_isal() -> None:
    gf_mul = _isal().gf_mul
    gf_mul.restype = ctypes.c_ubyte
    for a in range(256):
        row = [gf_mul(ctypes.c_ubyte(a), ctypes.c_ubyte(b)) for b in range(256)]
        assert row == gf256.MUL[a].tolist()


def test_cauchy_matrix_matches_isal() -> None:
    generate = _isal().gf_gen_cauchy1_matrix
    for k, m in ((10, 2), (4, 3), (20, 12)):
        out = (ctypes.c_ubyte * ((k + m) * k))()
        generate(out, k + m, k)
        assert bytes(out) == gf256.cauchy_matrix(k, m).tobytes()


def test_gf_inverse_is_an_inverse() -> None:
    rng = np.random.default_rng(70)
    matrix = gf256.cauchy_matrix(10, 2)
    for sources in itertools.combinations(range(12), 10):
        sub = matrix[list(sources)]
        assert np.array_equal(gf256.matmul(gf256.invert(sub), sub), np.eye(10, dtype=np.uint8))
    singular = rng.integers(0, 256, (4, 4), dtype=np.uint8)
    singular[3] = singular[2]
    with pytest.raises(ECError, match="singular"):
        gf256.invert(singular)


def test_isal_backend_self_test_refuses_a_wrong_library(monkeypatch: pytest.MonkeyPatch) -> None:
    library = find_isal_library()
    assert library is not None
    # Pretend the field math says something else: the backend must refuse to run.
    monkeypatch.setattr(gf256, "matmul", lambda left, right: np.zeros((2, 128), np.uint8))
    with pytest.raises(ECError, match="disagrees"):
        IsalBackend(10, 2, library)


def test_pointer_tables_are_native_pointers() -> None:
    from kvstore.ec.backends import pointer_table

    table = pointer_table(1000, 3, 64)
    assert struct.unpack(f"3{'P'}", table) == (1000, 1064, 1128)


def test_reedsolo_is_not_in_the_data_path() -> None:
    import kvstore.ec.backends as backends
    import kvstore.ec.codec as codec_module

    for module in (backends, codec_module):
        source = open(module.__file__ or "", encoding="utf-8").read()
        assert "import reedsolo" not in source and "from reedsolo" not in source


def test_payload_sizes_round_trip_through_fragment_padding(codec: Codec) -> None:
    for size in (1, 63, 64, 639, 640, 641, 6400, 6401):
        payload = os.urandom(size)
        shards = codec.encode(payload, KEY)
        assert codec.decode([None, None] + shards[2:]) == payload
        assert codec.decode(shards[:9] + [None, None, shards[11]]) == payload


def test_without_the_isal_library_auto_falls_back_to_pyeclib(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvstore.ec.backends as backends

    monkeypatch.setattr(backends, "find_isal_library", lambda: None)
    with pytest.raises(ConfigError, match="no libisal"):
        Codec(backend="isal")
    codec = Codec()
    assert codec.backend == "pyeclib"
    payload = payload_of(BLOCK, seed=80)
    assert codec.decode([None, None] + codec.encode(payload, KEY)[2:]) == payload


def test_backend_rebuild_agrees_across_backends(codec: Codec, fallback: Codec) -> None:
    # The raw-fragment interface both backends share (a repair tool may use it directly).
    shards = codec.encode(payload_of(BLOCK, seed=95), KEY)
    fragment_len = fragment_length(BLOCK, 10)
    sources, wanted = (2, 3, 4, 5, 6, 7, 8, 9, 10, 11), (0, 1)
    for backend in (codec._backend, fallback._backend):
        work = bytearray().join(
            [shards[i][HEADER_BYTES:].tobytes() for i in sources] + [bytes(2 * fragment_len)]
        )
        backend.rebuild(sources, wanted, work, fragment_len)
        rebuilt = bytes(work[10 * fragment_len :])
        assert rebuilt == shards[0][HEADER_BYTES:].tobytes() + shards[1][HEADER_BYTES:].tobytes()


@pytest.mark.parametrize("size", [BLOCK, ALIGNED, 100])
def test_encode_many_is_encode_block_by_block(codec: Codec, fallback: Codec, size: int) -> None:
    """A put batch's encode: the same shard bytes as one encode a block, for padded, exact and
    tiny blocks, payloads as bytes and as arrays; mixed sizes and the fallback backend go block
    by block; each block still decodes from any k of its shards."""
    keys = [bytes([i]) * 32 for i in range(5)]
    raw = [payload_of(size, seed) for seed in range(5)]
    payloads: list[object] = [raw[0], *(np.frombuffer(p, np.uint8) for p in raw[1:])]
    for coder in (codec, fallback):
        batch = coder.encode_many(payloads, keys)
        for got, payload, key in zip(batch, payloads, keys, strict=True):
            want = coder.encode(payload, key)
            assert [bytes(row) for row in got] == [bytes(row) for row in want]
            for shard in got:
                check_shard(shard, key=key)
    stripe = codec.encode_many(payloads, keys)[3]
    assert codec.decode([None, None, *stripe[2:]], size, key=keys[3]) == raw[3]
    mixed = [raw[0], payload_of(size + 64, 9)]
    assert [[bytes(r) for r in s] for s in codec.encode_many(mixed, keys[:2])] == [
        [bytes(r) for r in codec.encode(p, key)] for p, key in zip(mixed, keys[:2], strict=True)
    ]
    assert codec.encode_many([], []) == []
    with pytest.raises(InvalidArgument):
        codec.encode_many(payloads, keys[:2])


# A V4 block, one fragment of bytes and a few zeros, fragments exactly full (all k; the first
# two, the rest padding), and a V4 block with one byte short of a whole last fragment.
@pytest.mark.parametrize("size", [BLOCK, 100, 640, 128, 10 * 11_392 - 1])
def test_encode_rows_puts_each_shard_in_the_row_its_rank_names(codec: Codec, size: int) -> None:
    """A writer ranks a batch's shards by node: shard i of block b lands in row rank[b, i],
    byte for byte what ``encode`` makes of it (the padding zeros included, written into
    memory that held other bytes); a rank that is not a permutation is refused."""
    np.full(5 * 12 * codec.shard_length(size) + 64, 0xA5, np.uint8)  # freed: dirty memory
    keys = [bytes([i]) * 32 for i in range(5)]
    payloads = [payload_of(size, seed) for seed in range(5)]
    rank = np.random.default_rng(3).permutation(5 * 12).reshape(5, 12)
    rows = codec.encode_rows(payloads, keys, rank)
    assert rows is not None and rows.shape == (60, codec.shard_length(size))
    for b, (payload, key) in enumerate(zip(payloads, keys, strict=True)):
        for i, shard in enumerate(codec.encode(payload, key)):
            assert bytes(rows[rank[b, i]]) == bytes(shard)
    twice = rank.copy()
    twice[0, 0] = twice[0, 1]
    with pytest.raises(InvalidArgument, match="rank"):
        codec.encode_rows(payloads, keys, twice)
    assert codec.encode_rows([payloads[0], payload_of(size + 64, 9)], keys[:2]) is None


def test_row_sums_in_c_are_the_checksums_the_python_loop_computes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch's shard checksums, one C call (writer and node) or the loop it stands in for."""
    from kvstore.ec import shard as module

    rows = np.random.default_rng(4).integers(0, 256, (9, 64 + 1000), dtype=np.uint8)
    extension = module._sums
    assert extension is not None  # built with the package (CI builds it)
    in_c = module.row_sums(rows)
    monkeypatch.setattr(module, "_sums", None)
    assert module.row_sums(rows) == in_c
    assert in_c == b"".join(xxhash.xxh3_64_digest(bytes(row[8:])) for row in rows)
    with pytest.raises(ValueError):
        extension.row_sums(rows, 1000)  # rows of 1064 bytes are not rows of 1000


def test_a_nodes_batch_check_in_c_is_the_array_passes_and_parse_shard() -> None:
    """A node checks a put's rows in one C call (``_shardsums.check_rows``): for every header
    field damaged (each re-checksummed, so only the field's own check can refuse it), a body
    byte, a key that is not the row's, and sound rows, it finds what the array passes it stands
    in for find, and a row passes exactly when ``parse_shard`` takes it for its key."""
    from kvstore.ec import shard as module

    codec = Codec(10, 2)
    keys = [bytes([n]) * 32 for n in range(4)]
    sound = np.stack([codec.encode(payload_of(4000, n), keys[n])[n + 3] for n in range(4)])
    length = sound.shape[1]
    # (byte, value) set in a row: magic; index past k + m; version; k = 0, m = 0; k + m = 33;
    # payload lengths that need a longer, a shorter and an impossibly long fragment; the key.
    fields = [(8, 0x41), (12, 12), (13, 2), (14, 0), (15, 0), (14, 31), (17, 0x1F), (17, 0),
              (21, 0xFF), (23, 0xFF), (40, 0x41)]  # fmt: skip
    rows, row_keys = [], []
    for n, (at, value) in enumerate(fields):
        row = sound[n % 4].copy()
        row[at] = value
        row[:8] = np.frombuffer(xxhash.xxh3_64_digest(row[8:]), np.uint8)
        rows.append(row)
        row_keys.append(keys[n % 4])
    body = sound[0].copy()
    body[500] ^= 1
    rows += [body, sound[1], *sound]
    row_keys += [keys[0], keys[2], *keys]  # the second: another block's shard
    batch = np.stack(rows)
    words = np.frombuffer(b"".join(row_keys), np.uint8).reshape(len(rows), 32)
    assert module._sums is not None  # built with the package (CI builds it)
    in_c = module.parse_rows(batch, words)
    reference = module._parse_rows_in_arrays(batch, words)
    assert in_c.ok.tolist() == reference.ok.tolist() == [False] * 13 + [True] * 4
    for name in ("index", "payload_len", "payload_hash_raw"):
        assert getattr(in_c, name).tolist() == getattr(reference, name).tolist(), name
    for row, key, ok in zip(rows, row_keys, in_c.ok.tolist(), strict=True):
        try:
            taken = parse_shard(row).key == key
        except CorruptShard:
            taken = False
        assert taken == ok
    with pytest.raises(ValueError):
        module._sums.check_rows(batch, length - 1, words, *(np.empty(17, t) for t in "BqQQ"))


@pytest.mark.parametrize("size", [113_664, 131_072, 6_400, 5_000, 200, 1])
def test_lost_data_rows_are_rebuilt_where_they_lie(codec: Codec, size: int) -> None:
    """``rebuild_in_place``: a payload with any two data rows lost (the partial last row and
    the rows of padding alone included) comes back whole from the rows left in place and the
    parity fragments, and nothing outside the payload is touched."""
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    shards = codec.encode(payload, os.urandom(32))
    fragment = fragment_length(size, codec.k)
    rows = -(-size // fragment)
    parity = {index: shards[index][HEADER_BYTES:] for index in (10, 11)}
    for lost in itertools.combinations(range(codec.k), 2):
        buffer = np.full(size + 128, 0xA5, np.uint8)
        block = buffer[64 : 64 + size]
        block[:] = payload
        for row in lost:
            block[row * fragment : (row + 1) * fragment] = 0x5A
        present = [row for row in range(rows) if row not in lost]
        assert codec.rebuild_in_place(block, present, parity), lost
        assert np.array_equal(block, payload), lost
        assert (buffer[:64] == 0xA5).all() and (buffer[64 + size :] == 0xA5).all()


def test_a_rebuild_short_of_sources_writes_nothing(codec: Codec) -> None:
    payload = np.random.default_rng(5).integers(0, 256, 113_664, dtype=np.uint8)
    shards = codec.encode(payload, os.urandom(32))
    block = payload.copy()
    block[:100] = 0
    present = list(range(2, codec.k))  # rows 0 and 1 lost, one parity fragment
    assert not codec.rebuild_in_place(block, present, {11: shards[11][HEADER_BYTES:]})
    assert not block[:100].any() and np.array_equal(block[100:], payload[100:])
    with pytest.raises(InvalidArgument, match="fragments must be"):
        codec.rebuild_in_place(block, present, {10: shards[10], 11: shards[11]})
