"""A block index as a pyarrow table and back: the snapshot format the GC's dry run, a meta
shard's rebuild and ``kvstore gc --dry-run`` read and write (``index_to_table`` /
``index_from_table``). It reads the index's columns directly: it is the index's own
serialisation, kept apart so the index module stays about lookups and updates (the index does
not know this module)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvstore.blockstore.index import _NO_NODE, BlockIndex
from kvstore.errors import InvalidArgument
from kvstore.keys import KEY_BYTES

SNAPSHOT_FORMAT = "kvstore.block_index.v1"


def index_to_table(index: BlockIndex) -> pa.Table:
    """Every live block as a pyarrow Table (one row per block, rows in ascending order)."""
    rows = index.live_rows()
    placement = index._placement[rows].astype(np.int32)
    placement[placement == _NO_NODE] = -1
    keys = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(KEY_BYTES), len(rows), [None, pa.py_buffer(index._key[rows].tobytes())]
    )
    placements = pa.FixedSizeListArray.from_arrays(
        pa.array(placement.reshape(-1), type=pa.int32()), index._width
    )
    schema_metadata = {
        b"format": SNAPSHOT_FORMAT.encode(),
        b"stripe_width": b"%d" % index._width,
    }
    return pa.table(
        {
            "key": keys,
            "placement": placements,
            "size": pa.array(index._size[rows].astype(np.int64)),
            "class": pa.array(index._class[rows]),
            "created": pa.array(index._created[rows].astype(np.float64)),
            "last_access": pa.array(index._last[rows]),
            "lease_until": pa.array(index._lease_until[rows].astype(np.float64)),
            "lease_count": pa.array(index._lease_count[rows].astype(np.int32)),
        }
    ).replace_schema_metadata(schema_metadata)


def index_from_table(table: pa.Table) -> BlockIndex:
    """Rebuild an index from ``index_to_table``'s output (row numbers are not preserved)."""
    required = (
        "key",
        "placement",
        "size",
        "class",
        "created",
        "last_access",
        "lease_until",
        "lease_count",
    )
    missing = [name for name in required if name not in table.column_names]
    if missing:
        raise InvalidArgument("table", f"missing column(s) {', '.join(missing)}")
    metadata = table.schema.metadata or {}
    if metadata.get(b"format", SNAPSHOT_FORMAT.encode()) != SNAPSHOT_FORMAT.encode():
        raise InvalidArgument("table", f"not a {SNAPSHOT_FORMAT} snapshot")
    placement_type = table.schema.field("placement").type
    if not pa.types.is_fixed_size_list(placement_type):
        raise InvalidArgument("table.placement", "must be a fixed-size list of node ids")
    width = int(placement_type.list_size)
    if not pa.types.is_fixed_size_binary(table.schema.field("key").type) or (
        table.schema.field("key").type.byte_width != KEY_BYTES
    ):
        raise InvalidArgument("table.key", f"must be fixed_size_binary({KEY_BYTES})")
    n = table.num_rows
    index = BlockIndex(stripe_width=width, initial_capacity=max(1, n))
    if n == 0:
        return index
    key_column = table.column("key").combine_chunks()
    key_bytes = key_column.buffers()[1]
    offset = key_column.offset * KEY_BYTES
    keys = np.frombuffer(key_bytes, dtype=np.uint8)[offset : offset + n * KEY_BYTES]
    placement_column = table.column("placement").combine_chunks()
    placements = placement_column.flatten().to_numpy(zero_copy_only=False).reshape(n, width)

    def column(name: str) -> np.ndarray:
        return table.column(name).to_numpy()

    created = column("created")
    rows = index.upsert(
        keys.reshape(n, KEY_BYTES),
        placements,
        column("size").astype(np.int64),
        column("class").astype(np.int64),
        now=float(created.min()) if n else 0.0,
    )
    index._created[rows] = created.astype(np.uint32)
    index._last[rows] = column("last_access").astype(np.float64)
    index._lease_until[rows] = column("lease_until").astype(np.uint32)
    index._lease_count[rows] = column("lease_count").astype(np.uint16)
    return index
