"""docs/rules.md §5 hit rule and §6 store positions, with the article's numbers.

Expected values in the tables are worked out by hand in the comments (never by calling the code
under test): cap = L − 134, L1 = whole blocks of min(B, cap), back off 128 when SWA at L1 is
missing, store at floor((L − 1)/128)·128.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import hitplan
from kvstore.errors import InvalidArgument
from kvstore.hitplan import (
    BOUNDED_REPLAY,
    FULL_ATTENTION,
    STANDARD,
    check_store_position,
    chunked_prefill_store_position,
    decode_boundary_crossed,
    decode_snapshot_anchor,
    decode_store_position,
    hit_cap,
    is_store_position,
    plan_hit,
    prefill_store_position,
)

# --- hand-computed tables --------------------------------------------------------------------

# (L, B, SWA positions, cap, L1, hit, store_at)
STANDARD_CASES = [
    # 1300 − 134 = 1166; 1166 // 128 = 9 → 1152 < B 1280; SWA at 1152 → hit 1152;
    # store (1299 // 128 = 10) · 128 = 1280.
    (1300, 1280, {1152}, 1166, 1152, 1152, 1280),
    # Same, SWA missing → back off one block: 1152 − 128 = 1024.
    (1300, 1280, set(), 1166, 1152, 1024, 1280),
    # SWA only at 1024 (a real store position, but not L1) is not looked at → still 1024 by
    # back-off, and swa_hit stays False (checked separately below).
    (1300, 1280, {1024}, 1166, 1152, 1024, 1280),
    # B within the cap: L1 = B = 640; SWA at 640 → 640.
    (1300, 640, {640}, 1166, 640, 640, 1280),
    # L = 134: cap 0 → no block, hit 0; store (133 // 128 = 1) · 128 = 128.
    (134, 128, {128}, 0, 0, 0, 128),
    # L = 135: cap 1 → no whole block; store (134 // 128 = 1) · 128 = 128.
    (135, 128, {128}, 1, 0, 0, 128),
    # L = 261: cap 127, one token short of a block → 0; store (260 // 128 = 2) · 128 = 256.
    (261, 128, {128}, 127, 0, 0, 256),
    # L = 262: cap 128 exactly → L1 = 128; SWA at 128 → 128; store (261 // 128 = 2) → 256.
    (262, 128, {128}, 128, 128, 128, 256),
    # L = 262, SWA missing → 128 − 128 = 0.
    (262, 128, set(), 128, 128, 0, 256),
    # L = 263: cap 129 → L1 128; store (262 // 128 = 2) → 256.
    (263, 128, {128}, 129, 128, 128, 256),
    # L = 128·2 = 256: cap 122 → 0; store (255 // 128 = 1) → 128.
    (256, 256, {128, 256}, 122, 0, 0, 128),
    # L = 128·2 + 1 = 257: cap 123 → 0; store (256 // 128 = 2) → 256.
    (257, 256, {128, 256}, 123, 0, 0, 256),
    # L = 128·8 = 1024, every block cached (B 1024 is above the cap 890): 890 // 128 = 6 →
    # L1 768; SWA at 768 → 768; store (1023 // 128 = 7) → 896.
    (1024, 1024, {768}, 890, 768, 768, 896),
    # L = 128·8 + 1 = 1025: cap 891 → 768; SWA at 896 and 1024 only → back off to 640;
    # store (1024 // 128 = 8) → 1024.
    (1025, 1024, {896, 1024}, 891, 768, 640, 1024),
    # L = 128: cap 0; store (127 // 128 = 0) → nothing.
    (128, 128, {128}, 0, 0, 0, None),
    # L = 1: the smallest prompt.
    (1, 0, set(), 0, 0, 0, None),
    # Long prompt, nothing cached: hit 0 (store 4999 // 128 = 39 → 4992).
    (5000, 0, {2560}, 4866, 0, 0, 4992),
    # Long prompt, B 2560 well inside the cap 4866 → L1 2560, SWA there → 2560.
    (5000, 2560, {2560}, 4866, 2560, 2560, 4992),
    # SWA at unaligned positions near L1 is never a match: 1151 and 1153 ≠ 1152 → 1024.
    (1300, 1280, {1151, 1153, 1166}, 1166, 1152, 1024, 1280),
]


@pytest.mark.parametrize(
    ("length", "block_hit", "swa", "cap", "l1", "hit", "store"), STANDARD_CASES
)
def test_standard_rule_hand_computed(length, block_hit, swa, cap, l1, hit, store):
    plan = plan_hit(length, block_hit, swa)
    assert plan.mode == STANDARD
    assert plan.prompt_len == length
    assert plan.cap == cap
    assert plan.block_run_tokens == block_hit
    assert plan.block_hit_tokens == l1
    assert plan.hit_tokens == hit
    assert plan.compute_from == hit
    assert plan.compute_tokens == length - hit
    assert plan.store_at == store
    assert plan.swa_position == (l1 if l1 else None)
    assert plan.swa_hit == (l1 > 0 and l1 in swa)
    assert plan.replay_start is None
    assert plan.replay_tokens == 0


# (L, B, SWA positions, L1 = hit, swa_hit, replay_start, replay_tokens)
BOUNDED_CASES = [
    # 1300: L1 1152 (as above). SWA missing → still hit 1152, replay [1024, 1152).
    (1300, 1280, set(), 1152, False, 1024, 128),
    # SWA present → no replay.
    (1300, 1280, {1152}, 1152, True, None, 0),
    # Wrong-position SWA (1024) does not help: replay [1024, 1152).
    (1300, 1280, {1024}, 1152, False, 1024, 128),
    # L 262: L1 128; missing → replay the very first block [0, 128), hit 128.
    (262, 128, set(), 128, False, 0, 128),
    # L 200: cap 66 → nothing to reuse, nothing to replay.
    (200, 128, set(), 0, False, None, 0),
    # L 1025: cap 891 → L1 768; missing → replay [640, 768).
    (1025, 1024, {1024}, 768, False, 640, 128),
]


@pytest.mark.parametrize(
    ("length", "block_hit", "swa", "hit", "found", "replay_start", "replay_tokens"), BOUNDED_CASES
)
def test_bounded_replay_hand_computed(
    length, block_hit, swa, hit, found, replay_start, replay_tokens
):
    plan = plan_hit(length, block_hit, swa, mode=BOUNDED_REPLAY)
    assert plan.mode == BOUNDED_REPLAY
    assert plan.block_hit_tokens == hit
    assert plan.hit_tokens == hit
    assert plan.swa_hit is found
    assert plan.replay_start == replay_start
    assert plan.replay_tokens == replay_tokens
    # Replay rebuilds SWA only: the first token computed is still L1, not the replay start.
    assert plan.compute_from == hit


# (L, B, hit): full attention keeps 1 token to compute: cap L − 1, whole blocks, no SWA.
FULL_ATTENTION_CASES = [
    (100, 0, 0),  # shorter than a block
    (128, 128, 0),  # exactly one block: cap 127 holds no whole block
    (129, 128, 128),
    (256, 256, 128),  # exactly two blocks: cap 255 → one
    (257, 256, 256),
    (1300, 1280, 1280),  # the standard rule would stop at 1152 (cap 1166) and back off
    (1300, 512, 512),  # the run, not the cap, is what limits
]


@pytest.mark.parametrize(("length", "block_hit", "hit"), FULL_ATTENTION_CASES)
def test_full_attention_hand_computed(length, block_hit, hit):
    plan = plan_hit(length, block_hit, None, mode=FULL_ATTENTION)
    assert plan.cap == length - 1
    assert plan.block_hit_tokens == plan.hit_tokens == plan.compute_from == hit
    assert plan.swa_position is None and not plan.swa_hit and plan.replay_tokens == 0
    assert hit_cap(length, mode=FULL_ATTENTION) == length - 1
    assert ("full attention" in plan.reason) == (hit > 0)


# (L, store position): floor((L − 1) / 128) · 128, None when 0.
STORE_CASES = [
    (1, None),
    (127, None),
    (128, None),  # 127 // 128 = 0
    (129, 128),  # 128 // 128 = 1
    (255, 128),
    (256, 128),  # one token held back: 255 // 128 = 1
    (257, 256),
    (1300, 1280),
    (2560, 2432),  # 2559 // 128 = 19 → 2432
    (2561, 2560),
]


@pytest.mark.parametrize(("length", "store"), STORE_CASES)
def test_prefill_store_position(length, store):
    assert prefill_store_position(length) == store
    assert plan_hit(length, 0).store_at == store


def test_cap_is_prompt_minus_134():
    assert hit_cap(1300) == 1166
    assert hit_cap(134) == 0
    assert hit_cap(135) == 1
    assert hit_cap(50) == 0
    # Backtracking is part of the cap: 8 instead of 6 → 1300 − 136.
    assert hit_cap(1300, max_backtracking=8) == 1164


# --- the rule's finer points -----------------------------------------------------------------


def test_swa_is_looked_up_only_at_l1():
    asked: list[int] = []

    def lookup(position: int) -> bool:
        asked.append(position)
        return True

    plan_hit(1300, 1280, lookup)
    assert asked == [1152]
    asked.clear()
    plan_hit(1300, 1280, lookup, mode=BOUNDED_REPLAY)
    assert asked == [1152]


def test_no_swa_lookup_when_nothing_hits():
    asked: list[int] = []
    plan = plan_hit(200, 128, lambda position: asked.append(position) or True)
    assert asked == []
    assert plan.swa_position is None and plan.swa_hit is False


def test_swa_location_is_reported():
    plan = plan_hit(1300, 1280, {1152: "node-7", 1024: "node-1"})
    assert (plan.swa_hit, plan.swa_location, plan.hit_tokens) == (True, "node-7", 1152)
    plan = plan_hit(1300, 1280, lambda position: "node-2" if position == 1152 else None)
    assert (plan.swa_hit, plan.swa_location) == (True, "node-2")
    plan = plan_hit(1300, 1280, {1024: "node-1"})
    assert (plan.swa_hit, plan.swa_location, plan.hit_tokens) == (False, None, 1024)


def test_per_block_flags_use_the_leading_run():
    # L 1000 has 7 full blocks; the run stops at the first False: 2 blocks = 256 ≤ cap 866.
    plan = plan_hit(1000, [True, True, False, True, True], {256})
    assert (plan.block_run_tokens, plan.block_hit_tokens, plan.hit_tokens) == (256, 256, 256)
    assert plan_hit(1000, np.array([False, True]), {128}).hit_tokens == 0
    assert plan_hit(1000, [], {128}).hit_tokens == 0
    # All 7 blocks cached: run 896 above the cap 866 → L1 768.
    assert plan_hit(1000, [True] * 7, set()).block_hit_tokens == 768


def test_block_hit_above_the_cap_is_truncated_not_rejected():
    plan = plan_hit(1300, 1280, {1152})
    assert plan.block_run_tokens == 1280
    assert plan.block_hit_tokens == 1152
    assert "truncated" in plan.reason


def test_prefill_then_next_turn_reuses_exactly_what_was_stored():
    # Turn 1: a 1300-token prompt stores its state at 1280 (§6).
    stored = {plan_hit(1300, 0).store_at}
    assert stored == {1280}
    # Turn 2: 1500 tokens, all ten first blocks cached: cap 1366 → L1 1280, found → 1280.
    assert plan_hit(1500, 1280, stored).hit_tokens == 1280
    # Had turn 1 been exactly 1280 tokens, it would have stored at 1152, not 1280:
    # the same turn 2 then finds no state at L1 and backs off to 1152.
    assert plan_hit(1500, 1280, {plan_hit(1280, 0).store_at}).hit_tokens == 1152


def test_geometry_object_is_duck_typed():
    geo = SimpleNamespace(window=128, max_backtracking=7, block_tokens=128)
    # 262 − 135 = 127 → no whole block, whereas the default 134 gives L1 128.
    assert plan_hit(262, 128, {128}).hit_tokens == 128
    plan = plan_hit(262, 128, {128}, geometry=geo)
    assert (plan.cap, plan.hit_tokens, plan.max_backtracking) == (127, 0, 7)
    # An explicit argument that agrees with the geometry is fine; one that disagrees is not.
    assert plan_hit(262, 128, {128}, geometry=geo, max_backtracking=7).cap == 127
    with pytest.raises(InvalidArgument) as caught:
        plan_hit(262, 128, {128}, geometry=geo, max_backtracking=8)
    assert caught.value.argument == "max_backtracking"
    with pytest.raises(InvalidArgument) as caught:
        plan_hit(262, 128, {128}, geometry=SimpleNamespace(window=128, block_tokens=128))
    assert caught.value.argument == "geometry"


def test_real_geometry_config_is_accepted():
    from kvstore.geometry import GeometryConfig

    # 262 − (128 + 7) = 127 → no whole block; the default geometry gives one.
    assert plan_hit(262, 128, {128}, geometry=GeometryConfig()).hit_tokens == 128
    plan = plan_hit(262, 128, {128}, geometry=GeometryConfig(max_backtracking=7))
    assert (plan.cap, plan.hit_tokens) == (127, 0)


def test_plan_rebuilt_from_wire_fields_needs_no_context():
    # The gRPC HitPlan message carries only the rule's outputs; the context fields default.
    plan = hitplan.HitPlan(
        prompt_len=1300,
        mode=STANDARD,
        cap=1166,
        block_hit_tokens=1152,
        hit_tokens=1024,
        swa_hit=False,
        swa_position=1152,
        replay_start=None,
        replay_tokens=0,
        compute_from=1024,
        store_at=1280,
    )
    assert plan.block_run_tokens is None
    assert plan.reason.startswith("SWA state at 1152 missing → back off one block")
    assert plan == dataclasses.replace(plan_hit(1300, 1152, set()), block_run_tokens=None)
    assert plan.to_dict()["compute_tokens"] == 276


def test_to_dict_is_json_ready():
    import json

    data = json.loads(json.dumps(plan_hit(1300, 1280, set(), mode=BOUNDED_REPLAY).to_dict()))
    assert data["hit_tokens"] == 1152
    assert data["block_hit_tokens"] == 1152
    assert data["swa_hit"] is False
    assert (data["replay_start"], data["replay_tokens"]) == (1024, 128)
    assert data["compute_from"] == 1152
    assert data["store_at"] == 1280
    assert plan_hit(100, 0).to_dict()["store_at"] is None


def test_plan_is_frozen():
    plan = plan_hit(1300, 1280)
    with pytest.raises(AttributeError):
        plan.hit_tokens = 5  # type: ignore[misc]


# --- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "argument"),
    [
        ((-1, 0), {}, "prompt_len"),
        ((0, 0), {}, "prompt_len"),
        ((1.5, 0), {}, "prompt_len"),
        ((True, 0), {}, "prompt_len"),
        (("300", 0), {}, "prompt_len"),
        ((300, -128), {}, "block_hit_tokens"),
        ((300, 100), {}, "block_hit_tokens"),
        ((300, 128.0), {}, "block_hit_tokens"),
        ((300, True), {}, "block_hit_tokens"),
        ((300, 384), {}, "block_hit_tokens"),  # 300 tokens hold only 2 full blocks
        ((300, [True, True, True]), {}, "block_hit_tokens"),
        ((300, [1, 0]), {}, "block_hit_tokens"),
        ((300, np.ones((1, 2), dtype=bool)), {}, "block_hit_tokens"),
        ((300, np.array([1, 1])), {}, "block_hit_tokens"),
        ((300, 128), {"mode": "fast"}, "mode"),
        ((300, 128, "128"), {}, "swa_available"),
        ((300, 128, 128), {}, "swa_available"),
        ((300, 128, lambda position: 3), {}, "swa_available"),
        ((300, 128), {"window": 0}, "window"),
        ((300, 128), {"max_backtracking": -1}, "max_backtracking"),
        ((300, 128), {"block_tokens": 0}, "block_tokens"),
    ],
)
def test_bad_arguments_are_named(args, kwargs, argument):
    with pytest.raises(InvalidArgument) as caught:
        plan_hit(*args, **kwargs)
    assert caught.value.argument == argument
    assert str(caught.value).startswith(f"{argument}: ")


# --- §6 store positions ------------------------------------------------------------------


def test_chunked_prefill_stores_only_after_the_last_chunk():
    # Chunk ends 512 and 1024 are aligned, but only the last chunk (1300) stores: 1280.
    assert chunked_prefill_store_position([512, 1024, 1300]) == 1280
    assert chunked_prefill_store_position((100,)) is None
    assert chunked_prefill_store_position(np.array([300, 1025])) == 1024


@pytest.mark.parametrize("chunks", [[], [200, 100], [100, 100], [0, 10], [-5], [1.5], "12"])
def test_chunked_prefill_rejects_bad_chunk_ends(chunks):
    with pytest.raises(InvalidArgument) as caught:
        chunked_prefill_store_position(chunks)
    assert caught.value.argument.startswith("chunk_ends")


# (copy position, anchor): the boundary below; overrun ≤ 5.
@pytest.mark.parametrize(
    ("copy", "anchor"), [(128, 128), (133, 128), (256, 256), (261, 256), (1029, 1024)]
)
def test_decode_snapshot_anchor(copy, anchor):
    assert decode_snapshot_anchor(copy) == anchor
    assert decode_store_position(copy) == anchor


@pytest.mark.parametrize("copy", [0, 5, 127, 134, 262, 1030, -1])
def test_decode_snapshot_overrun_or_no_boundary_is_rejected(copy):
    with pytest.raises(InvalidArgument) as caught:
        decode_snapshot_anchor(copy)
    assert caught.value.argument == "copy_position"


def test_decode_overrun_limit_follows_backtracking():
    # 8 spare slots absorb 7; 1 spare slot absorbs none.
    assert decode_snapshot_anchor(263, max_backtracking=8) == 256
    assert decode_snapshot_anchor(256, max_backtracking=1) == 256
    with pytest.raises(InvalidArgument):
        decode_snapshot_anchor(257, max_backtracking=1)


def test_decode_without_a_copy_stores_nothing():
    assert decode_store_position(None) is None


@pytest.mark.parametrize(
    ("before", "after", "boundary"),
    [
        (127, 128, 128),  # lands exactly on the boundary
        (122, 128, 128),
        (127, 133, 128),  # a 6-token speculative step: 5 past
        (120, 130, 128),
        (128, 129, None),  # 128 was crossed by an earlier step
        (200, 250, None),
        (250, 256, 256),
        (0, 5, None),
        (5, 5, None),
    ],
)
def test_decode_boundary_crossed(before, after, boundary):
    assert decode_boundary_crossed(before, after) == boundary


def test_decode_boundary_crossed_rejects_overrun_and_going_back():
    with pytest.raises(InvalidArgument) as caught:
        decode_boundary_crossed(127, 134)  # 6 past 128
    assert caught.value.argument == "new_len"
    with pytest.raises(InvalidArgument) as caught:
        decode_boundary_crossed(10, 5)
    assert caught.value.argument == "new_len"


@pytest.mark.parametrize(
    ("position", "allowed"),
    [
        (0, False),
        (128, True),
        (129, False),
        (256, True),
        (1000, False),
        (-128, False),
        (True, False),
        (128.0, False),
        ("128", False),
        (np.int64(1024), True),
    ],
)
def test_is_store_position(position, allowed):
    assert is_store_position(position) is allowed


def test_check_store_position_names_the_argument():
    assert check_store_position(1024) == 1024
    for bad in (0, 1000, -128, 1.5, None):
        with pytest.raises(InvalidArgument) as caught:
            check_store_position(bad, "swa_position")
        assert caught.value.argument == "swa_position"


# --- properties --------------------------------------------------------------------------


@st.composite
def prompts(draw):
    length = draw(st.integers(min_value=1, max_value=40_000))
    blocks = draw(st.integers(min_value=0, max_value=length // 128))
    block_hit = blocks * 128
    # SWA states at a random mix of aligned, unaligned and around-L1 positions.
    swa = draw(
        st.sets(
            st.one_of(
                st.integers(min_value=0, max_value=length).map(lambda p: p // 128 * 128),
                st.integers(min_value=0, max_value=length),
            ),
            max_size=8,
        )
    )
    mode = draw(st.sampled_from([STANDARD, BOUNDED_REPLAY]))
    return length, block_hit, swa, mode


@settings(max_examples=400, deadline=None)
@given(prompts())
def test_properties_of_every_plan(case):
    length, block_hit, swa, mode = case
    plan = plan_hit(length, block_hit, swa, mode=mode)
    l1 = plan.block_hit_tokens
    cap = max(length - 134, 0)
    assert plan.cap == cap
    # L1: whole blocks, within the cap and the block run, and the largest such.
    assert l1 % 128 == 0 and l1 <= cap and l1 <= block_hit
    assert l1 + 128 > min(block_hit, cap)
    hit = plan.hit_tokens
    assert hit % 128 == 0
    assert 0 <= hit <= cap
    assert hit <= block_hit
    # The last 134 tokens (all of a shorter prompt) are always computed.
    assert length - plan.compute_from >= min(134, length)
    assert plan.compute_from == hit
    if l1 == 0:
        assert hit == 0 and plan.swa_position is None and not plan.swa_hit
    else:
        assert plan.swa_position == l1
        assert plan.swa_hit == (l1 in swa)
        assert hit in {l1, l1 - 128}
    if mode == BOUNDED_REPLAY:
        assert hit == l1
        if l1 and not plan.swa_hit:
            assert (plan.replay_start, plan.replay_tokens) == (l1 - 128, 128)
        else:
            assert (plan.replay_start, plan.replay_tokens) == (None, 0)
    else:
        assert hit == (l1 if plan.swa_hit or l1 == 0 else l1 - 128)
        assert plan.replay_start is None
    if plan.store_at is not None:
        assert is_store_position(plan.store_at)
        assert 1 <= length - plan.store_at <= 128


@settings(max_examples=200, deadline=None)
@given(prompts(), st.integers(min_value=0, max_value=4))
def test_more_cache_never_means_less_hit(case, extra_blocks):
    length, block_hit, swa, mode = case
    more_blocks = min(block_hit + 128 * extra_blocks, length // 128 * 128)
    base = plan_hit(length, block_hit, swa, mode=mode).hit_tokens
    assert plan_hit(length, more_blocks, swa, mode=mode).hit_tokens >= base
    assert plan_hit(length, block_hit, lambda _: True, mode=mode).hit_tokens >= base


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=20_000), st.data())
def test_flags_and_token_count_agree(length, data):
    full = length // 128
    flags = data.draw(st.lists(st.booleans(), max_size=full))
    run = 0
    while run < len(flags) and flags[run]:
        run += 1
    swa = {run * 128}
    assert plan_hit(length, flags, swa) == plan_hit(length, run * 128, swa)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=100_000), st.integers(min_value=0, max_value=6))
def test_decode_steps_of_at_most_six_tokens_always_fit_the_ring(before, step):
    after = before + step
    boundary = decode_boundary_crossed(before, after)
    if boundary is not None:
        assert before < boundary <= after
        assert after - boundary <= 5
        assert decode_snapshot_anchor(after) == boundary
        assert is_store_position(boundary)


def test_module_reads_no_environment(monkeypatch):
    # The article's trap: a backtracking change picked up from the environment and cached.
    monkeypatch.setenv("DEEPINFER_MAX_BACKTRACKING_TOKENS", "40")
    assert hitplan.hit_cap(1300) == 1166
