"""The built-in traffic policy, stated once: TTL per traffic class and the reader's lease.

A leaf (it imports nothing of kvstore): the GC's policy (``kvstore.gc.config``, the same as
``gc/gc.toml``) and the block tier's defaults when it is built alone (``kvstore.blockstore.
config``) both read it, and neither imports the other; a deployment's own policy reaches the
block tier through ``kvstore.config.ServiceConfig``.
"""

from __future__ import annotations

DAY = 86400.0

#: TTL per traffic class, in class-id order (a block's class id is the position of its class
#: here and in ``BlockStoreConfig.traffic_classes``).
DEFAULT_TTL: tuple[tuple[str, float], ...] = (
    ("default", 1 * DAY),
    ("agent", 3 * DAY),
    ("chatbot", 7 * DAY),
)
DEFAULT_CLASSES = tuple(name for name, _ in DEFAULT_TTL)
#: The lease a reader gets, seconds.
DEFAULT_LEASE_S = 30.0
#: The repair order of the built-in classes: longest TTL first (what a reader is likeliest to
#: come back for).
DEFAULT_REPAIR_ORDER = tuple(name for name, _ in sorted(DEFAULT_TTL, key=lambda item: -item[1]))
