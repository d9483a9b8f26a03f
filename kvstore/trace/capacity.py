"""What a block costs on the storage nodes' disks: the one conversion between the block payload
bytes an operator sizes a cache in (and the trace oracles count) and the disk bytes the nodes
hold and the GC bounds."""

from __future__ import annotations

from kvstore.blockstore.segments import RECORD_BYTES
from kvstore.ec import Codec


def disk_bytes_per_block(block_bytes: int, data_shards: int = 10, parity_shards: int = 2) -> int:
    """Disk bytes one committed block of ``block_bytes`` takes over its stripe: each of the
    ``data_shards + parity_shards`` shards is one SHARD record (header + codec shard) in its
    node's log, committed as it was written (``blockstore.client``): what a node's capacity
    counts too (dead bytes awaiting compaction not counted)."""
    shard = Codec(data_shards, parity_shards).shard_length(block_bytes)
    return (data_shards + parity_shards) * (shard + RECORD_BYTES)
