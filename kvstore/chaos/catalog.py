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
)

SCENARIO_NAMES: tuple[str, ...] = tuple(name for _, name, _, _ in CATALOG)
DEFAULT_RUN: tuple[str, ...] = tuple(name for _, name, _, default in CATALOG if default)
