"""The names and one-line summaries of the chaos scenarios (no Ray import: the CLI parser and
the test markers read this without starting anything)."""

from __future__ import annotations

#: (number, name, summary, part of the default test run)
CATALOG: tuple[tuple[int, str, str, bool], ...] = (
    (1, "kill-two", "kill 1, then 2 storage nodes of a stripe under load", True),
    (2, "kill-three", "kill 3: misses, not errors; QueryHit stops counting", True),
    (3, "restart", "restart killed nodes on their data dirs", False),
    (4, "repair", "permanent machine loss: repair to full redundancy", False),
    (5, "corrupt", "bit flips, torn writes, erased records, broken headers", True),
    (6, "swa", "kill an entrypoint; lose a machine holding SWA states", True),
    (7, "meta", "kill a meta shard: index rebuilt from manifests", False),
    (8, "writer", "kill writers mid-put: nothing partial, space reclaimed", False),
    (9, "gc-lease", "GC racing leased reads", False),
    (10, "slow-node", "a slow node: hedged reads keep get p99 within 2x", False),
    (11, "torn-tail", "a node dies mid-append: torn segment tail cut off", True),
    (12, "segment-corrupt", "noise in the middle of a sealed segment", False),
    (13, "compaction-race", "compaction moving leased blocks under reads", False),
    (14, "restart-200k", "restart a node holding 200k shards: time to serve", False),
    (15, "repair-rate", "lose a node holding 500 MB: restore rate, get p99 during", False),
    (16, "drain", "drain a node under load: 12 shards throughout, then undrain", False),
    (17, "scrub", "background scrub finds flipped bytes; repair restores them", False),
)

#: Scenarios on a multi-host testbed (network namespaces, root only; ``kvstore.chaos.hostrun``):
#: (number, name, summary, run on every CI submission).
HOST_CATALOG: tuple[tuple[int, str, str, bool], ...] = (
    (18, "partition", "a storage host's link down 30 s under load, then back", True),
    (19, "host-crash", "every process of a storage host killed under load", False),
    (20, "head-loss", "the Ray head host lost: what survives, and the restore", False),
)

#: Scenarios that run on a deployment of their own, in this order (repair-rate fills the disks,
#: so it runs last), with these changes to the chaos config: repair-rate's 500 MB a node would be
#: ~2,000 of the default 256 KiB segments each, and the row is to measure the repair, not a
#: node's bookkeeping of that many files. ``kvstore chaos`` and the tests both group them so.
OWN_DEPLOYMENT: tuple[str, ...] = ("drain", "scrub", "repair-rate")
OWN_DEPLOYMENT_CONFIG: dict[str, int] = {"segment_bytes": 16 << 20}

SCENARIO_NAMES: tuple[str, ...] = tuple(name for _, name, _, _ in CATALOG)
HOST_SCENARIO_NAMES: tuple[str, ...] = tuple(name for _, name, _, _ in HOST_CATALOG)
DEFAULT_RUN: tuple[str, ...] = tuple(name for _, name, _, default in CATALOG if default)
