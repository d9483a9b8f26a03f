"""Erasure coding 10+2 (ISA-L through pyeclib) with checksummed, versioned shard headers."""

from kvstore.ec.codec import Codec
from kvstore.ec.shard import (
    HEADER_BYTES,
    MAGIC,
    VERSION,
    ShardHeader,
    check_shard,
    fragment_length,
    parse_shard,
    shard_length,
)

__all__ = [
    "HEADER_BYTES",
    "MAGIC",
    "VERSION",
    "Codec",
    "ShardHeader",
    "check_shard",
    "fragment_length",
    "parse_shard",
    "shard_length",
]
