"""Load or recompute (``kvstore.engine.worth`` and the scheduler's use of it): a hit is taken
only when loading it beats computing it, by the engine's own measured rates. Pure logic: a
clock the test moves, a real file tier for the scheduler's lookups."""

from __future__ import annotations

import dataclasses

import pytest
from test_scheduler import FINGERPRINT, file_tier, prompt_of, store_blocks  # noqa: F401

from kvstore.engine.scheduler import PagedScheduler
from kvstore.engine.worth import LoadWorth
from kvstore.errors import ConfigError
from kvstore.keys import BLOCK_TOKENS
from kvstore.tier.files import DirectoryTier
from kvstore.tier.records import HitAnswer, HitRequest

BLOCK_BYTES = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def measured(clock: Clock, *, tokens_per_s: float, bytes_per_s: float) -> LoadWorth:
    """A judge that has seen a few prefill steps and loads at these rates."""
    worth = LoadWorth(clock=clock)
    for _ in range(3):
        worth.step_planned(4096, with_loads=False)
        clock.now += 4096 / tokens_per_s
    worth.step_planned(1, with_loads=False)  # a decode step: ends the last prefill's timing
    worth.loaded(64 * BLOCK_BYTES, 64 * BLOCK_BYTES / bytes_per_s)
    return worth


def test_a_fresh_engine_loads_until_it_has_measured_both_rates() -> None:
    clock = Clock()
    worth = LoadWorth(clock=clock)
    assert worth.verdict(8192, 64 * BLOCK_BYTES).load
    worth.loaded(64 * BLOCK_BYTES, 100.0)  # a very slow load, but no compute figure yet
    verdict = worth.verdict(8192, 64 * BLOCK_BYTES)
    assert verdict.load and verdict.load_s is None


def test_a_hit_slower_to_load_than_to_compute_is_recomputed() -> None:
    clock = Clock()
    # Prefill at 20,000 tokens/s; 8,192 tokens are 64 MiB: 0.41 s to compute.
    fast = measured(clock, tokens_per_s=20_000, bytes_per_s=1e9)  # 0.067 s to load
    verdict = fast.verdict(8192, 64 * BLOCK_BYTES)
    assert verdict.load and verdict.load_s == pytest.approx(0.0671, rel=0.01)
    assert verdict.compute_s == pytest.approx(8192 / 20_000, rel=0.01)
    slow = measured(clock, tokens_per_s=20_000, bytes_per_s=50e6)  # 1.34 s to load
    verdict = slow.verdict(8192, 64 * BLOCK_BYTES)
    assert not verdict.load and "recomputing" in verdict.describe()


def test_the_fastest_recent_load_is_the_estimate_so_small_loads_latency_does_not_count() -> None:
    clock = Clock()
    worth = measured(clock, tokens_per_s=20_000, bytes_per_s=1e9)
    for _ in range(5):  # small loads: mostly their fixed latency, 50 MB/s by bytes over time
        worth.loaded(2 * BLOCK_BYTES, 2 * BLOCK_BYTES / 50e6)
    verdict = worth.verdict(8192, 64 * BLOCK_BYTES)
    assert verdict.load and verdict.load_s == pytest.approx(64 * BLOCK_BYTES / 1e9, rel=0.01)


def test_steps_with_loads_or_few_tokens_are_not_compute_figures() -> None:
    clock = Clock()
    worth = LoadWorth(clock=clock, min_step_tokens=512)
    worth.loaded(BLOCK_BYTES, 1.0)
    for tokens, loads in ((4096, True), (100, False)):  # waited on a load; a decode step
        worth.step_planned(tokens, with_loads=loads)
        clock.now += 10.0
    worth.step_planned(1, with_loads=False)
    assert worth.verdict(BLOCK_TOKENS, BLOCK_BYTES).compute_s is None


def test_old_figures_are_forgotten_so_a_slow_tier_is_tried_again() -> None:
    clock = Clock()
    worth = measured(clock, tokens_per_s=20_000, bytes_per_s=50e6)
    assert not worth.verdict(8192, 64 * BLOCK_BYTES).load
    clock.now += 121.0
    assert worth.verdict(8192, 64 * BLOCK_BYTES).load  # unknown again: load, and measure


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError):
        LoadWorth(min_step_tokens=0)


class LeasingTier:
    """The file tier (which takes no leases) answering with a lease id, and the ids given
    back: what the scheduler does with a lease is what is checked."""

    def __init__(self, tier: DirectoryTier) -> None:
        self._tier = tier
        self.released: list[str] = []

    def query_hit(self, request: HitRequest) -> HitAnswer:
        answer = self._tier.query_hit(request)
        return dataclasses.replace(answer, lease_id="lease-1") if answer.hit_keys.size else answer

    def release_lease(self, lease_id: str) -> bool:
        self.released.append(lease_id)
        return True


def judged_scheduler(tier: LeasingTier, worth: LoadWorth) -> PagedScheduler:
    return PagedScheduler(
        tier,  # type: ignore[arg-type]
        FINGERPRINT,
        mode="full-attention",
        worth=worth,
        block_bytes=BLOCK_BYTES,
    )


def test_the_scheduler_turns_down_a_slow_hit_and_gives_its_lease_back(file_tier) -> None:  # noqa: F811
    prompt = prompt_of(3 * BLOCK_TOKENS + 1)
    store_blocks(file_tier, prompt, 3)
    clock, tier = Clock(), LeasingTier(file_tier)
    slow = judged_scheduler(tier, measured(clock, tokens_per_s=20_000, bytes_per_s=1e6))
    assert slow.matched_tokens("r", prompt, 0) == 0
    assert slow.matched_tokens("r", prompt, 0) == 0 and slow.recomputed == 1  # judged once
    slow.allocated("r", [1, 2, 3, 4], 0)
    assert tier.released == ["lease-1"]  # the hit's lease was given back
    assert slow.build().loads == []
    fast = judged_scheduler(tier, measured(clock, tokens_per_s=20_000, bytes_per_s=1e10))
    assert fast.matched_tokens("r", prompt, 0) == 3 * BLOCK_TOKENS and fast.recomputed == 0
    fast.allocated("r", [1, 2, 3, 4], 3 * BLOCK_TOKENS)
    (load,) = fast.build().loads
    assert load.lease_id == "lease-1" and len(load.keys) == 3


# --- a fresh engine: the tier's prefill figure and a probe of the load path ---------------------


def test_a_fresh_engine_weighs_a_probe_against_the_tiers_prefill_figure() -> None:
    clock = Clock()
    worth = LoadWorth(clock=clock)
    # Nothing to weigh a probe against: no probe, and the hit is loaded (a healthy tier).
    assert worth.probe_budget(0.0) is None and worth.verdict(8192, 64 * BLOCK_BYTES).load
    # The tier knows the model's prefill rate: a probe may take two blocks' compute.
    assert worth.probe_budget(20_000.0) == pytest.approx(2 * BLOCK_TOKENS / 20_000)
    worth.probed(BLOCK_BYTES, BLOCK_BYTES / 5e6)  # one block over a 5 MB/s link
    assert worth.probe_budget(20_000.0) is None  # one probe decides
    verdict = worth.verdict(8192, 64 * BLOCK_BYTES, 20_000.0)
    assert not verdict.load and verdict.load_s == pytest.approx(64 * BLOCK_BYTES / 5e6)
    assert verdict.compute_s == pytest.approx(8192 / 20_000)
    assert "(probed)" in verdict.describe() and "the tier's figure" in verdict.describe()
    healthy = LoadWorth(clock=clock)
    healthy.probed(BLOCK_BYTES, BLOCK_BYTES / 300e6)  # a gateway read on one machine
    assert healthy.verdict(8192, 64 * BLOCK_BYTES, 20_000.0).load


def test_own_figures_win_over_the_tiers_and_the_probes() -> None:
    clock = Clock()
    worth = measured(clock, tokens_per_s=20_000, bytes_per_s=1e9)
    worth.probed(BLOCK_BYTES, 1.0)  # a probe that met a hiccup: a real load's figure wins
    # The tier's figure says computing is very slow; this engine's own says it is fast.
    verdict = worth.verdict(8192, 64 * BLOCK_BYTES, 10.0)
    assert verdict.compute_s == pytest.approx(8192 / 20_000, rel=0.01)
    assert verdict.load_s == pytest.approx(64 * BLOCK_BYTES / 1e9, rel=0.01)
    assert worth.prefill_rate() == pytest.approx(20_000, rel=0.01)
    assert LoadWorth(clock=clock).prefill_rate() == 0.0


def test_a_probe_ages_out_like_a_load_so_the_path_is_probed_again() -> None:
    clock = Clock()
    worth = LoadWorth(clock=clock)
    worth.probed(BLOCK_BYTES, 1.0)
    assert worth.probe_budget(1000.0) is None
    clock.now += 121.0
    assert worth.probe_budget(1000.0) == pytest.approx(2 * BLOCK_TOKENS / 1000)


def test_a_probe_cut_at_its_budget_means_recompute_whatever_the_hits_size() -> None:
    for blocks in (1, 8, 64):
        worth = LoadWorth(clock=Clock())
        budget = worth.probe_budget(5_000.0)
        assert budget is not None
        worth.probed(BLOCK_BYTES, budget)  # what the probe answers when the block is late
        verdict = worth.verdict(blocks * BLOCK_TOKENS, blocks * BLOCK_BYTES, 5_000.0)
        assert not verdict.load and verdict.load_s == pytest.approx(2 * verdict.compute_s)


class PriorTier(LeasingTier):
    """A leasing tier whose answers carry a prefill figure for the model, as the gateway's
    do once an engine of it reported one; it records what the engine reported."""

    def __init__(self, tier: DirectoryTier, prefill: float) -> None:
        super().__init__(tier)
        self.prefill = prefill
        self.reported: list[float] = []

    def query_hit(self, request: HitRequest) -> HitAnswer:
        self.reported.append(request.prefill_tokens_per_s)
        return dataclasses.replace(super().query_hit(request), prefill_tokens_per_s=self.prefill)


def test_a_fresh_engines_first_hit_on_a_slow_tier_is_probed_and_recomputed(file_tier) -> None:  # noqa: F811
    prompt = prompt_of(8 * BLOCK_TOKENS + 1)
    store_blocks(file_tier, prompt, 8)
    tier, probes = PriorTier(file_tier, prefill=20_000.0), []

    def probe(answer: HitAnswer, budget_s: float) -> tuple[int, float]:
        probes.append(len(answer.hit_block_keys))
        assert budget_s == pytest.approx(2 * BLOCK_TOKENS / 20_000)
        return BLOCK_BYTES, BLOCK_BYTES / 1e6  # 1 MB/s: 8 MiB load ≈ 8.4 s, compute 0.05 s

    slow = PagedScheduler(
        tier,  # type: ignore[arg-type]
        FINGERPRINT,
        mode="full-attention",
        worth=LoadWorth(clock=Clock()),
        block_bytes=BLOCK_BYTES,
        probe=probe,
    )
    assert slow.matched_tokens("r", prompt, 0) == 0 and slow.recomputed == 1
    assert probes == [8] and tier.reported == [0.0]  # a fresh engine reports no figure
    slow.allocated("r", [1] * 9, 0)
    assert tier.released == ["lease-1"]
    # The hit's blocks are in the tier already: computing them saves none of them again.
    slow.step("r", prompt, len(prompt), table=list(range(9)))
    assert slow.build().saves == []
    # A second hit: the probe's figure stands, no second probe.
    assert slow.matched_tokens("r2", prompt, 0) == 0 and probes == [8]


def test_a_fresh_engines_first_hit_on_a_healthy_tier_is_loaded(file_tier) -> None:  # noqa: F811
    prompt = prompt_of(8 * BLOCK_TOKENS + 1)
    store_blocks(file_tier, prompt, 8)
    fast = PagedScheduler(
        PriorTier(file_tier, prefill=20_000.0),  # type: ignore[arg-type]
        FINGERPRINT,
        mode="full-attention",
        worth=LoadWorth(clock=Clock()),
        block_bytes=BLOCK_BYTES,
        probe=lambda answer, budget_s: (BLOCK_BYTES, BLOCK_BYTES / 1e9),
    )
    assert fast.matched_tokens("r", prompt, 0) == 8 * BLOCK_TOKENS and fast.recomputed == 0


def test_an_engine_reports_its_own_prefill_rate_with_its_lookups(file_tier) -> None:  # noqa: F811
    prompt = prompt_of(2 * BLOCK_TOKENS + 1)
    tier, clock = PriorTier(file_tier, prefill=0.0), Clock()
    scheduler = judged_scheduler(tier, measured(clock, tokens_per_s=20_000, bytes_per_s=1e9))
    scheduler.matched_tokens("r", prompt, 0)
    assert tier.reported == [pytest.approx(20_000, rel=0.01)]
