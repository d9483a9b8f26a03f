"""On-disk format of one shard file: a 48-byte node header, then the codec shard verbatim.

The codec shard (``kvstore.ec.shard``) is self-describing: key, stripe index, geometry, payload
length, checksum. The node header adds what the codec does not know and a rebuild needs:

    offset size field
         0    4 magic          b"KVSN"
         4    1 version        1
         5    1 class id       traffic class of the block
         6    2 reserved       zero
         8    8 created        float64 seconds since the epoch (block creation, writer's clock)
        16   16 payload hash   xxh3-128 of the whole block payload
        32    8 writer token   u64 naming the put that wrote it
        40    8 checksum       xxh3-64 of bytes [0, 40)

Why a payload hash on every shard: shards of one key written by two different puts (a re-put
after eviction racing a slow delete, a writer that outlived its reservation) must never be
combined — Reed-Solomon would "decode" them into wrong bytes that every per-shard checksum
accepts. Readers group shards by this hash, decode only within a group and check the decoded
block against it: a mixed or corrupted stripe is a miss, never wrong bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstore.ec.shard import HEADER_BYTES as SHARD_HEADER_BYTES
from kvstore.ec.shard import INDEX_OFFSET, MAGIC, VERSION
from kvstore.errors import CorruptShard

NODE_MAGIC = b"KVSN"
NODE_VERSION = 1
NODE_HEADER_BYTES = 48
_LAYOUT = struct.Struct("<4sBB2sd16sQ8s")
assert _LAYOUT.size == NODE_HEADER_BYTES
_COVERED = 40
#: Where the payload hash sits in a shard file (readers group shards by it).
PAYLOAD_HASH = slice(16, 32)
#: Both headers of a shard file; its fragment follows them.
SHARD_FILE_HEAD_BYTES = NODE_HEADER_BYTES + SHARD_HEADER_BYTES
#: Codec header bytes a node needs without verifying the whole shard (startup scan).
_PAYLOAD_LEN = struct.Struct("<Q")
_PAYLOAD_LEN_OFFSET = 16


def payload_hash(payload: object) -> bytes:
    """The 16-byte block hash stored in every shard's node header."""
    return xxhash.xxh3_128_digest(memoryview(payload).cast("B"))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class NodeHeader:
    class_id: int
    created: float
    payload_hash: bytes
    token: int

    def pack(self) -> bytes:
        head = _LAYOUT.pack(
            NODE_MAGIC,
            NODE_VERSION,
            self.class_id,
            bytes(2),
            self.created,
            self.payload_hash,
            self.token,
            bytes(8),
        )
        return head[:_COVERED] + xxhash.xxh3_64_digest(head[:_COVERED])


def parse_node_header(buf: object) -> NodeHeader:
    """Parse and verify the node header at the start of ``buf`` (raises ``CorruptShard``)."""
    view = memoryview(buf).cast("B")  # type: ignore[arg-type]
    if len(view) < NODE_HEADER_BYTES:
        raise CorruptShard(f"shard file of {len(view)} bytes is shorter than its node header")
    magic, version, class_id, _reserved, created, digest, token, stored = _LAYOUT.unpack_from(view)
    if magic != NODE_MAGIC or version != NODE_VERSION:
        raise CorruptShard(f"bad node header magic/version {bytes(magic)!r}/{version}")
    if stored != xxhash.xxh3_64_digest(view[:_COVERED]):
        raise CorruptShard("node header checksum mismatch")
    return NodeHeader(class_id=class_id, created=created, payload_hash=digest, token=token)


def writes_by_payload(files: Sequence[object | None]) -> tuple[list[tuple[bytes, list[int]]], int]:
    """Which of a stripe's shard files (None: missing) belong to the same write: positions
    grouped by the payload hash in their node headers, largest group first; and how many
    headers were corrupt (those files are left out)."""
    groups: dict[bytes, list[int]] = {}
    corrupt = 0
    for index, file in enumerate(files):
        if file is None:
            continue
        try:
            groups.setdefault(parse_node_header(file).payload_hash, []).append(index)
        except CorruptShard:
            corrupt += 1
    return sorted(groups.items(), key=lambda item: -len(item[1])), corrupt


def shard_view(file_bytes: np.ndarray) -> np.ndarray:
    """The codec shard inside a shard file (a view, no copy)."""
    return file_bytes[NODE_HEADER_BYTES:]


def peek_shard(file_bytes: bytes) -> tuple[int, int]:
    """(stripe index, payload length) from the codec header, unverified (scrub verifies)."""
    if len(file_bytes) < NODE_HEADER_BYTES + SHARD_HEADER_BYTES:
        raise CorruptShard(f"shard file of {len(file_bytes)} bytes is too short")
    base = NODE_HEADER_BYTES
    index = file_bytes[base + INDEX_OFFSET]
    (payload_len,) = _PAYLOAD_LEN.unpack_from(file_bytes, base + _PAYLOAD_LEN_OFFSET)
    return int(index), int(payload_len)


def data_heads_match(
    heads: np.ndarray,
    keys: Sequence[bytes],
    payload_len: int,
    k: int,
    m: int,
    indices: np.ndarray | None = None,
) -> np.ndarray:
    """Which blocks' shard headers fit together, for readers that put fragments straight into
    a block: ``heads[b, j]`` holds the first ``SHARD_FILE_HEAD_BYTES`` of the shard at stripe
    position ``indices[b, j]`` (default ``j``) of block ``b`` (``keys[b]``). True where every
    one is a shard file of this key, at that position, of this geometry and payload length,
    and all carry one payload hash (node and codec header alike). Vectorised: no Python work
    per shard.

    Checksums are not verified here: the caller hashes the block it assembled against that
    payload hash, which covers every byte it returns (what the decoder's fast path does too).
    """
    blocks, width, head = heads.shape
    if head != SHARD_FILE_HEAD_BYTES or len(keys) != blocks:
        raise ValueError(f"heads of shape {heads.shape} for {len(keys)} keys")
    if indices is None:
        positions: np.ndarray = np.arange(width, dtype=np.uint8)
    elif indices.shape != (blocks, width):
        raise ValueError(f"indices of shape {indices.shape} for heads of {heads.shape}")
    else:
        positions = indices
    node_ok = (heads[:, :, :4] == np.frombuffer(NODE_MAGIC, np.uint8)).all(axis=(1, 2))
    node_ok &= (heads[:, :, 4] == NODE_VERSION).all(axis=1)
    digests = heads[:, :, PAYLOAD_HASH]
    node_ok &= (digests == digests[:, :1]).all(axis=(1, 2))
    # Codec header from its magic on (the checksum before it covers bytes we verify whole).
    codec = heads[:, :, NODE_HEADER_BYTES + 8 :]
    expected = np.empty_like(codec)
    expected[:, :, 0:4] = np.frombuffer(MAGIC, np.uint8)
    expected[:, :, 4] = positions
    expected[:, :, 5:8] = (VERSION, k, m)
    expected[:, :, 8:16] = np.frombuffer(payload_len.to_bytes(8, "little"), np.uint8)
    expected[:, :, 16:24] = codec[:, :1, 16:24]  # the codec's payload hash: one per block
    expected[:, :, 24:56] = np.frombuffer(b"".join(keys), np.uint8).reshape(blocks, 1, 32)
    return node_ok & (codec == expected).all(axis=(1, 2))
