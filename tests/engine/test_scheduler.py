"""Scheduler side: what the connector asks the tier and decides per request, with no tensors.

The tier is real checksummed files (``DirectoryTier``) or a gRPC client to a port nobody
listens on; the only seam moved by hand is the clock of the retry window.
"""

from __future__ import annotations

import dataclasses
import socket

import numpy as np
import pytest

from kvstore.api.client import KVStoreClient
from kvstore.engine.groups import FULL, SLIDING, CacheGroup, EngineGroups
from kvstore.engine.scheduler import PagedScheduler
from kvstore.errors import ConfigError
from kvstore.keys import BLOCK_TOKENS, key_words
from kvstore.tier.files import DirectoryTier
from kvstore.tier.records import DirectGrant, HitAnswer, HitRequest, Layout

FINGERPRINT = b"scheduler-test".ljust(32, b"\0")
PAGE = 8192
NAMES = tuple(f"model.layers.{i}.attn" for i in range(4))


@pytest.fixture
def file_tier(tmp_path) -> DirectoryTier:
    return DirectoryTier(tmp_path / "tier")


def prompt_of(length: int, seed: int = 3) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, 1000, length)]


def full_attention(tier) -> PagedScheduler:
    return PagedScheduler(tier, FINGERPRINT, mode="full-attention")


def store_blocks(tier: DirectoryTier, prompt: list[int], blocks: int) -> None:
    keys = full_attention(tier).keys(prompt, blocks)
    tier.put_blocks(keys, [bytes([i]) * 64 for i in range(blocks)])


def test_hits_are_whole_blocks_and_leave_one_token_to_compute(file_tier) -> None:
    prompt = prompt_of(3 * BLOCK_TOKENS + 1)
    store_blocks(file_tier, prompt, 3)
    s = full_attention(file_tier)
    assert s.matched_tokens("short", prompt[:100], 0) == 0
    assert s.matched_tokens("exact", prompt[:256], 0) == 128  # 256 would leave nothing to run
    assert s.matched_tokens("plus1", prompt[:257], 0) == 256
    assert s.matched_tokens("local", prompt[:385], 128) == 256  # the engine has block 0 itself
    with pytest.raises(Exception, match="whole"):
        s.matched_tokens("odd", prompt, 100)


def allocated_hit(tier: DirectoryTier) -> tuple[PagedScheduler, list[int]]:
    """A 300-token prompt whose two full blocks are in the tier, matched and allocated
    to blocks 3, 4, 5."""
    prompt = prompt_of(300)
    store_blocks(tier, prompt, 2)
    s = full_attention(tier)
    assert s.matched_tokens("r", prompt, 0) == 256
    s.allocated("r", [3, 4, 5], 256)
    return s, prompt


def test_a_hit_becomes_one_load_of_the_blocks_the_engine_allocated(file_tier) -> None:
    s, prompt = allocated_hit(file_tier)
    s.step("r", prompt, len(prompt), table=[3, 4, 5])
    plan = s.build()
    (load,) = plan.loads
    assert load.block_ids == (3, 4) and load.keys == tuple(bytes(k) for k in s.keys(prompt, 2))
    assert not load.asynchronous and load.windows == ()
    assert plan.saves == []  # what it loaded is in the tier already; the tail is not full


def test_a_load_dropped_before_its_step_is_not_sent(file_tier) -> None:
    s, _ = allocated_hit(file_tier)
    assert s.finished("r") is False
    assert s.build().loads == []


def test_a_tier_that_does_not_answer_is_a_miss_and_is_left_alone_for_a_while() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    now = [0.0]
    client = KVStoreClient(f"127.0.0.1:{port}", timeout_s=1.0)
    try:
        s = PagedScheduler(
            client, FINGERPRINT, mode="full-attention", retry_after_s=5, clock=lambda: now[0]
        )
        prompt = prompt_of(600)
        assert [s.matched_tokens(f"r{i}", prompt, 0) for i in range(3)] == [0, 0, 0]
        assert (s.lookups, s.lookup_failures) == (1, 1)  # asked once, then left alone
        now[0] = 6.0
        assert s.matched_tokens("later", prompt, 0) == 0
        assert (s.lookups, s.lookup_failures) == (2, 2)
    finally:
        client.close()


def test_groups_say_what_goes_where_and_refuse_what_cannot_be_served_exactly() -> None:
    groups = EngineGroups(
        BLOCK_TOKENS, PAGE, NAMES, (CacheGroup(SLIDING, (0, 2), 128), CacheGroup(FULL, (1, 3)))
    )
    assert groups.hybrid and groups.hit_mode == "exact-window"
    assert (groups.full_group, groups.sliding_groups, groups.window_blocks) == (1, (0,), 1)
    assert groups.block_bytes == 2 * PAGE and groups.state_bytes == 2 * PAGE
    kv = groups.kv_layout()
    assert kv.block_layers == (1, 3) and kv.state_layers == (0, 2)
    assert groups.layout(FINGERPRINT) == Layout(FINGERPRINT, 2 * PAGE, 2 * PAGE)
    wide = EngineGroups(
        BLOCK_TOKENS, PAGE, NAMES[:2], (CacheGroup(SLIDING, (0,), 300), CacheGroup(FULL, (1,)))
    )
    assert wide.window_blocks == 3  # 299 earlier tokens span three blocks
    with pytest.raises(ConfigError, match="exactly one full-attention"):
        EngineGroups(
            BLOCK_TOKENS, PAGE, NAMES[:2], (CacheGroup(FULL, (0,)), CacheGroup(FULL, (1,)))
        )
    with pytest.raises(ConfigError, match="cannot serve mamba"):
        EngineGroups(
            BLOCK_TOKENS, PAGE, NAMES[:2], (CacheGroup(FULL, (0,)), CacheGroup("mamba", (1,)))
        )
    with pytest.raises(ConfigError, match="one sliding window"):
        EngineGroups(
            BLOCK_TOKENS,
            PAGE,
            NAMES[:3],
            (
                CacheGroup(SLIDING, (0,), 128),
                CacheGroup(SLIDING, (1,), 512),
                CacheGroup(FULL, (2,)),
            ),
        )


class _Granting:
    """A tier that answers a lease asked for ``direct``ly with a grant naming its hit blocks
    (the gateway's, in shape; the scheduler only passes it on)."""

    def __init__(self, tier: DirectoryTier) -> None:
        self._tier = tier
        self.asked_direct: list[bool] = []

    def query_hit(self, request: HitRequest) -> HitAnswer:
        self.asked_direct.append(request.direct)
        answer = self._tier.query_hit(request)
        n = len(answer.hit_block_keys)
        grant = DirectGrant(
            capability=b"cap",
            keys=key_words(list(answer.hit_block_keys)),
            placements=np.arange(n * 12, dtype=np.int32).reshape(n, 12),
            sizes=np.full(n, 64, np.int64),
            endpoints={0: ("127.0.0.1", 1)},
            k=10,
            m=2,
        )
        return dataclasses.replace(answer, direct=grant if request.direct else None)

    def release_lease(self, lease_id: str) -> bool:
        return self._tier.release_lease(lease_id)


def test_a_load_carries_its_part_of_the_leases_read_grant(file_tier) -> None:
    prompt = prompt_of(3 * BLOCK_TOKENS + 1)
    store_blocks(file_tier, prompt, 3)
    tier = _Granting(file_tier)
    s = full_attention(tier)
    assert s.matched_tokens("r", prompt, BLOCK_TOKENS) == 2 * BLOCK_TOKENS  # it has block 0
    assert tier.asked_direct == [True]
    s.allocated("r", [7, 8, 9, 10], 2 * BLOCK_TOKENS)
    s.step("r", prompt, len(prompt), table=[7, 8, 9, 10])
    (load,) = s.build().loads
    assert load.block_ids == (8, 9) and load.direct is not None
    assert [key for key, _, _ in load.direct.blocks()] == list(load.keys)
    assert np.array_equal(load.direct.placements, np.arange(12, 36).reshape(2, 12))


def test_a_computed_block_the_tier_holds_is_not_saved_again(file_tier) -> None:
    # A prompt of whole blocks: its last block is never part of a hit (a token is always
    # computed), yet the tier may hold it (the same prompt seen before). Saving it again cost a
    # warm request ~10 ms of a 2-core host (a 1.5 MiB put the tier answers "existing").
    prompt = prompt_of(2 * BLOCK_TOKENS)
    store_blocks(file_tier, prompt, 2)
    request = HitRequest(
        block_keys=full_attention(file_tier).keys(prompt, 2),
        prompt_len=len(prompt),
        mode="full-attention",
    )
    answer = file_tier.query_hit(request)
    assert answer.plan.hit_tokens == BLOCK_TOKENS and answer.stored_blocks == 2
    s = full_attention(file_tier)
    assert s.matched_tokens("r", prompt, 0) == BLOCK_TOKENS
    s.allocated("r", [3, 4], BLOCK_TOKENS)
    s.step("r", prompt, len(prompt), table=[3, 4])
    plan = s.build()
    assert [load.block_ids for load in plan.loads] == [(3,)]
    assert plan.saves == []
    # Where the tier holds only the first block, the computed one is saved.
    other = prompt_of(2 * BLOCK_TOKENS, seed=4)
    store_blocks(file_tier, other, 1)
    s = full_attention(file_tier)
    assert s.matched_tokens("q", other, 0) == BLOCK_TOKENS
    s.allocated("q", [5, 6], BLOCK_TOKENS)
    s.step("q", other, len(other), table=[5, 6])
    (save,) = s.build().saves
    assert save.block_ids == (6,) and save.keys == (bytes(s.keys(other, 2)[1]),)
