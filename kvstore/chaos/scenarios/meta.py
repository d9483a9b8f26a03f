"""Scenario 7, ``meta``: a meta shard is killed under load and rebuilds its index from the
storage nodes' manifests. While it rebuilds its keys answer miss (by design, never an error);
afterwards every block committed before the kill is indexed again with the same placement and
reads bit-exact, and blocks committed during the rebuild are kept too."""

from __future__ import annotations

import time

import ray

from kvstore.blockstore.placement import meta_shard_of
from kvstore.chaos.load import LoadConfig, LoadGenerator
from kvstore.chaos.scenarios.base import absorb_load, seconds_or_violation
from kvstore.chaos.table import ScenarioResult
from kvstore.chaos.tier import ChaosTier, wait_until


def meta_loss(tier: ChaosTier) -> ScenarioResult:
    result = ScenarioResult("meta", "kill a meta shard: index rebuilt from manifests")
    config = tier.config
    shards = tier.blockstore_config.meta_shards
    victim = 0
    tier.put_fresh(48)
    committed = tier.ledger.keys()
    owners = meta_shard_of(committed, shards)
    owned = [key for key, owner in zip(committed, owners, strict=True) if owner == victim]
    before = {key: p for key, p in tier.placements().items() if key in set(owned)}
    meta = tier.handles.metas[victim]
    incarnation = ray.get(meta.incarnation.remote(), timeout=config.call_timeout_s)
    result.details["blocks_on_shard"] = len(owned)
    with LoadGenerator(tier, LoadConfig(), seed=config.seed + 7) as load:
        time.sleep(1.0)
        tier.handles.kill_meta(victim, restart=True)
        killed_at = time.monotonic()
        result.faults = 1
        back = wait_until(
            lambda: ray.get(meta.incarnation.remote(), timeout=2) != incarnation,
            config.detect_timeout_s,
            0.05,
        )
        result.detect_s = seconds_or_violation(
            result, back, "the meta shard restarting", config.detect_timeout_s
        )
        ready = wait_until(
            lambda: bool(ray.get(meta.ready.remote(), timeout=2)), config.repair_timeout_s, 0.05
        )
        seconds_or_violation(result, ready, "the index rebuild", config.repair_timeout_s)
        if ready is not None:
            result.repair_s = time.monotonic() - killed_at - (back or 0.0)
        rebuilt_at = time.monotonic()
        time.sleep(1.0)
    absorb_load(result, load.stats)
    # Misses of the victim's keys while it rebuilt are by design; any other miss is a failure.
    missed = load.stats.missed_keys
    if missed:
        missed_owner = meta_shard_of(missed, shards)
        on_victim = int((missed_owner == victim).sum())
        result.expected_misses += on_victim
        result.failed_reads += len(missed) - on_victim
    late = [t for t, _ in load.stats.get_latencies if t > rebuilt_at + 0.5]
    result.details["reads_after_rebuild"] = len(late)
    stats = ray.get(meta.stats.remote(), timeout=config.call_timeout_s)
    result.details["rebuild"] = stats.get("last_rebuild", {})
    after = tier.placements()
    changed = [key for key, placement in before.items() if after.get(key) != placement]
    result.require(not changed, f"{len(changed)} blocks lost or moved by the rebuild")
    lookup = tier.client.lookup(owned)
    tier.client.release(lookup.lease)
    result.require(
        lookup.hit_blocks == len(owned),
        f"lookup found {lookup.hit_blocks} of the shard's {len(owned)} blocks after the rebuild",
    )
    final = tier.read(reader=tier.fresh_reader())
    result.operations += len(tier.ledger) + len(owned)
    result.reads_ok += final.ok
    result.wrong_bytes += final.wrong
    result.blocks_lost = final.misses
    return result
