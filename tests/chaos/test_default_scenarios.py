"""Scenarios 1, 2, 5, 6 and 11 on the real multi-node tier (part of the default test run).

Every test asserts the promise in numbers: 0 wrong bytes, 0 failed reads of data the promise
covers, 0 committed blocks lost, and the misses the fault must cause."""

from __future__ import annotations

from kvstore.chaos.scenarios import BY_NAME, run_scenario
from kvstore.chaos.tier import ChaosTier


def test_killing_two_storage_nodes_of_a_stripe_under_load_loses_nothing(
    chaos_tier: ChaosTier,
) -> None:
    result = run_scenario(chaos_tier, BY_NAME["kill-two"])
    assert result.violations == []
    assert result.faults == 2
    assert result.details["stripes_with_both"] > 0  # the two victims shared stripes
    assert result.wrong_bytes == 0
    assert result.failed_reads == 0  # not one read of a committed block missed
    assert result.blocks_lost == 0
    assert result.details["load"]["reads_ok"] > 0 and result.details["load"]["puts_ok"] > 0
    # Puts go on with 2 of 13 nodes down (11 failure domains: under-redundant, still stored).
    both_down = result.details["puts_with_both_down"]
    assert both_down["ok"] + both_down["under_redundant"] + both_down["failed"] >= 50
    assert both_down["stored_fraction"] >= 0.99
    assert (
        result.details["degraded_read_of_all"]["ok"]
        == result.details["degraded_read_of_all"]["blocks"]
    )
    assert result.detect_s is not None and result.repair_s is not None
    assert result.ok


def test_a_third_node_turns_blocks_into_misses_and_query_hit_stops_counting(
    chaos_tier: ChaosTier,
) -> None:
    result = run_scenario(chaos_tier, BY_NAME["kill-three"])
    assert result.violations == []
    assert result.faults == 3
    hits = result.details["query_hit_blocks"]
    assert hits["before"] == 24 and 0 < hits["expected"] < 24
    assert hits["after"] == hits["expected"]
    assert result.expected_misses == result.details["blocks_beyond_promise"] > 0
    assert result.wrong_bytes == 0 and result.failed_reads == 0
    assert result.details["put_with_10_nodes"]["stored"] == 0  # refused cleanly, not an error
    assert result.blocks_lost == 0  # the nodes came back on their data dirs
    assert result.ok


def test_corrupt_shard_files_are_detected_and_rebuilt_or_missing(chaos_tier: ChaosTier) -> None:
    result = run_scenario(chaos_tier, BY_NAME["corrupt"])
    assert result.violations == []
    assert result.faults >= 20
    assert result.details["scrub_found"] > 0
    assert result.wrong_bytes == 0 and result.failed_reads == 0
    # The blocks with 3 damaged shards: a miss in each of the two reads, never bytes.
    assert result.expected_misses == 2 * result.details["blocks_beyond"]
    assert result.details["census_after_repair"]["missing"] == 0
    assert result.blocks_lost == 0
    assert result.ok


def test_losing_an_entrypoint_and_a_machine_with_swa_states_gives_misses_not_errors(
    chaos_tier: ChaosTier,
) -> None:
    result = run_scenario(chaos_tier, BY_NAME["swa"])
    assert result.violations == []
    assert result.faults == 2
    entry = result.details["entrypoint"]
    assert (
        entry["replaced_after_s"] is not None and entry["directory_recovered_after_s"] is not None
    )
    standard = result.details["query_hit_after_loss"]["standard"]
    assert standard["swa_hit"] is False and standard["hit_tokens"] == 9 * 128
    assert result.expected_misses > 0  # the lost machine's states
    assert result.wrong_bytes == 0 and result.failed_reads == 0 and result.blocks_lost == 0
    assert result.ok


def test_a_node_killed_mid_append_cuts_its_torn_tail_and_loses_nothing(
    chaos_tier: ChaosTier,
) -> None:
    result = run_scenario(chaos_tier, BY_NAME["torn-tail"])
    assert result.violations == []
    assert result.details["damaged_records_at_start"] >= 1  # the torn record was found ...
    assert result.details["load"]["puts_ok"] > 0  # ... while writers were writing
    assert result.wrong_bytes == 0 and result.failed_reads == 0 and result.blocks_lost == 0
    assert result.repair_s is not None
    assert result.ok
