"""query_hit over both tiers against hand-computed docs/rules.md §5 cases (in-process tiers), every
case run through both drivers of the one plan: from a thread (``query_hit``) and from an asyncio
loop (``query_hit_async``, the gateway's)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kvstore.errors import InvalidArgument, StoreError
from kvstore.geometry import GeometryConfig
from kvstore.keys import BlockKey, block_keys, words_to_keys
from kvstore.pending import Pending
from kvstore.swa.advice import FetchReplayAdvisor
from kvstore.swa.config import SWAConfig
from kvstore.swa.directory import StoreRef
from kvstore.tier.hit import HitQuery, HitResult
from kvstore.tier.records import HitRequest

GEOMETRY = GeometryConfig.default()
M0 = StoreRef("m0", "swa-store-m0")
M1 = StoreRef("m1", "swa-store-m1")


@dataclass
class Lease:
    keys: tuple[BlockKey, ...]


@dataclass
class Blocks:
    """Block tier stand-in: a set of cached keys, leases counted."""

    cached: set[BlockKey] = field(default_factory=set)
    asked: list[int] = field(default_factory=list)
    leases: list[Lease] = field(default_factory=list)
    released: list[Lease] = field(default_factory=list)
    fail: bool = False

    def lookup(self, keys: np.ndarray) -> Pending[tuple[int, Lease]]:
        return Pending.of(lambda: self.run(keys))  # answered when waited for, either way

    def run(self, keys: np.ndarray) -> tuple[int, Lease]:
        keys = words_to_keys(keys)  # the hit query hands keys over as (n, 4) words
        self.asked.append(len(keys))
        if self.fail:
            raise StoreError("meta shard unreachable")
        run = 0
        for key in keys:
            if key not in self.cached:
                break
            run += 1
        lease = Lease(tuple(keys[:run]))
        self.leases.append(lease)
        return run, lease

    def release(self, lease: Lease) -> None:
        self.released.append(lease)


@dataclass
class States:
    where: dict[BlockKey, StoreRef] = field(default_factory=dict)
    asked: list[tuple[BlockKey, int, str | None]] = field(default_factory=list)

    def locate(
        self, key: BlockKey, position: int, prefer_machine: str | None = None
    ) -> Pending[StoreRef | None]:
        def answer() -> StoreRef | None:
            self.asked.append((key, position, prefer_machine))
            return self.where.get(key)

        async def later() -> StoreRef | None:
            await asyncio.sleep(0)  # a real await: the plan must survive being suspended here
            return answer()

        return Pending(answer, later)


class Driven:
    """A ``HitQuery`` whose ``query_hit`` runs through the driver under test."""

    def __init__(self, query: HitQuery, driver: str) -> None:
        self._query = query
        self._driver = driver

    def query_hit(self, keys_or_tokens: Any, prompt_len: int, mode: str = "standard") -> HitResult:
        # The request is checked where it is made: a bad one never reaches the query.
        as_tokens = isinstance(keys_or_tokens, np.ndarray) or (
            bool(keys_or_tokens) and isinstance(keys_or_tokens[0], int | np.integer)
        )
        request = HitRequest(
            token_ids=keys_or_tokens if as_tokens else None,
            block_keys=None if as_tokens else keys_or_tokens,
            prompt_len=prompt_len,
            mode=mode,
        )
        if self._driver == "sync":
            return self._query.query_hit(request)
        return asyncio.run(self._query.query_hit_async(request))


DRIVER = ["sync"]


@pytest.fixture(autouse=True, params=["sync", "async"])
def driver(request: pytest.FixtureRequest) -> str:
    DRIVER[0] = request.param
    return request.param


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.int64)


def setup(
    prompt_len: int,
    cached_blocks: int,
    swa_at: dict[int, StoreRef],
    local: str | None = "m0",
    replay_cost: float = 1e-6,
) -> tuple[HitQuery, Blocks, States, list[BlockKey]]:
    keys = block_keys(GEOMETRY.fingerprint(), tokens(prompt_len))
    blocks = Blocks(cached=set(keys[:cached_blocks]))
    states = States({keys[p // 128 - 1]: owner for p, owner in swa_at.items()})
    advisor = FetchReplayAdvisor(
        config=SWAConfig(replay_cost_per_token_layer_s=replay_cost),
        state_bytes=GEOMETRY.state_size_to_disk,
        stored_layers=len(GEOMETRY.stored_swa_layers),
        replay_tokens=GEOMETRY.window,
    )
    query = HitQuery(
        blocks=blocks, states=states, advisor=advisor, geometry=GEOMETRY, local_machine=local
    )
    return Driven(query, DRIVER[0]), blocks, states, keys  # type: ignore[return-value]


# L = 1000: cap = 1000 - 134 = 866 → 6 whole blocks (768) inside it; 7 full blocks in the prompt.


def test_full_run_with_state_found_hits_l1_and_names_the_owner() -> None:
    query, blocks, states, keys = setup(1000, 7, {768: M1})
    for mode in ("standard", "bounded-replay"):
        result = query.query_hit(keys, 1000, mode)
        plan = result.plan
        assert (plan.cap, plan.block_hit_tokens, plan.hit_tokens) == (866, 768, 768)
        assert plan.swa_hit and plan.swa_position == 768 and plan.swa_location == "m1"
        assert (plan.replay_start, plan.replay_tokens, plan.compute_from) == (None, 0, 768)
        assert plan.store_at == 896  # floor(999 / 128) * 128
        assert result.swa_owner == M1 and result.swa_key == keys[5]
        # The 7th block never hits (past the cap) but is looked up with the run: it is stored.
        assert result.leased_blocks == 7 and result.lease.keys == tuple(keys[:7])
        assert result.answer(None).stored_blocks == 7
        assert result.advice is not None and result.advice.owner_machine == "m1"
        assert not result.advice.local
        assert result.miss_plan is not None and not result.miss_plan.swa_hit
    # The 6 blocks inside the cap and the 7th past it were asked about (all leased with the
    # run): the 7th never hits, and the answer says it is stored.
    assert blocks.asked == [7, 7]
    assert states.asked == [(keys[5], 6 * 128, "m0")] * 2


def test_state_missing_backs_off_one_block_in_standard_mode() -> None:
    query, _, _, keys = setup(1000, 7, {640: M1})  # a state elsewhere than L1 does not count
    result = query.query_hit(keys, 1000, "standard")
    plan = result.plan
    assert (plan.block_hit_tokens, plan.hit_tokens, plan.compute_from) == (768, 640, 640)
    assert not plan.swa_hit and plan.swa_position == 768
    assert (plan.replay_start, plan.replay_tokens) == (None, 0)
    assert result.swa_owner is None and result.advice is None and result.miss_plan is None
    assert result.leased_blocks == 7


def test_state_missing_replays_128_tokens_in_bounded_replay_mode() -> None:
    query, _, _, keys = setup(1000, 7, {})
    plan = query.query_hit(keys, 1000, "bounded-replay").plan
    assert (plan.block_hit_tokens, plan.hit_tokens, plan.compute_from) == (768, 768, 768)
    assert (plan.replay_start, plan.replay_tokens) == (640, 128)
    assert not plan.swa_hit


def test_a_gap_in_the_block_run_limits_l1() -> None:
    # Blocks 0..2 cached, block 3 missing (blocks after it cached: ignored, not consecutive).
    query, blocks, states, keys = setup(1000, 3, {384: M0})
    blocks.cached |= set(keys[4:])
    result = query.query_hit(keys, 1000, "standard")
    assert (result.plan.block_hit_tokens, result.plan.hit_tokens) == (384, 384)
    assert result.swa_key == keys[2] and result.swa_owner == M0
    assert result.advice is not None and result.advice.local
    assert result.leased_blocks == 3


def test_one_cached_block_without_state_backs_off_to_zero() -> None:
    query, _, _, keys = setup(1000, 1, {})
    standard = query.query_hit(keys, 1000, "standard").plan
    assert (standard.block_hit_tokens, standard.hit_tokens) == (128, 0)
    bounded = query.query_hit(keys, 1000, "bounded-replay").plan
    assert (bounded.hit_tokens, bounded.replay_start, bounded.replay_tokens) == (128, 0, 128)


@pytest.mark.parametrize(("prompt_len", "expected_blocks"), [(262, 1), (261, 0), (134, 0)])
def test_the_cap_l_minus_134(prompt_len: int, expected_blocks: int) -> None:
    query, blocks, states, keys = setup(prompt_len, 10, {128: M1})
    result = query.query_hit(keys, prompt_len, "standard")
    assert result.plan.cap == prompt_len - 134
    assert result.plan.block_hit_tokens == expected_blocks * 128
    assert result.plan.hit_tokens == expected_blocks * 128
    if expected_blocks == 0:
        # Nothing inside the cap: neither tier is asked and nothing is leased.
        assert blocks.asked == [] and states.asked == [] and result.lease is None
    else:
        assert result.swa_owner == M1


def test_a_128k_prompt_with_1000_cached_blocks() -> None:
    prompt_len = 131_072  # 1,024 full blocks; cap 130,938 → 1,022 blocks
    query, blocks, _, keys = setup(prompt_len, 1000, {1000 * 128: M1})
    result = query.query_hit(keys, prompt_len, "standard")
    assert blocks.asked == [1024]  # every full block (the 2 past the cap: stored_blocks)
    assert (result.plan.block_hit_tokens, result.plan.hit_tokens) == (128_000, 128_000)
    assert result.plan.swa_hit and result.swa_key == keys[999]
    bounded = query.query_hit(keys, prompt_len, "bounded-replay")
    assert bounded.plan.hit_tokens == 128_000


def test_token_ids_give_the_same_plan_as_their_block_keys() -> None:
    query, blocks, _, keys = setup(1000, 7, {768: M1})
    by_tokens = query.query_hit(tokens(1000), 1000, "standard")
    by_keys = query.query_hit(keys, 1000, "standard")
    assert by_tokens.plan == by_keys.plan
    assert by_tokens.lease.keys == tuple(keys[:7])
    assert query.query_hit(list(tokens(1000)), 1000).plan == by_keys.plan


def test_advice_chooses_by_the_estimates() -> None:
    query, _, _, keys = setup(1000, 7, {768: M1}, replay_cost=1e-5)
    advice = query.query_hit(keys, 1000).advice
    assert advice is not None and advice.choice == "fetch" and advice.fetch_s < advice.replay_s
    query, _, _, keys = setup(1000, 7, {768: M1}, replay_cost=1e-8)
    advice = query.query_hit(keys, 1000).advice
    assert advice is not None and advice.choice == "replay" and advice.replay_s < advice.fetch_s


def test_bad_requests_take_no_lease() -> None:
    query, blocks, _, keys = setup(1000, 7, {})
    with pytest.raises(InvalidArgument, match="mode"):
        query.query_hit(keys, 1000, "fast")
    with pytest.raises(InvalidArgument, match="prompt_len"):
        query.query_hit(keys, 0)
    with pytest.raises(InvalidArgument, match="block_keys"):
        query.query_hit(keys + keys, 1000)
    with pytest.raises(InvalidArgument, match="token_ids"):
        query.query_hit(tokens(999), 1000)
    with pytest.raises(InvalidArgument, match=r"block_keys\[0\]"):
        query.query_hit([b"short"], 1000)
    with pytest.raises(InvalidArgument, match="token_ids"):
        HitRequest(token_ids=b"x" * 32)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="traffic_class"):
        HitRequest(block_keys=keys, prompt_len=1000, traffic_class="c" * 65)
    with pytest.raises(InvalidArgument, match="prompt_len"):
        HitRequest(block_keys=keys, prompt_len=-1)
    assert blocks.asked == [] and blocks.leases == []


def test_an_unreachable_block_tier_is_a_miss_not_an_error() -> None:
    query, blocks, states, keys = setup(1000, 7, {768: M1})
    blocks.fail = True
    result = query.query_hit(keys, 1000, "standard")
    assert result.plan.hit_tokens == 0 and result.lease is None and states.asked == []


def test_the_lease_is_released_when_planning_fails_after_it_was_taken() -> None:
    query, blocks, states, keys = setup(1000, 7, {768: M1})

    def broken(key: BlockKey, position: int, prefer_machine: str | None = None) -> StoreRef | None:
        raise RuntimeError("bug in a locator")

    states.locate = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        query.query_hit(keys, 1000)
    assert blocks.released == blocks.leases and len(blocks.leases) == 1


def test_a_block_tier_answering_nonsense_is_an_error_and_releases() -> None:
    query, blocks, _, keys = setup(1000, 7, {})

    def nonsense(keys: Sequence[BlockKey]) -> Pending[tuple[int, Lease]]:
        lease = Lease(())
        blocks.leases.append(lease)
        return Pending.done((len(keys) + 1, lease))

    blocks.lookup = nonsense  # type: ignore[method-assign]
    with pytest.raises(StoreError, match="answered 8 blocks for 7 keys"):
        query.query_hit(keys, 1000)
    assert blocks.released == blocks.leases


def test_result_is_json_ready() -> None:
    query, _, _, keys = setup(1000, 7, {768: M1})
    data = query.query_hit(keys, 1000).to_dict()
    text = json.dumps(data)
    assert '"swa_owner": {"machine_id": "m1"' in text
    assert data["plan"]["hit_tokens"] == 768 and data["advice"]["choice"] in ("fetch", "replay")


# --- exact-window mode (an engine with exact sliding-window attention: vLLM's hybrid models) ---


def test_exact_window_hits_l1_within_an_engine_cap_when_its_state_is_there() -> None:
    # L = 1000, cap L − 1 = 999 → all 7 full blocks; the state at L1 = 896 is asked first.
    query, blocks, states, keys = setup(1000, 7, {896: M1, 512: M0})
    result = query.query_hit(keys, 1000, "exact-window")
    plan = result.plan
    assert (plan.cap, plan.block_hit_tokens, plan.hit_tokens) == (999, 896, 896)
    assert plan.swa_hit and plan.swa_position == 896 and result.swa_owner == M1
    assert blocks.asked == [7]
    assert states.asked == [(keys[6], 896, "m0")]  # found at once: nothing below is asked


def test_exact_window_takes_the_highest_position_below_l1_whose_state_exists() -> None:
    query, _, states, keys = setup(1000, 7, {256: M1, 512: M0})
    result = query.query_hit(keys, 1000, "exact-window")
    plan = result.plan
    assert (plan.block_hit_tokens, plan.hit_tokens, plan.compute_from) == (896, 512, 512)
    assert plan.swa_hit and plan.swa_position == 512
    assert result.swa_owner == M0 and result.swa_key == keys[3]
    assert words_to_keys(result.hit_words) == keys[:4]
    # L1 first, then every boundary below it in one round.
    assert [p for _, p, _ in states.asked] == [896, 768, 640, 512, 384, 256, 128]


def test_exact_window_with_no_state_at_all_is_a_miss_never_an_approximate_hit() -> None:
    query, _, _, keys = setup(1000, 7, {})
    result = query.query_hit(keys, 1000, "exact-window")
    plan = result.plan
    assert (plan.block_hit_tokens, plan.hit_tokens, plan.compute_from) == (896, 0, 0)
    assert not plan.swa_hit and (plan.replay_start, plan.replay_tokens) == (None, 0)
    assert "exact attention needs the window" in plan.reason
    assert result.hit_words.shape[0] == 0
