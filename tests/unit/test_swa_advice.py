"""Fetch-or-replay advice: both estimates, per-machine measurements, calibration."""

from __future__ import annotations

import itertools

import pytest

from kvstore.errors import ConfigError, InvalidArgument
from kvstore.swa.advice import FETCH, REPLAY, FetchReplayAdvisor
from kvstore.swa.config import SWAConfig

STATE = 1_415_040


def advisor(**changes: float) -> FetchReplayAdvisor:
    config = SWAConfig(**changes)  # type: ignore[arg-type]
    return FetchReplayAdvisor(config=config, state_bytes=STATE, stored_layers=20, replay_tokens=128)


def test_defaults_give_both_estimates_by_the_formulas() -> None:
    adv = advisor(
        default_fetch_latency_s=0.002,
        default_fetch_bandwidth_bps=1e9,
        replay_cost_per_token_layer_s=1e-6,
    )
    advice = adv.advise("m1", local_machine="m0")
    assert advice.fetch_s == pytest.approx(0.002 + STATE / 1e9)  # 3.415 ms
    assert advice.replay_s == pytest.approx(128 * 20 * 1e-6)  # 2.56 ms
    assert advice.choice == REPLAY and not advice.local and not advice.measured
    assert adv.advise("m0", local_machine="m0").local
    cheap_replay = advisor(replay_cost_per_token_layer_s=1e-7)
    assert cheap_replay.advise("m1").choice == REPLAY
    slow_replay = advisor(replay_cost_per_token_layer_s=1e-5)
    assert slow_replay.advise("m1").choice == FETCH
    assert set(advice.to_dict()) >= {"choice", "fetch_s", "replay_s", "owner_machine"}


def test_measured_fetches_replace_the_defaults_per_machine() -> None:
    adv = advisor(default_fetch_latency_s=0.002, default_fetch_bandwidth_bps=1e9)
    adv.observe_latency("m1", 0.0005)
    adv.observe_fetch("m1", STATE, 0.0005 + STATE / 2e9)
    link = adv.link("m1")
    assert link.latency_s == pytest.approx(0.0005)
    assert link.bandwidth_bps == pytest.approx(2e9, rel=1e-6)
    assert adv.fetch_seconds("m1") == pytest.approx(0.0005 + STATE / 2e9)
    assert adv.advise("m1").measured
    # Other machines keep the defaults.
    assert adv.fetch_seconds("m2") == pytest.approx(0.002 + STATE / 1e9)


def test_the_moving_estimate_follows_a_slower_link() -> None:
    adv = advisor(estimate_alpha=0.5, default_fetch_latency_s=0.001)
    adv.observe_fetch("m1", STATE, 0.001 + STATE / 1e9)  # first sample taken whole
    before = adv.fetch_seconds("m1")
    for _ in range(20):
        adv.observe_fetch("m1", STATE, 0.001 + STATE / 1e8)
    after = adv.fetch_seconds("m1")
    assert before == pytest.approx(0.001 + STATE / 1e9)
    assert after == pytest.approx(0.001 + STATE / 1e8, rel=1e-3)


def test_a_fetch_faster_than_the_latency_estimate_lowers_the_latency() -> None:
    adv = advisor(default_fetch_latency_s=0.010)
    adv.observe_fetch("m1", STATE, 0.001)
    link = adv.link("m1")
    assert link.latency_s < 0.010
    assert adv.fetch_seconds("m1") == pytest.approx(0.001)


def test_calibrate_replay_uses_the_best_of_repeats() -> None:
    adv = advisor()
    calls: list[tuple[int, int]] = []
    ticks = itertools.chain.from_iterable((0.0, d) for d in (0.010, 0.005, 0.008))
    cost = adv.calibrate_replay(
        lambda tokens, layers: calls.append((tokens, layers)), repeats=3, timer=lambda: next(ticks)
    )
    assert calls == [(128, 20)] * 3
    assert cost == pytest.approx(0.005 / (128 * 20))
    assert adv.replay_seconds() == pytest.approx(0.005)


def test_bad_measurements_and_config_are_rejected() -> None:
    adv = advisor()
    with pytest.raises(InvalidArgument, match="seconds"):
        adv.observe_fetch("m1", STATE, 0)
    with pytest.raises(InvalidArgument, match="nbytes"):
        adv.observe_fetch("m1", 0, 1.0)
    with pytest.raises(InvalidArgument, match="repeats"):
        adv.calibrate_replay(lambda t, layer: None, repeats=0)
    with pytest.raises(InvalidArgument, match="stored_layers"):
        FetchReplayAdvisor(config=SWAConfig(), state_bytes=1, stored_layers=0, replay_tokens=1)
    with pytest.raises(ConfigError, match="estimate_alpha"):
        SWAConfig(estimate_alpha=1.5)
