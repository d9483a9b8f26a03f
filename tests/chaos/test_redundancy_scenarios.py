"""Scenarios 15-17 on the real multi-node tier (marker ``chaos``): repair rate after losing a
node holding 500 MB, a drain that keeps every stripe at 12 shards, the background scrub.

A module of their own, so their deployment (and repair-rate's fill of several GB) is not the
one the other scenarios share, configured as ``kvstore chaos`` configures theirs
(``catalog.OWN_DEPLOYMENT_CONFIG``: 16 MiB segments); repair-rate runs last: it fills the
disks."""

from __future__ import annotations

import pytest

from kvstore.chaos.catalog import OWN_DEPLOYMENT_CONFIG
from kvstore.chaos.scenarios import BY_NAME, run_scenario
from kvstore.chaos.tier import ChaosTier

pytestmark = pytest.mark.chaos

CHAOS_CONFIG = OWN_DEPLOYMENT_CONFIG


def test_a_drained_node_moves_every_shard_while_each_stripe_keeps_twelve(
    chaos_tier: ChaosTier,
) -> None:
    result = run_scenario(chaos_tier, BY_NAME["drain"])
    assert result.violations == []
    watch = result.details["watch"]
    assert watch["samples_while_moving"] > 0 and watch["stripes_checked"] > 0
    assert watch["short_stripes"] == 0 and watch["new_puts_on_node"] == 0
    assert watch["physical"]["checks"] > 0 and watch["physical"]["missing"] == 0
    assert result.details["placed_on_node_after"] == 0
    assert result.details["drain_state"]["done"] is True
    assert result.details["undrain"]["back_after_s"] is not None
    assert result.wrong_bytes == 0 and result.failed_reads == 0 and result.blocks_lost == 0
    assert result.ok


def test_the_background_scrub_finds_flipped_shards_and_repair_restores_them(
    chaos_tier: ChaosTier,
) -> None:
    result = run_scenario(chaos_tier, BY_NAME["scrub"])
    assert result.violations == []
    assert result.details["scrub"]["corrupt"] >= result.faults > 0
    assert result.details["census_after"]["missing"] == 0
    assert result.detect_s is not None and result.repair_s is not None
    assert result.wrong_bytes == 0 and result.failed_reads == 0 and result.blocks_lost == 0
    assert result.ok


@pytest.mark.timeout(3600)
def test_a_node_holding_500_mb_lost_for_good_is_restored_and_reported(
    chaos_tier: ChaosTier,
) -> None:
    result = run_scenario(chaos_tier, BY_NAME["repair-rate"])
    assert result.violations == []
    assert result.details["victim_live_bytes"] >= 500_000_000
    assert result.details["restored"]["bytes"] >= result.details["shard_bytes_on_victim"]
    assert result.details["restored_mb_per_s"] is not None
    before, during = result.details["get_ms"]["before"], result.details["get_ms"]["during_repair"]
    assert before["reads"] > 0 and during["reads"] > 0
    assert set(result.details["targets"]) == {"restored_mb_per_s", "p99_during_over_before"}
    assert result.wrong_bytes == 0 and result.failed_reads == 0 and result.blocks_lost == 0
    assert result.ok
