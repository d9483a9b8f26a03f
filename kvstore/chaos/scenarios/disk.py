"""Scenario 5, ``corrupt``: shard records damaged in the nodes' segment files — bit flips, a torn
write, a zeroed record, a broken record header — one or two per block (within the promise) and
three on a few blocks (beyond it).

Readers must get every block within the promise bit-exact (the damaged shard fails its checksum
and is treated as missing), and the blocks beyond it as misses, never wrong bytes. Then a scrub
pass (what the repair loop runs periodically; run here at once) finds the damaged records, and the
repair loop rebuilds them until every block within the promise is whole again.
"""

from __future__ import annotations

import random
import time

from kvstore.blockstore.repair import Repairer
from kvstore.chaos.faults import corrupt_held_shard
from kvstore.chaos.scenarios.base import seconds_or_violation
from kvstore.chaos.table import ScenarioResult
from kvstore.chaos.tier import ChaosTier, wait_until
from kvstore.runtime.blockstore_actors import name_resolver
from kvstore.runtime.fanout import RayFanout

#: A few dozen shards: the repair loop rebuilds them in a couple of its cycles.
REBUILD_TIMEOUT_S = 60.0
#: (damage per shard, blocks): the first groups stay within the promise (<= 2 shards a block).
_PLAN: tuple[tuple[tuple[str, ...], int], ...] = (
    (("flip",), 3),
    (("torn",), 3),
    (("erase",), 3),
    (("header",), 2),
    (("flip", "erase"), 2),
    (("torn", "header"), 2),
    (("flip", "torn", "erase"), 2),  # beyond the promise: must become a miss
)


def scrub_now(tier: ChaosTier) -> int:
    """One scrub pass over every live node, as the repair loop runs it; returns corrupt shards
    found (each recorded lost in its meta shard, so the repair re-creates it)."""
    config = tier.blockstore_config
    repairer = Repairer(
        config, RayFanout({}, resolve=name_resolver(config.deployment)), sorted(tier.handles.nodes)
    )
    limit = max(1024, 2 * len(tier.ledger))  # every shard a node holds, whatever its bytes
    return repairer.scrub(tier.dead_nodes(), budget_bytes=1 << 50, limit=limit)


def corrupt(tier: ChaosTier) -> ScenarioResult:
    result = ScenarioResult("corrupt", "flip, tear, erase shard records on disk")
    config = tier.config
    k = tier.blockstore_config.data_shards
    rng = random.Random(config.seed + 5)
    count = sum(blocks for _, blocks in _PLAN)
    keys = tier.put_fresh(count)
    placements = tier.placements()
    within: list[bytes] = []
    beyond: list[bytes] = []
    damaged = 0
    position = 0
    for damages, blocks in _PLAN:
        for key in keys[position : position + blocks]:
            placement = placements[key]
            # Data shards first: the readers' fast path (concatenating data shards) must notice.
            indices = rng.sample(range(k), len(damages))
            for index, how in zip(indices, damages, strict=True):
                corrupt_held_shard(tier, placement[index], key, how, rng)
                damaged += 1
            (within if len(damages) <= tier.blockstore_config.parity_shards else beyond).append(key)
        position += blocks
    corrupted_at = time.monotonic()
    result.faults = damaged
    result.details.update(blocks_within_promise=len(within), blocks_beyond=len(beyond))

    # Readers notice at once: the damaged shard is skipped, the block is still exact.
    first = tier.read(keys)
    result.operations += len(keys)
    missed = set(first.missed_keys)
    result.reads_ok += first.ok
    result.wrong_bytes += first.wrong
    result.failed_reads += len(missed - set(beyond))
    result.expected_misses += len(missed & set(beyond))
    result.require(set(beyond) <= missed | set(first.wrong_keys), "a destroyed block was served")

    found = scrub_now(tier)
    result.detect_s = time.monotonic() - corrupted_at
    result.details["scrub_found"] = found
    result.require(found > 0, "the scrub found no damaged shard")
    healed = wait_until(
        lambda: (
            tier.redundancy(within).full == len(within)
            and tier.shard_census(within)["missing"] == 0
        ),
        REBUILD_TIMEOUT_S,
        0.3,
    )
    seconds_or_violation(result, healed, "rebuilding the damaged shards", REBUILD_TIMEOUT_S)
    if healed is not None:
        result.repair_s = time.monotonic() - corrupted_at - result.detect_s
    census = tier.shard_census(within)
    result.details["census_after_repair"] = census
    second = tier.read(keys)
    result.operations += len(keys)
    result.reads_ok += second.ok
    result.wrong_bytes += second.wrong
    result.blocks_lost = len(set(second.missed_keys) - set(beyond))
    result.expected_misses += len(set(second.missed_keys) & set(beyond))
    # Blocks beyond the promise are gone for good: they leave the ledger (misses from now on).
    tier.ledger.forget(beyond)
    return result
