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
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstore.ec.shard import HEADER_BYTES as SHARD_HEADER_BYTES
from kvstore.ec.shard import INDEX_OFFSET
from kvstore.errors import CorruptShard

NODE_MAGIC = b"KVSN"
NODE_VERSION = 1
NODE_HEADER_BYTES = 48
_LAYOUT = struct.Struct("<4sBB2sd16sQ8s")
assert _LAYOUT.size == NODE_HEADER_BYTES
_COVERED = 40
#: Where the payload hash sits in a shard file (readers group shards by it).
PAYLOAD_HASH = slice(16, 32)
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
