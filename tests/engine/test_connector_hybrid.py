"""A hybrid model's connector core without an engine: full-attention blocks to the block tier,
the sliding window's state to the SWA tier, loads that fill every full block of the hit and only
the window of each sliding group, all or nothing.

The "model" has four layers alternating sliding-window (window 128) and full attention, in two
KV-cache groups as vLLM's hybrid manager makes them; each engine's cache is per-layer tensors
(NaN where nothing was written); the tier is real checksummed files (``DirectoryTier``) read by a
real fetcher process.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvstore.engine.groups import FULL, SLIDING, CacheGroup, EngineGroups
from kvstore.engine.plan import StepPlan
from kvstore.engine.scheduler import PagedScheduler
from kvstore.engine.worker import PagedWorker
from kvstore.keys import BLOCK_TOKENS
from kvstore.tier.files import DirectoryTier

BLOCKS, SHAPE = 16, (2, BLOCK_TOKENS, 16)
PAGE = int(np.prod(SHAPE)) * 4
NAMES = tuple(f"model.layers.{i}.attn" for i in range(4))
#: vLLM's order for the tiny Gemma-3: group 0 the sliding layers (0, 2), group 1 the full ones.
GROUPS = EngineGroups(
    BLOCK_TOKENS,
    PAGE,
    NAMES,
    (CacheGroup(SLIDING, (0, 2), 128), CacheGroup(FULL, (1, 3))),
)
FINGERPRINT = b"hybrid-test-engine".ljust(32, b"\0")


class Engine:
    """One engine's connector halves over its tensors, driven step by step like vLLM."""

    def __init__(self, tier: DirectoryTier, seed: int | None) -> None:
        if seed is None:
            self.tensors = [torch.full((BLOCKS, *SHAPE), float("nan")) for _ in NAMES]
        else:
            generator = torch.Generator().manual_seed(seed)
            self.tensors = [torch.randn((BLOCKS, *SHAPE), generator=generator) for _ in NAMES]
        self.scheduler = PagedScheduler(
            tier, GROUPS.group_fingerprint(FINGERPRINT), mode=GROUPS.hit_mode, groups=GROUPS
        )
        self.worker = PagedWorker(
            self.tensors,
            tier.factory(),
            tier,
            groups=GROUPS,
            staging_bytes=16 << 20,
            layer_timeout_s=60,
        )

    def run_step(self) -> StepPlan:
        plan = self.scheduler.build()
        self.worker.start(plan)
        for layer in range(len(NAMES)):
            self.worker.wait_layer(layer)
            self.worker.save_layer(layer)
        self.worker.finish_step()
        return plan

    def wait_loaded(self) -> tuple[set[str], set[str]]:
        done: set[str] = set()
        failed: set[str] = set()
        for _ in range(600):
            more, bad = self.worker.finished_loading()
            done |= more
            failed |= bad
            if done:
                return done, failed
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            import time

            time.sleep(0.05)
        raise AssertionError("the load never finished")


@pytest.fixture
def file_tier(tmp_path) -> DirectoryTier:
    return DirectoryTier(tmp_path / "tier")


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.worker.close()


def prompt_of(length: int, seed: int = 5) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, 1000, length)]


def tables(sliding: list[int], full: list[int]) -> tuple[list[int], list[int]]:
    return (sliding, full)


def test_a_fresh_engine_loads_every_full_block_and_only_the_window(file_tier, engines) -> None:
    a = Engine(file_tier, seed=1)
    engines.append(a)
    prompt = prompt_of(700)  # 5 full blocks; the prefill store position is 640
    a_tables = tables([0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11])
    assert a.scheduler.matched_tokens("r", prompt, 0) == 0
    a.scheduler.allocated("r", a_tables, 0)
    a.scheduler.step("r", prompt, len(prompt), table=a_tables)
    plan = a.run_step()
    assert [s.state.position for s in plan.saves if s.state] == [640]
    assert a.worker.flush(60)
    assert (a.worker.stats.blocks_saved, a.worker.stats.states_saved) == (5, 1)

    b = Engine(file_tier, seed=None)
    engines.append(b)
    assert b.scheduler.matched_tokens("r", prompt, 0) == 640
    # vLLM's table for a 640-token hit: the sliding group's earlier entries are its null block.
    b_tables = tables([0, 0, 0, 0, 12, 13], [1, 2, 3, 4, 5, 14])
    b.scheduler.allocated("r", b_tables, 640)
    plan = b.run_step()
    (load,) = plan.loads
    assert load.asynchronous and load.windows == ((12,),) and load.state_position == 640
    assert b.wait_loaded() == ({"r"}, set())
    for layer in (1, 3):  # full attention: every block of the hit
        for mine, theirs in zip([1, 2, 3, 4, 5], [6, 7, 8, 9, 10], strict=True):
            assert torch.equal(b.tensors[layer][mine], a.tensors[layer][theirs])
        assert torch.isnan(b.tensors[layer][14]).all()
    for layer in (0, 2):  # sliding window: only the block that ends at the hit
        assert torch.equal(b.tensors[layer][12], a.tensors[layer][4])
        assert torch.isnan(b.tensors[layer][13]).all()
        assert torch.isnan(b.tensors[layer][1:12]).all()
    stats = b.worker.stats
    assert (stats.blocks_loaded, stats.states_loaded) == (5, 1)
    assert stats.bytes_loaded == 5 * GROUPS.block_bytes
    assert stats.state_bytes_loaded == GROUPS.state_bytes  # the window, not the prefix


def test_a_load_with_a_damaged_block_fails_whole_and_writes_nothing(file_tier, engines) -> None:
    a = Engine(file_tier, seed=2)
    engines.append(a)
    prompt = prompt_of(400, seed=9)  # store position 384
    a_tables = tables([0, 1, 2, 3], [4, 5, 6, 7])
    a.scheduler.matched_tokens("r", prompt, 0)
    a.scheduler.allocated("r", a_tables, 0)
    a.scheduler.step("r", prompt, len(prompt), table=a_tables)
    a.run_step()
    assert a.worker.flush(60)

    b = Engine(file_tier, seed=None)
    engines.append(b)
    assert b.scheduler.matched_tokens("r", prompt, 0) == 384
    keys = b.scheduler.keys(prompt, 3)
    path = file_tier.block_path(keys[1])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    b.scheduler.allocated("r", tables([0, 0, 8, 9], [1, 2, 3, 10]), 384)
    b.run_step()
    assert b.wait_loaded() == ({"r"}, {"r"})
    assert all(torch.isnan(t).all() for t in b.tensors)
    assert b.worker.stats.loads_failed == 1
    # vLLM asks again for the request it now computes from the start: no hit is offered again
    # (the same load could fail the same way, forever).
    assert b.scheduler.matched_tokens("r", prompt, 0) == 0


def test_a_decode_state_is_held_and_stored_when_the_request_ends(file_tier, engines) -> None:
    a = Engine(file_tier, seed=3)
    engines.append(a)
    prompt = prompt_of(250, seed=4)  # store position 128
    grown = prompt + prompt_of(20, seed=6)  # decode crosses 256
    a_tables = tables([0, 1], [4, 5])
    a.scheduler.matched_tokens("r", prompt, 0)
    a.scheduler.allocated("r", a_tables, 0)
    a.scheduler.step("r", prompt, 250, table=a_tables)
    assert [s.state.position for s in a.run_step().saves if s.state] == [128]
    a.scheduler.step("r", grown, 257, appended=([2], [6]))
    held = [s.state for s in a.run_step().saves if s.state]
    assert [(s.position, s.hold) for s in held] == [(256, True)]
    assert a.worker.flush(60)
    key = bytes(a.scheduler.keys(grown, 2)[-1])
    assert file_tier.get_swa_state(key, 256, state_bytes=GROUPS.state_bytes).state is None
    assert a.scheduler.finished("r") is True
    plan = a.run_step()
    assert plan.ended == ["r"]
    assert a.worker.flush(60)
    stored = file_tier.get_swa_state(key, 256, state_bytes=GROUPS.state_bytes).state
    assert stored is not None
    window = np.concatenate(
        [a.tensors[layer][1].numpy().view(np.uint8).ravel() for layer in (0, 2)]
    )
    assert stored == window.tobytes()
