"""Both halves of the connector core (scheduler and worker sides) without an engine, dense model.

Two "engines" are two sets of per-layer KV tensors shaped like vLLM's CPU cache
(``[num_blocks, kv_heads, 128, 2 × head_size]``); the tier is real checksummed files
(``DirectoryTier``) read by a real fetcher process; the only seam moved by hand is the clock
of the scheduler's retry window.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvstore.engine.plan import StepPlan
from kvstore.engine.scheduler import PagedScheduler
from kvstore.engine.worker import PagedWorker
from kvstore.keys import BLOCK_TOKENS
from kvstore.tier.files import DirectoryTier

FINGERPRINT = b"paged-test-engine".ljust(32, b"\0")
LAYERS, BLOCKS, SHAPE = 2, 8, (2, BLOCK_TOKENS, 64)


def engine_tensors(seed: int | None) -> list[torch.Tensor]:
    """One engine's KV cache: random when it computed something, NaN when it did not (a
    block that was never written is visible as NaN, never as plausible numbers)."""
    if seed is None:
        return [torch.full((BLOCKS, *SHAPE), float("nan")) for _ in range(LAYERS)]
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn((BLOCKS, *SHAPE), generator=generator) for _ in range(LAYERS)]


class Engine:
    """One engine's connector halves over its tensors, driven step by step like an engine."""

    def __init__(self, tier: DirectoryTier, seed: int | None, **scheduler: object) -> None:
        self.tensors = engine_tensors(seed)
        self.scheduler = PagedScheduler(tier, FINGERPRINT, mode="full-attention", **scheduler)
        self.worker = PagedWorker(
            self.tensors, tier.factory(), tier, staging_bytes=16 << 20, layer_timeout_s=60
        )

    def run_step(self) -> StepPlan:
        plan = self.scheduler.build()
        self.worker.start(plan)
        for layer in range(LAYERS):
            self.worker.wait_layer(layer)
            self.worker.save_layer(layer)
        self.worker.finish_step()
        return plan

    def serve(self, request: str, prompt: list[int], table: list[int], computed: int = 0) -> int:
        """Prefill ``prompt`` into ``table``; returns the tokens loaded from the tier."""
        external = self.scheduler.matched_tokens(request, prompt, computed)
        self.scheduler.allocated(request, table, external)
        self.scheduler.step(request, prompt, len(prompt), table=table)
        self.run_step()
        return external

    def close(self) -> None:
        self.worker.close()


@pytest.fixture
def file_tier(tmp_path) -> DirectoryTier:
    return DirectoryTier(tmp_path / "tier")


@pytest.fixture
def engines(file_tier: DirectoryTier) -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


def prompt_of(length: int, seed: int = 3) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, 1000, length)]


def rows(tensors: list[torch.Tensor], block: int) -> list[torch.Tensor]:
    return [t[block] for t in tensors]


def test_a_second_engine_loads_exactly_what_the_first_saved(file_tier, engines) -> None:
    a = Engine(file_tier, seed=1)
    engines.append(a)
    prompt = prompt_of(300)
    assert a.serve("r", prompt, [4, 5, 6]) == 0
    assert a.worker.flush(60)
    assert a.worker.stats.blocks_saved == 2  # 300 tokens: two full blocks, the tail is not

    b = Engine(file_tier, seed=None)
    engines.append(b)
    assert b.serve("r", prompt, [1, 0, 7]) == 256
    assert b.worker.load_errors() == set()
    for mine, theirs in ((1, 4), (0, 5)):
        for got, want in zip(rows(b.tensors, mine), rows(a.tensors, theirs), strict=True):
            assert torch.equal(got, want)
    assert torch.isnan(b.tensors[0][7]).all()  # block 7 holds the tail: never loaded
    assert b.worker.stats.bytes_loaded == 2 * b.worker.block_bytes
    assert b.worker.stats.blocks_saved == 0  # what it loaded is in the tier already


def test_a_corrupt_block_is_reported_for_recompute_and_never_written(file_tier, engines) -> None:
    a = Engine(file_tier, seed=1)
    engines.append(a)
    prompt = prompt_of(300)
    a.serve("r", prompt, [4, 5, 6])
    assert a.worker.flush(60)
    keys = a.scheduler.keys(prompt, 2)
    path = file_tier.block_path(keys[1])
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte: its checksum fails
    path.write_bytes(bytes(data))

    b = Engine(file_tier, seed=None)
    engines.append(b)
    assert b.serve("r", prompt, [1, 0, 7]) == 256  # the index still lists it
    assert b.worker.load_errors() == {0}
    assert torch.isnan(b.tensors[0][0]).all() and torch.isnan(b.tensors[1][0]).all()
    assert torch.equal(b.tensors[1][1], a.tensors[1][4])
    assert b.worker.stats.blocks_failed == 1 and b.worker.load_errors() == set()


def test_a_finished_request_keeps_its_blocks_until_its_saves_are_gathered(
    file_tier, engines
) -> None:
    a = Engine(file_tier, seed=1)
    engines.append(a)
    prompt = prompt_of(300)
    a.scheduler.matched_tokens("r", prompt, 0)
    a.scheduler.allocated("r", [0, 1, 2], 0)
    a.scheduler.step("r", prompt, 300, table=[0, 1, 2])
    plan = a.scheduler.build()
    assert a.scheduler.finished("r") is True  # its save is planned, not yet gathered
    assert a.scheduler.finished("never-seen") is False
    a.worker.start(plan)
    for layer in range(LAYERS):
        a.worker.save_layer(layer)
    a.worker.finish_step()
    follow = a.run_step()
    assert follow.finished == {"r": 1}
    assert a.worker.finished_saving() == {"r"}
    assert a.worker.finished_saving() == set()


def test_the_worker_refuses_tensors_it_cannot_treat_as_block_rows() -> None:
    tier_factory = DirectoryTier  # never reached: the checks come first
    with pytest.raises(Exception, match="blocks"):
        PagedWorker(
            [torch.zeros(4, 8), torch.zeros(5, 8)], tier_factory, None, staging_bytes=1 << 20
        )
    with pytest.raises(Exception, match="contiguous"):
        PagedWorker([torch.zeros(8, 4).t()], tier_factory, None, staging_bytes=1 << 20)
