"""Loads that land in the KV rows themselves (``kvstore.engine.sharedkv``): a CPU engine's cache
moved into shared memory, a real fetcher process writing the request's rows, a directory tier.

The rule that keeps this safe is tested here too: a step never ends while a fetch may still
write its rows (vLLM recomputes a failed load's rows after the step, or gives them to another
request); a fetch that does not end is stopped by killing its fetcher."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvstore.engine.fetcher import Fetcher, FileGate
from kvstore.engine.plan import PagedLoad, StepPlan
from kvstore.engine.rows import KVRows, as_ids
from kvstore.engine.sharedkv import SharedKV
from kvstore.engine.swapin import LoadTarget, SwapIn
from kvstore.engine.worker import PagedWorker
from kvstore.errors import InvalidArgument
from kvstore.keys import BLOCK_TOKENS, block_keys
from kvstore.tier.files import DirectoryTier

LAYERS, BLOCKS, SHAPE = 4, 16, (2, BLOCK_TOKENS, 8)
ROW = int(np.prod(SHAPE)) * 4
FINGERPRINT = b"in-place-test".ljust(32, b"\0")


def nan_cache() -> list[torch.Tensor]:
    return [torch.full((BLOCKS, *SHAPE), float("nan")) for _ in range(LAYERS)]


def store(tier: DirectoryTier, blocks: int, seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(seed)
    keys = block_keys(FINGERPRINT, rng.integers(2, 1000, blocks * BLOCK_TOKENS))
    payloads = [rng.integers(0, 256, LAYERS * ROW, dtype=np.uint8).tobytes() for _ in keys]
    tier.put_blocks(keys, payloads)
    return [bytes(k) for k in keys], payloads


def loaded(cache: list[torch.Tensor], block: int, payload: bytes) -> bool:
    return all(
        cache[layer][block].numpy().tobytes() == payload[layer * ROW : (layer + 1) * ROW]
        for layer in range(LAYERS)
    )


def untouched(cache: list[torch.Tensor], block: int, layers=range(LAYERS)) -> bool:
    return all(torch.isnan(cache[layer][block]).all() for layer in layers)


@pytest.fixture
def tier(tmp_path) -> DirectoryTier:
    """Blocks of any size (conftest's tier holds a model preset's; its ``area`` is used as is)."""
    return DirectoryTier(tmp_path / "tier")


def test_moving_the_cache_keeps_its_bytes_and_every_view_sharing_them() -> None:
    raw = torch.randn(2, BLOCKS, 64)
    first, second = raw[0], raw[1]  # two layers' views of one storage, as vLLM may make
    other = torch.randn(BLOCKS, 32).to(torch.bfloat16)
    before = [first.clone(), second.clone(), other.clone()]
    kernel = first.view(BLOCKS * 2, 32)  # a layer's own view, as vLLM may bind (kernel blocks)
    foreign = torch.zeros(4)
    at = first.data_ptr()
    with pytest.raises(ValueError, match="views"):  # the engine would compute on other memory
        SharedKV.move([first, second, other], views=[kernel, foreign])
    assert first.data_ptr() == at  # nothing moved
    # A layer's tensor twice (layers sharing their KV), a view of its own.
    shared = SharedKV.move([first, second, other, second], views=[kernel])
    try:
        assert all(shared.holds(t) for t in (first, second, other, kernel))
        assert all(torch.equal(a, b) for a, b in zip((first, second, other), before, strict=True))
        assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
        assert shared.places[1] - shared.places[0] == BLOCKS * 64 * 4
        first[5].fill_(3.0)
        assert bool((kernel[10:12] == 3.0).all())  # the layer and its view: still one memory
        first[3].fill_(7.0)  # the engine's writes are the file's
        view = np.frombuffer(os.pread(shared.fd, 4, shared.places[0] + 3 * 64 * 4), np.float32)
        assert view[0] == 7.0
    finally:
        shared.close()
    with pytest.raises(ValueError, match="not the CPU"):
        SharedKV.move([torch.empty(2, 2, device="meta")])


def test_a_load_given_rows_writes_exactly_its_blocks_into_the_cache_without_a_copy(
    tier, area
) -> None:
    cache = nan_cache()
    shared = SharedKV.move(cache)
    rows = KVRows.of(cache, None)
    swapin = SwapIn(rows, area=area, layer_timeout_s=60)
    copies: list[int] = []
    swapin._scatter = lambda layer, ids, staged: copies.append(layer)  # type: ignore[method-assign]
    keys, payloads = store(tier, 5)
    block_ids = [9, 2, 14, 0, 5]
    try:
        with Fetcher(tier.factory(), area, rows.kv, shared=shared) as fetcher:
            staged = fetcher.submit(keys, rows=block_ids)
            result = swapin.submit(staged, LoadTarget("req", as_ids(block_ids))).result(60)
            assert staged.wait_finished(60)
            assert staged.layout.total_bytes < LAYERS * ROW  # the region holds the header only
            with pytest.raises(InvalidArgument, match="rows"):
                fetcher.submit(keys[:1], rows=[BLOCKS])
            with pytest.raises(InvalidArgument, match="rows"):
                fetcher.submit(keys[:2], rows=[1])
    finally:
        swapin.close()
        shared.close()
    assert result.error is None and result.blocks_loaded == 5 and copies == []
    assert all(loaded(cache, b, p) for b, p in zip(block_ids, payloads, strict=True))
    assert all(untouched(cache, b) for b in set(range(BLOCKS)) - set(block_ids))
    assert area.free_bytes == area.capacity


def test_a_fetcher_without_a_shared_cache_refuses_rows(tier, area) -> None:
    rows = KVRows.of(nan_cache(), None)
    keys, _ = store(tier, 1)
    with Fetcher(tier.factory(), area, rows.kv) as fetcher:
        with pytest.raises(InvalidArgument, match="no shared KV cache"):
            fetcher.submit(keys, rows=[0])


def _worker(tier: DirectoryTier, cache: list[torch.Tensor], **options) -> PagedWorker:
    return PagedWorker(cache, tier.factory(), tier, staging_bytes=16 << 20, **options)


def test_a_worker_on_a_cpu_cache_loads_in_place_and_can_be_told_not_to(tier) -> None:
    keys, payloads = store(tier, 3, seed=1)
    for in_place in (True, False):
        cache = nan_cache()
        worker = _worker(tier, cache, layer_timeout_s=60, loads_in_place=in_place)
        try:
            assert (worker.shared is not None) == in_place
            worker.start(StepPlan(loads=[PagedLoad("r", (4, 7, 1), tuple(keys))]))
            for layer in range(LAYERS):
                worker.wait_layer(layer)
            worker.finish_step()
            assert worker.load_errors() == set()
        finally:
            worker.close()
        assert all(loaded(cache, b, p) for b, p in zip((4, 7, 1), payloads, strict=True))


def test_a_step_never_ends_while_its_fetch_may_still_write_the_rows(tmp_path, tier) -> None:
    keys, payloads = store(tier, 2, seed=2)
    cache = nan_cache()
    worker = _worker(tier, cache, layer_timeout_s=2.0)
    gate = FileGate(tmp_path / "gate", timeout_s=60)
    os.makedirs(gate.directory)
    try:
        worker.fetcher.close()
        stuck = worker.fetcher = Fetcher(
            tier.factory(), worker.area, worker.kv, shared=worker.shared, gate=gate
        )
        gate.open(0, 1, 2, 3)
        assert stuck.submit(keys[:1]).wait_finished(60)  # started and warm
        for layer in (1, 2, 3):
            os.unlink(os.path.join(gate.directory, f"open-{layer}"))
        # The next fetch writes layer 0 into the rows, then stalls before layer 1.
        worker.start(StepPlan(loads=[PagedLoad("r", (3, 8), tuple(keys))]))
        for layer in range(LAYERS):
            worker.wait_layer(layer)  # layer 1 times out: the load is given up on
        worker.finish_step()
        assert worker.load_errors() == {3, 8}  # vLLM recomputes these rows after the step
        assert not untouched(cache, 3, layers=(0,))  # layer 0 had landed in place
        gate.open(1, 2, 3)  # were the stalled fetch alive, it would write layers 1-3 now
        if stuck.alive:  # (only when the rule is broken) its next job runs after those writes
            stuck.submit(keys[:1]).wait_finished(60)
        assert untouched(cache, 3, layers=(1, 2, 3)) and untouched(cache, 8, layers=(1, 2, 3))
        assert not stuck.alive and worker.fetcher is not stuck
        # The new fetcher lands loads in place.
        assert worker.fetcher.submit(keys, rows=[5, 6]).wait_finished(60)
    finally:
        worker.close()
    assert all(loaded(cache, b, p) for b, p in zip((5, 6), payloads, strict=True))
