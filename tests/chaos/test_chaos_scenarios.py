"""Scenarios 3, 4, 7-10 and 12-14 on the real multi-node tier (marker ``chaos``: run by
.ci/run with ``-m chaos``, not by the default run)."""

from __future__ import annotations

import pytest

from kvstore.chaos.scenarios import BY_NAME, run_scenario
from kvstore.chaos.tier import ChaosTier

pytestmark = pytest.mark.chaos


def test_restarted_nodes_bring_their_data_back_without_duplicates_or_orphans(
    chaos_tier: ChaosTier,
) -> None:
    result = run_scenario(chaos_tier, BY_NAME["restart"])
    assert result.violations == []
    assert result.details["stray_before_reclaim"] > 0  # stale copies did come back ...
    after = result.details["after_reclaim"]
    assert after["stray"] == 0 and after["pending"] == 0  # ... and were reclaimed
    assert after["shards"] == after["expected_shards"]  # no duplicate, no orphan
    assert result.wrong_bytes == 0 and result.failed_reads == 0 and result.blocks_lost == 0
    assert result.ok


def test_a_machine_lost_for_good_is_repaired_to_full_redundancy(chaos_tier: ChaosTier) -> None:
    result = run_scenario(chaos_tier, BY_NAME["repair"])
    assert result.violations == []
    assert result.details["shards_on_victim"] > 0
    assert result.details["repaired"]["shards"] >= result.details["shards_on_victim"]
    assert result.details["repaired"]["unrecoverable"] == 0
    assert result.detect_s is not None and result.repair_s is not None
    assert result.wrong_bytes == 0 and result.blocks_lost == 0
    assert result.ok


def test_a_killed_meta_shard_rebuilds_its_index_from_manifests(chaos_tier: ChaosTier) -> None:
    result = run_scenario(chaos_tier, BY_NAME["meta"])
    assert result.violations == []
    assert result.details["rebuild"]["restored_blocks"] >= result.details["blocks_on_shard"] > 0
    assert result.wrong_bytes == 0 and result.failed_reads == 0 and result.blocks_lost == 0
    assert result.ok


def test_writers_killed_mid_put_leave_nothing_partial_and_no_garbage(
    chaos_tier: ChaosTier,
) -> None:
    result = run_scenario(chaos_tier, BY_NAME["writer"])
    assert result.violations == []
    space = result.details["space"]
    assert space["unindexed_reclaimed"] > 0
    assert space["bytes_after_reclaim"] < space["bytes_after_kills"]
    assert result.wrong_bytes == 0 and result.blocks_lost == 0
    assert result.ok


def test_gc_never_frees_a_block_under_a_lease(chaos_tier: ChaosTier) -> None:
    result = run_scenario(chaos_tier, BY_NAME["gc-lease"])
    assert result.violations == []
    assert result.details["leased_reads"] > 0
    assert result.details["leased_freed"] == 0
    assert result.details["leased_ok"] == result.details["leased_reads"]
    assert result.details["gc_passes"] > 10 and result.details["gc_failures"] == 0
    assert result.wrong_bytes == 0 and result.blocks_lost == 0
    assert result.ok


def test_hedged_reads_keep_get_p99_within_twice_normal_with_a_slow_node(
    chaos_tier: ChaosTier,
) -> None:
    result = run_scenario(chaos_tier, BY_NAME["slow-node"])
    assert result.violations == []
    assert result.details["get_p99_slow_ms"] <= 2 * result.details["get_p99_normal_ms"]
    assert result.details["hedged_reads"] > 0
    assert result.wrong_bytes == 0 and result.failed_reads == 0 and result.blocks_lost == 0
    assert result.ok


def test_noise_in_a_sealed_segment_is_erasures_then_repaired(chaos_tier: ChaosTier) -> None:
    result = run_scenario(chaos_tier, BY_NAME["segment-corrupt"])
    assert result.violations == []
    assert result.details["scrub_found"] > 0
    assert result.wrong_bytes == 0 and result.failed_reads == 0 and result.blocks_lost == 0
    assert result.ok


def test_compaction_moves_leased_blocks_under_reads_without_a_wrong_byte(
    chaos_tier: ChaosTier,
) -> None:
    result = run_scenario(chaos_tier, BY_NAME["compaction-race"])
    assert result.violations == []
    assert result.details["evicted"] == 120  # every block but the 40 leased ones
    assert result.details["segments_removed"] > 0 and result.details["reads"]["ok"] > 0
    assert result.wrong_bytes == 0 and result.failed_reads == 0 and result.blocks_lost == 0
    assert result.ok


def test_a_node_holding_200k_shards_serves_them_all_again(chaos_tier: ChaosTier) -> None:
    # How fast is benchmarks/node_restart.py's to check (tests do not time things).
    result = run_scenario(chaos_tier, BY_NAME["restart-200k"])
    assert result.violations == []
    assert result.details["shards"] >= 200_000
    assert result.details["restart_to_serving_s"] is not None
    assert set(result.details["targets"]) == {"restart_to_serving_s"}
    assert result.wrong_bytes == 0 and result.failed_reads == 0 and result.blocks_lost == 0
    assert result.ok
