"""The fleet model (`kvstore simulate`): held to the trace oracles, to kvstore's placement, and
to its own repair and loss arithmetic. Slices of the bundled trace keep it fast."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from kvstore.blockstore.placement import place
from kvstore.cli import main
from kvstore.errors import InvalidArgument
from kvstore.keys import words_to_keys
from kvstore.trace.fleetrisk import RepairRate, loss_estimate
from kvstore.trace.mooncake import TraceRequest, load_trace
from kvstore.trace.oracle import oracle_hits
from kvstore.trace.simreport import FleetReport
from kvstore.trace.simulate import PreparedTrace, SimConfig, simulate
from kvstore.trace.sizing import capacity_for

TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_head700.jsonl"
BLOCK = SimConfig().block_bytes


@pytest.fixture(scope="module")
def slice_() -> tuple[list[TraceRequest], PreparedTrace]:
    requests = load_trace(TRACE, 700)
    return requests, PreparedTrace.of(requests)


def test_an_unbounded_tier_hits_exactly_what_the_infinite_oracle_does(slice_) -> None:
    requests, prepared = slice_
    result = simulate(requests, SimConfig(machines=14), prepared=prepared)
    oracle = oracle_hits(requests, prepared.words)
    assert np.array_equal(result.hits, oracle.hit_tokens)
    assert result.token_hit_rate == oracle.token_hit_rate
    assert result.bytes_stored == prepared.unique_blocks * BLOCK == result.bytes_written
    assert result.bytes_evicted == 0


def test_gc_after_every_request_at_the_oracles_capacity_is_the_lru_oracle(slice_) -> None:
    """Watermarks that make the GC evict down to exactly C blocks after every request, with
    room above them for any one request's writes: the LRU oracle of C blocks."""
    requests, prepared = slice_
    blocks = prepared.unique_blocks // 4
    room = blocks + max(2000, blocks // 5)
    config = SimConfig(
        machines=14,
        capacity_bytes=room * BLOCK,
        gc_low=blocks / room,
        gc_high=(blocks + 0.5) / room,
        gc_every_requests=1,
    )
    result = simulate(requests, config, prepared=prepared)
    oracle = oracle_hits(requests, prepared.words, blocks)
    assert result.blocks_refused == 0
    assert abs(result.token_hit_rate - oracle.token_hit_rate) < 0.002
    assert abs(result.blocks_stored - blocks) <= 1
    written = result.by_class["chatbot"].blocks_written
    assert abs(written - oracle.blocks_written) <= 0.002 * oracle.blocks_written


def test_a_pass_every_second_gives_what_a_pass_after_every_request_gives(slice_) -> None:
    """Why the default (the replay's GC scans every second) is safe: the cadence shows only
    through the puts refused while the tier writes past the watermarks' gap between passes."""
    requests, prepared = slice_
    base = SimConfig(machines=14, capacity_bytes=prepared.unique_blocks // 4 * BLOCK)
    timed = simulate(requests, base, prepared=prepared)
    every = simulate(requests, dataclasses.replace(base, gc_every_requests=1), prepared=prepared)
    assert timed.bytes_evicted > 0
    assert abs(timed.token_hit_rate - every.token_hit_rate) < 0.01
    assert abs(timed.bytes_stored - every.bytes_stored) < 0.05 * every.bytes_stored


def test_a_pass_at_the_end_settles_what_the_gc_left_between_passes(slice_) -> None:
    """``gc_at_end`` (as ``kvstore replay`` measures its bytes stored): with passes far apart
    the last writes sit above the high watermark at the end; one more pass takes the tier to
    its low watermark, and changes nothing before it."""
    requests, prepared = slice_
    blocks = prepared.unique_blocks // 4
    room = 2 * blocks  # nothing refused between passes
    base = SimConfig(
        machines=14,
        capacity_bytes=room * BLOCK,
        gc_low=blocks / room,
        gc_high=(blocks + 1) / room,
        gc_every_requests=len(requests) // 3 + 1,  # two passes, ~230 requests after the last
    )
    left = simulate(requests, base, prepared=prepared)
    settled = simulate(requests, dataclasses.replace(base, gc_at_end=True), prepared=prepared)
    assert left.blocks_stored > blocks + 1  # above the high watermark at the end
    assert settled.blocks_stored <= blocks
    assert settled.gc_passes == left.gc_passes + 1
    assert np.array_equal(settled.hits, left.hits)


def test_stripes_sit_on_12_distinct_live_machines_as_place_puts_them(slice_) -> None:
    requests, prepared = slice_
    machines = 40
    cache = prepared.placement(machines)
    ids = np.arange(200)
    dead = np.zeros(machines, dtype=bool)
    dead[[3, 17]] = True
    keys = words_to_keys(prepared.unique_words[ids])
    live = np.flatnonzero(~dead)
    assert np.array_equal(cache.live(ids, dead), place(keys, live, 12))
    config = SimConfig(machines=machines, fail_at=(60.0,))
    from kvstore.trace.simulate import _Run  # the run's tier, to look at every stripe

    run = _Run(prepared, config, None)
    run.run()
    tier = run.tier
    stripes = tier.stripes[tier.present]
    assert stripes.shape[0] == prepared.unique_blocks
    assert (stripes >= 0).all()
    assert all(len(set(row)) == 12 for row in stripes.tolist())
    assert not tier.dead[stripes].any()  # the repair moved every shard off the lost machine


def test_a_failure_is_repaired_in_the_bytes_it_held_over_the_repair_rate(slice_) -> None:
    requests, prepared = slice_
    config = SimConfig(machines=20, fail_at=(100.0,), repair_bytes_per_s=64 << 20)
    result = simulate(requests, config, prepared=prepared)
    (failure,) = result.failures
    detect = config.store_config().dead_after_s
    assert result.repair.bytes_per_s == 64 << 20
    assert failure.repair_s == pytest.approx(detect + failure.live_bytes / (64 << 20))
    assert failure.simulated_repair_s == pytest.approx(failure.repair_s, rel=0.05)
    assert failure.live_bytes > 0
    assert result.blocks_lost == 0  # one failure of 20: every stripe keeps 11 shards
    # The repair bound: a slow network at the repair machine binds instead of the cap.
    slow = dataclasses.replace(config, net_bw=10 * (32 << 20))
    assert slow.repair().bytes_per_s == 32 << 20
    assert slow.repair().bound == "repair machine network / k"


def test_three_failures_at_once_lose_the_stripes_they_share(slice_) -> None:
    requests, prepared = slice_
    config = SimConfig(machines=20, fail_at=(100.0, 100.0, 100.0))
    run_result = simulate(requests, config, prepared=prepared)
    unharmed = simulate(requests, SimConfig(machines=20), prepared=prepared)
    assert run_result.blocks_lost > 0
    assert run_result.token_hit_rate < unharmed.token_hit_rate


def test_copies_multiply_the_traffic_and_keep_the_hit_rate(slice_) -> None:
    requests, prepared = slice_
    one = simulate(requests, SimConfig(machines=100), prepared=prepared)
    many = simulate(requests, SimConfig(machines=100, copies=50), prepared=prepared)
    assert many.token_hit_rate == one.token_hit_rate
    assert many.bytes_stored == 50 * one.bytes_stored
    net_one = one.machines.net_in + one.machines.net_out
    net_many = many.machines.net_in + many.machines.net_out
    assert net_many.sum() == pytest.approx(50 * net_one.sum())
    # 50 independent placements even out the machines.
    assert net_many.std() / net_many.mean() < net_one.std() / net_one.mean()


def test_the_capacity_found_keeps_the_target_and_a_little_less_does_not(slice_) -> None:
    requests, prepared = slice_
    config = SimConfig(machines=14)
    best = simulate(requests, config, prepared=prepared).token_hit_rate
    sizing = capacity_for(prepared, config, 0.8 * best, best, tolerance=0.02)
    assert sizing.reachable and sizing.capacity_bytes is not None
    assert sizing.hit_rate is not None and sizing.hit_rate >= 0.8 * best
    below = [rate for capacity, rate in sizing.evaluations if capacity < sizing.capacity_bytes]
    assert below and max(below) < 0.8 * best
    unreachable = capacity_for(prepared, config, min(1.0, best + 0.05), best)
    assert not unreachable.reachable


def test_loss_grows_with_the_failure_rate_and_falls_with_faster_repair() -> None:
    slow, fast = (RepairRate(rate, "repair_bytes_per_s", {}) for rate in (64e6, 256e6))

    def p(afr: float, rate: RepairRate, stripes: float = 1e9) -> float:
        return loss_estimate(1000, stripes, 11_616, rate, 10.0, afr).p_year

    assert 0 < p(0.01, slow) < p(0.02, slow) < p(0.05, slow) < 1
    assert p(0.02, fast) < p(0.02, slow)
    assert p(0.02, slow, stripes=1e10) > p(0.02, slow, stripes=1e9)
    estimate = loss_estimate(1000, 1e9, 11_616, slow, 10.0, 0.02)
    assert estimate.events_per_year < estimate.naive_events_per_year  # repair order helps
    assert estimate.shared_repair_s < estimate.machine_repair_s
    assert loss_estimate(1000, 1e9, 11_616, slow, 10.0, 0.0).p_year == 0


def test_the_report_states_the_model_and_every_figure(slice_) -> None:
    requests, prepared = slice_
    config = SimConfig(machines=100, copies=10, machine_capacity=2 << 30)
    result = simulate(requests, config, prepared=prepared)
    report = FleetReport.of("slice", result, None, 1.0)
    text = "\n".join(report.lines())
    for word in ("token hit rate", "network / machine", "repair", "P(loss) / year", "model"):
        assert word in text
    figures = report.as_dict()
    assert figures["loss_at_capacity"]["p_year"] >= figures["loss_as_held"]["p_year"]
    assert figures["per_machine_bytes_per_s"]["network"]["p99"] > 0


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (("--machines", "5"), "--machines"),
        (("--afr", "often"), "--afr"),
        (("--fail-at", "300"), "--fail-at"),
        (("--fail", "2", "--fail-at", "1,2,3"), "--fail-at"),
        (("--capacity-bytes", "lots"), "--capacity-bytes"),
        (("--capacity-bytes", "1GB", "--machine-capacity", "1TB"), "--machine-capacity"),
        (("--target-hit-rate", "150%"), "--target-hit-rate"),
        (("--net-bw", "fast"), "--net-bw"),
        (("--gc-low", "0.99"), "--gc-low"),
        (("--mode", "standard"), "--mode"),
        (("--copies", "0"), "--copies"),
    ],
)
def test_bad_arguments_name_the_flag_and_exit_2(
    argv: tuple[str, ...], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["simulate", "--trace", str(TRACE), "--limit", "5", "--no-progress", *argv])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "error" in lines[0]


def test_a_missing_trace_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--trace", "/nonexistent/trace.jsonl"]) == 2
    assert "--trace" in capsys.readouterr().err


def test_config_errors_name_the_flag() -> None:
    with pytest.raises(InvalidArgument, match="--machines"):
        SimConfig(machines=11)
    with pytest.raises(InvalidArgument, match="--speed"):
        SimConfig(speed=0)
    with pytest.raises(InvalidArgument, match="--capacity-bytes"):
        SimConfig(capacity_bytes=10)
