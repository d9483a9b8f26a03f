"""Scenario 17, ``scrub``: bytes flipped inside a few committed shards on disk; the background
scrub (turned up with ``set_rates``) counts them corrupt, the repair restores those stripes to 12
healthy shards, and no read ever returns wrong bytes.
"""

from __future__ import annotations

import random
import time
from typing import Any

from kvstore.chaos.faults import corrupt_held_shard
from kvstore.chaos.load import LoadConfig, LoadGenerator
from kvstore.chaos.scenarios.base import seconds_or_violation
from kvstore.chaos.scenarios.redundancy import _MB, _MIB, _absorb, _delta
from kvstore.chaos.table import ScenarioResult
from kvstore.chaos.tier import ChaosTier, wait_until
from kvstore.keys import BlockKey

SCRUB_BLOCKS = 32
#: (blocks, shards flipped in each): the first with one data shard, the others with a data and
#: a parity shard (still within the promise: <= m per stripe).
SCRUB_DAMAGE = ((4, 1), (2, 2))
SCRUB_RATE_BYTES_PER_S = 64 * _MIB
SCRUB_TIMEOUT_S = 120.0
SCRUB_REBUILD_TIMEOUT_S = 90.0


def _scrub_figures(tier: ChaosTier) -> dict[str, Any]:
    figures = tier.repair_stats().get("scrub")
    return dict(figures) if isinstance(figures, dict) else {}


def scrub(tier: ChaosTier) -> ScenarioResult:
    result = ScenarioResult("scrub", "background scrub finds flipped bytes; repair restores")
    config = tier.config
    bconfig = tier.blockstore_config
    k, m = bconfig.data_shards, bconfig.parity_shards
    rng = random.Random(config.seed + 17)
    keys = tier.put_fresh(SCRUB_BLOCKS)
    placements = tier.placements()
    before = _scrub_figures(tier)  # before the damage: a scrub already on may find it at once
    if not result.require(
        bool(before), "the repair's stats carry no scrub figures (stats()['scrub'])"
    ):
        return result
    damaged: list[BlockKey] = []
    flipped: list[dict[str, Any]] = []
    position = 0
    for blocks, shards in SCRUB_DAMAGE:
        for key in keys[position : position + blocks]:
            placement = placements[key]
            # A data shard always (the readers' fast path must notice), then parity.
            indices = [rng.randrange(k)] + [k + i for i in rng.sample(range(m), shards - 1)]
            for index in indices:
                node = placement[index]
                corrupt_held_shard(tier, node, key, "flip", rng)
                flipped.append({"key": key.hex()[:16], "index": index, "node": node})
            damaged.append(key)
        position += blocks
    result.faults = len(flipped)
    result.details.update(damaged_blocks=len(damaged), flipped=flipped)
    reads = {"ok": 0, "miss": 0, "wrong": 0}

    def read_damaged() -> None:
        check = tier.read(damaged)
        reads["ok"] += check.ok
        reads["miss"] += check.misses
        reads["wrong"] += check.wrong

    load_config = LoadConfig(
        writers=0, readers=2, max_seconds=SCRUB_TIMEOUT_S + SCRUB_REBUILD_TIMEOUT_S + 30
    )
    found_at = healed_at = None
    with LoadGenerator(tier, load_config, seed=config.seed + 17) as load:
        read_damaged()  # at once: the damaged shard is an erasure, the block still exact
        result.details["set_rates"] = tier.set_repair_rates(
            scrub_bytes_per_s=SCRUB_RATE_BYTES_PER_S
        )
        scrub_on = time.monotonic()
        try:

            def found() -> bool:
                read_damaged()
                return _delta(_scrub_figures(tier), before, "corrupt") >= len(flipped)

            found_at = wait_until(found, SCRUB_TIMEOUT_S, 0.3)
            result.detect_s = seconds_or_violation(
                result, found_at, "the scrub counting the flipped shards", SCRUB_TIMEOUT_S
            )
            if found_at is not None:
                detected = time.monotonic()

                def healed() -> bool:
                    read_damaged()
                    return (
                        tier.redundancy(damaged).full == len(damaged)
                        and tier.shard_census(damaged)["missing"] == 0
                    )

                healed_at = wait_until(healed, SCRUB_REBUILD_TIMEOUT_S, 0.3)
                seconds_or_violation(
                    result, healed_at, "restoring the damaged stripes", SCRUB_REBUILD_TIMEOUT_S
                )
                if healed_at is not None:
                    result.repair_s = time.monotonic() - detected
        finally:
            after = _scrub_figures(tier)
            scrub_s = time.monotonic() - scrub_on
            tier.set_repair_rates(scrub_bytes_per_s=bconfig.scrub_bytes_per_s)
    _absorb(result, tier, load.stats)
    result.operations += reads["ok"] + reads["miss"] + reads["wrong"]
    result.reads_ok += reads["ok"]
    result.failed_reads += reads["miss"]
    result.wrong_bytes += reads["wrong"]
    scrubbed = _delta(after, before, "bytes")
    result.details.update(
        scrub={
            "shards": _delta(after, before, "shards"),
            "bytes": scrubbed,
            "corrupt": _delta(after, before, "corrupt"),
            "rate_bytes_per_s": after.get("rate_bytes_per_s"),
            "mb_per_s_seen": round(scrubbed / _MB / scrub_s, 1) if scrub_s > 0 else None,
        },
        damaged_reads=reads,
        census_after=tier.shard_census(damaged),
    )
    final = tier.read(keys, reader=tier.fresh_reader())
    result.operations += len(keys)
    result.reads_ok += final.ok
    result.wrong_bytes += final.wrong
    result.blocks_lost = final.misses
    return result
