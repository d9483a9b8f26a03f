"""Shard format: a 64-byte versioned, checksummed header followed by one fragment.

A shard describes itself, so a storage node can scrub it and a reader can reject it without
knowing anything else about the stripe::

    offset size field
         0    8 checksum         xxh3-64 of bytes [8, 64 + fragment_len), canonical big-endian
         8    4 magic            b"KVEC"
        12    1 shard index      0..k-1 data, k..k+m-1 parity
        13    1 version          1: this layout, systematic Reed-Solomon with ISA-L's Cauchy
                                 matrix over GF(2^8) (poly 0x11D), xxh3-64, 64-byte fragments
        14    1 k                data shards per stripe
        15    1 m                parity shards per stripe
        16    8 payload_len      bytes of the block (u64, little-endian)
        24    8 payload_hash     xxh3-64 of the whole block, canonical big-endian
        32   32 block key        BlockKey the shard belongs to
        64    F fragment         F = fragment_length(payload_len, k): ceil(payload_len / k)
                                 rounded up to a multiple of 64 (zero padded)

The checksum comes first so that it covers everything after it, magic and header fields and
fragment, in one hash call over one contiguous range: a flipped bit anywhere is caught, and so
is a shard moved to another block (key), stripe position (index) or geometry (k, m). The length
is checked before hashing: a truncated or extended shard never reaches the decoder.

The payload hash does two jobs. It names the *write*: every shard of one encode carries it, so
shards of two puts of the same key with different bytes (each shard valid on its own) are never
combined into a block neither put wrote, while two puts of identical bytes stay interchangeable
(readers group a stripe's shards by it, ``writes_by_payload``, and decode within one group). And
it checks the decoded block end to end: the decoder's fast path compares headers and hashes the
block it returns once, instead of hashing k shards (per-shard checksums are only computed when
that check fails, to find the bad shard), so no path returns bytes that were not written. It is
the one payload hash of the tier: storage nodes read it from here (their manifests carry it, so
a meta shard's rebuild tells writes apart the same way) and this module owns the layout.

Why xxh3-64: measured on this machine, one core, hashing one fragment (GB/s, median):

    fragment     xxh3-64   crc32c (pkg, SSE4.2)   ISA-L crc32_iscsi   zlib.crc32
    11 KiB          30.6          17.2                   12.1              3.8
    138 KiB         58.9          26.4                   25.6              4.1
    1.6 MiB         62.5          27.5                   28.2              4.2

xxh3 is 2.2x faster than the fastest CRC at the sizes we store, its 64 bits make an undetected
random corruption ~2^32 times less likely than a 32-bit CRC, and ``xxhash`` is already a
dependency. ``benchmarks/ec.py`` prints this comparison again with every run.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import xxhash

from kvstore.errors import CorruptShard, InvalidArgument, ShardSizeMismatch
from kvstore.keys import BlockKey, check_key, key_hex

_sums: ModuleType | None
try:  # ``row_sums`` in one C call; without a compiler at install, its loop serves
    from kvstore.blockstore import _shardsums as _sums
except ImportError:  # pragma: no cover - the CI machine builds it
    _sums = None

MAGIC = b"KVEC"
VERSION = 1
HEADER_BYTES = 64
#: Fragments are padded to a multiple of this, so each one starts 64-byte aligned in a stripe
#: buffer and the SIMD loops of ISA-L never run a scalar tail.
FRAGMENT_ALIGN = 64
#: ISA-L takes the fragment length as a C int.
MAX_FRAGMENT_BYTES = 2**31 - FRAGMENT_ALIGN
#: Highest k + m: one byte each in the header, and liberasurecode's limit for the fallback.
MAX_SHARDS = 32

LAYOUT = struct.Struct("<8s4sBBBBQ8s32s")
assert LAYOUT.size == HEADER_BYTES
#: Where the stored checksum sits, and where the bytes it covers start (they run to the end).
SUM = slice(0, 8)
CHECKED_FROM = 8
INDEX_OFFSET = 12
PAYLOAD_HASH = slice(24, 32)
#: Header bytes after the index: the same in every shard of one stripe.
STRIPE_FIELDS = slice(INDEX_OFFSET + 1, HEADER_BYTES)
_MAGIC = slice(CHECKED_FROM, INDEX_OFFSET)
_VERSION_OFFSET = INDEX_OFFSET + 1
#: MAGIC + index byte, the header bytes [8, 13) of shard i, prebuilt for the decode fast path.
MAGIC_AND_INDEX = tuple(MAGIC + bytes((index,)) for index in range(256))


def checksum(covered: memoryview | bytes) -> bytes:
    """The 8-byte checksum of the covered bytes (xxh3-64, canonical big-endian)."""
    return xxhash.xxh3_64_digest(covered)


def row_sums(rows: np.ndarray) -> bytes:
    """The checksums of a batch of equal-length shards ((n, L) uint8, C-contiguous) as a
    writer stores and a node checks them: 8 bytes a row, end to end. One C call
    (``_shardsums.row_sums``, built with the block tier's extensions) instead of a hash call a
    row, which cost ~1 ms of a 64-block put on the writer; the loop here is its reference and
    its stand-in where the extension is not built."""
    if _sums is not None:
        return _sums.row_sums(rows, rows.shape[1])
    flat, length = memoryview(rows.reshape(-1)), rows.shape[1]  # type: ignore[arg-type]
    return b"".join(
        [
            xxhash.xxh3_64_digest(flat[start + CHECKED_FROM : start + length])
            for start in range(0, rows.size, length)
        ]
    )


def payload_hash(payload: object) -> bytes:
    """The 8-byte payload hash every shard of a block's write carries (xxh3-64 of the whole
    payload, canonical big-endian): what readers group a stripe's shards by and check a decoded
    block against. The one payload hash of the tier."""
    return xxhash.xxh3_64_digest(byte_view(payload, "payload"))


def fragment_length(payload_len: int, k: int) -> int:
    """Bytes of one fragment for a payload of ``payload_len`` split k ways (>= 64, 64-aligned)."""
    per_shard = -(-payload_len // k)
    return max(FRAGMENT_ALIGN, -(-per_shard // FRAGMENT_ALIGN) * FRAGMENT_ALIGN)


def shard_length(payload_len: int, k: int) -> int:
    """Bytes of one whole shard (header + fragment)."""
    return HEADER_BYTES + fragment_length(payload_len, k)


@dataclass(frozen=True, slots=True)
class ShardHeader:
    """The parsed, checksum-verified header of one shard."""

    key: BlockKey
    index: int
    k: int
    m: int
    payload_len: int
    fragment_len: int
    checksum: int
    version: int
    #: xxh3-64 of the whole block payload: the same in every shard of one write.
    payload_hash: int

    @property
    def shard_len(self) -> int:
        return HEADER_BYTES + self.fragment_len

    @property
    def is_parity(self) -> bool:
        return self.index >= self.k


def header_bytes(
    key: bytes, index: int, k: int, m: int, payload_len: int, payload_hash: bytes
) -> bytes:
    """The 64 header bytes of a shard, with a zero checksum (filled in over the fragment)."""
    return LAYOUT.pack(bytes(8), MAGIC, index, VERSION, k, m, payload_len, payload_hash, key)


def byte_view(buf: object, argument: str = "shard") -> memoryview:
    """A flat byte view of any buffer (bytes, bytearray, memoryview, numpy array)."""
    try:
        view = memoryview(buf)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(
            argument, f"must be a bytes-like buffer, got {type(buf).__name__}"
        ) from None
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            # Rare (a strided numpy view): one copy buys a flat buffer to hash and slice.
            view = memoryview(view.tobytes())
        view = view.cast("B")
    return view


def _corrupt(key: bytes, index: int | str, reason: str) -> CorruptShard:
    return CorruptShard(f"block {key_hex(key)} shard {index}: {reason}")


def parse_shard(buf: object) -> ShardHeader:
    """Parse and verify one shard: magic, version, geometry, length and checksum.

    Raises ``CorruptShard`` (naming the block the shard claims, and its index) on any failure.
    A shard that passes is internally consistent but may still belong to another block or
    stripe position: ``check_shard`` checks those expectations.
    """
    view = byte_view(buf)
    if len(view) < HEADER_BYTES:
        raise CorruptShard(
            f"block (unknown) shard (unknown): {len(view)} bytes, shorter than the "
            f"{HEADER_BYTES}-byte header"
        )
    (stored, magic, index, version, k, m, payload_len, payload_hash, key) = LAYOUT.unpack_from(view)
    if magic != MAGIC:
        raise _corrupt(key, index, f"bad magic {magic!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise _corrupt(key, index, f"unsupported version {version} (expected {VERSION})")
    if k < 1 or m < 1 or k + m > MAX_SHARDS or index >= k + m:
        raise _corrupt(key, index, f"impossible geometry k={k} m={m} index={index}")
    fragment_len = fragment_length(payload_len, k)
    if len(view) != HEADER_BYTES + fragment_len:
        raise _corrupt(
            key,
            index,
            f"length {len(view)} bytes, expected {HEADER_BYTES} + {fragment_len} for "
            f"{payload_len} bytes split {k} ways (truncated or extended)",
        )
    if stored != checksum(view[CHECKED_FROM:]):
        raise _corrupt(key, index, "checksum mismatch")
    return ShardHeader(
        key=BlockKey(key),
        index=index,
        k=k,
        m=m,
        payload_len=payload_len,
        fragment_len=fragment_len,
        checksum=int.from_bytes(stored, "big"),
        version=version,
        payload_hash=int.from_bytes(payload_hash, "big"),
    )


def check_shard(
    buf: object,
    *,
    key: bytes | None = None,
    index: int | None = None,
    k: int | None = None,
    m: int | None = None,
    payload_len: int | None = None,
) -> ShardHeader:
    """``parse_shard`` plus expectations: the block key, stripe position and geometry.

    A mismatch of key, index, k or m raises ``CorruptShard``; a mismatch of ``payload_len``
    (the shard is valid but belongs to a stripe of another size) raises ``ShardSizeMismatch``.
    Each message names the expected block and the shard.
    """
    expected_key = check_key(key, "key") if key is not None else None
    header = parse_shard(buf)
    named_key = expected_key if expected_key is not None else header.key
    named_index = header.index if index is None else index
    if expected_key is not None and header.key != expected_key:
        raise _corrupt(named_key, named_index, f"belongs to block {key_hex(header.key)}")
    if index is not None and header.index != index:
        raise _corrupt(named_key, named_index, f"header says shard index {header.index}")
    if k is not None and header.k != k:
        raise _corrupt(named_key, named_index, f"header says k={header.k}, expected k={k}")
    if m is not None and header.m != m:
        raise _corrupt(named_key, named_index, f"header says m={header.m}, expected m={m}")
    if payload_len is not None and header.payload_len != payload_len:
        raise ShardSizeMismatch(
            f"block {key_hex(named_key)} shard {named_index}: payload length "
            f"{header.payload_len}, expected {payload_len}"
        )
    return header


def writes_by_payload(
    shards: Sequence[np.ndarray | None],
) -> tuple[list[tuple[bytes, list[int]]], int]:
    """Which of a stripe's shards (None: missing) belong to the same write: stripe positions
    grouped by the payload hash in their headers, largest group first; and how many were
    corrupt (shorter than a header, or not of this magic and version: left out).

    Only the header is looked at, no checksum computed: the decoder checks each shard it uses
    and the caller hashes the decoded block against the group's hash, so a shard whose hash
    field was damaged merely forms a group of its own that never decodes.
    """
    groups: dict[bytes, list[int]] = {}
    corrupt = 0
    for index, shard in enumerate(shards):
        if shard is None:
            continue
        if (
            shard.size < HEADER_BYTES
            or shard[_MAGIC].tobytes() != MAGIC
            or shard[_VERSION_OFFSET] != VERSION
        ):
            corrupt += 1
            continue
        groups.setdefault(shard[PAYLOAD_HASH].tobytes(), []).append(index)
    return sorted(groups.items(), key=lambda item: -len(item[1])), corrupt


__all__ = [
    "CHECKED_FROM",
    "FRAGMENT_ALIGN",
    "HEADER_BYTES",
    "LAYOUT",
    "MAGIC",
    "MAX_SHARDS",
    "PAYLOAD_HASH",
    "VERSION",
    "ShardHeader",
    "byte_view",
    "check_shard",
    "checksum",
    "fragment_length",
    "header_bytes",
    "parse_shard",
    "payload_hash",
    "shard_length",
    "writes_by_payload",
]


@dataclass(frozen=True)
class ShardRows:
    """What ``parse_rows`` found in a batch of shards: per row whether it passed, and the
    fields of its header as arrays (meaningful where it passed)."""

    ok: np.ndarray  # bool
    index: np.ndarray  # stripe position
    payload_len: np.ndarray
    #: The payload hash's 8 bytes read as a little-endian word (as a node's index keeps it).
    payload_hash_raw: np.ndarray


def parse_rows(rows: np.ndarray, keys: np.ndarray) -> ShardRows:
    """``parse_shard`` of every row of ``rows`` ((n, L) uint8, C-contiguous: n shards of one
    length L) at once, and whether each belongs to the key of its row of ``keys`` ((n, 32)
    uint8). The checks are ``parse_shard``'s (magic, version, geometry, length, checksum over
    [8, L)): a storage node takes a batch of shards without a Python object per shard. One C
    pass (``_shardsums.check_rows``; ~20 us for a node's 64 shards of 11 KiB, where the array
    passes below, its reference and its stand-in, took ~95). A row that fails is not ok;
    ``parse_shard`` on it says why."""
    n, length = rows.shape
    if length < HEADER_BYTES or not rows.flags.c_contiguous or rows.dtype != np.uint8:
        raise InvalidArgument("shards", "must be C-contiguous uint8 rows of a whole header")
    if _sums is None:
        return _parse_rows_in_arrays(rows, keys)
    ok = np.empty(n, np.uint8)
    index = np.empty(n, np.int64)
    payload_len = np.empty(n, np.uint64)
    payload_hash_raw = np.empty(n, np.uint64)
    _sums.check_rows(rows, length, keys, ok, index, payload_len, payload_hash_raw)
    return ShardRows(ok.view(np.bool_), index, payload_len, payload_hash_raw)


def _parse_rows_in_arrays(rows: np.ndarray, keys: np.ndarray) -> ShardRows:
    """``parse_rows`` as array passes over the batch."""
    n, length = rows.shape
    head = rows[:, :HEADER_BYTES]
    index = head[:, INDEX_OFFSET].astype(np.int64)
    k = head[:, 14].astype(np.int64)
    m = head[:, 15].astype(np.int64)
    payload_len = np.ascontiguousarray(head[:, 16:24]).view("<u8").reshape(n)
    ok = (head[:, _MAGIC] == np.frombuffer(MAGIC, np.uint8)).all(axis=1)
    ok &= head[:, _VERSION_OFFSET] == VERSION
    ok &= (k >= 1) & (m >= 1) & (k + m <= MAX_SHARDS) & (index < k + m)
    # fragment_length, per row; a length no fragment of L bytes can hold is refused first, so
    # the arithmetic stays in int64.
    ok &= payload_len <= np.uint64(length) * np.maximum(k, 1).astype(np.uint64)
    sized = np.where(ok, payload_len, 0).astype(np.int64)
    per_shard = -(-sized // np.maximum(k, 1))
    fragment = np.maximum(FRAGMENT_ALIGN, -(-per_shard // FRAGMENT_ALIGN) * FRAGMENT_ALIGN)
    ok &= fragment == length - HEADER_BYTES
    ok &= (head[:, 32:HEADER_BYTES] == keys).all(axis=1)
    ok &= (np.frombuffer(row_sums(rows), np.uint8).reshape(n, 8) == head[:, SUM]).all(axis=1)
    payload_hash_raw = np.ascontiguousarray(head[:, PAYLOAD_HASH]).view("<u8").reshape(n)
    return ShardRows(ok, index, payload_len, payload_hash_raw)
