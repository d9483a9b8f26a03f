"""Worker side, loads: fetcher process → /dev/shm staging → swap-in thread → the engine's rows.

The engine's cache is per-layer tensors shaped like vLLM's (NaN where nothing was written, so a
row never loaded is visible); the tier is real checksummed files (``DirectoryTier``) read by a
real fetcher process. CPU path; ``test_cuda.py`` runs the same mechanism on a GPU.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvstore.engine.fetcher import Fetcher, FileGate
from kvstore.engine.groups import FULL, SLIDING, CacheGroup, EngineGroups
from kvstore.engine.rows import KVRows, as_ids
from kvstore.engine.staging import PreparedStage, StageLayout, StagingArea
from kvstore.engine.swapin import LoadTarget, SwapIn
from kvstore.errors import InvalidArgument, LoadTimeout, SwapInError
from kvstore.keys import BLOCK_TOKENS, block_keys
from kvstore.tier.files import DirectoryTier

LAYERS, BLOCKS, SHAPE = 4, 16, (2, BLOCK_TOKENS, 8)
ROW = int(np.prod(SHAPE)) * 4
FINGERPRINT = b"swapin-test".ljust(32, b"\0")


def nan_cache() -> list[torch.Tensor]:
    return [torch.full((BLOCKS, *SHAPE), float("nan")) for _ in range(LAYERS)]


def row_bytes(tensors: list[torch.Tensor], layer: int, block: int) -> bytes:
    return tensors[layer][block].numpy().tobytes()


@pytest.fixture
def tier(tmp_path) -> DirectoryTier:
    return DirectoryTier(tmp_path / "tier")


@pytest.fixture
def area() -> Iterator[StagingArea]:
    with StagingArea(16 << 20) as staging:
        yield staging


@pytest.fixture
def cache() -> list[torch.Tensor]:
    return nan_cache()


@pytest.fixture
def rows(cache) -> KVRows:
    return KVRows.of(cache, None)


@pytest.fixture
def swapin(rows, area) -> Iterator[SwapIn]:
    engine = SwapIn(rows, area=area, layer_timeout_s=60)
    yield engine
    engine.close()


@pytest.fixture
def fetcher(tier, area, rows) -> Iterator[Fetcher]:
    with Fetcher(tier.factory(), area, rows.kv) as process:
        yield process


def store(
    tier: DirectoryTier, blocks: int, *, seed: int = 0, layers: int = LAYERS
) -> tuple[list[bytes], list[bytes]]:
    """``blocks`` random blocks of ``layers`` rows each put to the tier: (keys, payloads),
    payloads layer-major."""
    rng = np.random.default_rng(seed)
    keys = block_keys(FINGERPRINT, rng.integers(2, 1000, blocks * BLOCK_TOKENS))
    payloads = [rng.integers(0, 256, layers * ROW, dtype=np.uint8).tobytes() for _ in keys]
    tier.put_blocks(keys, payloads)
    return [bytes(k) for k in keys], payloads


def assert_loaded(cache, block_ids, payloads) -> None:
    for block, payload in zip(block_ids, payloads, strict=True):
        for layer in range(LAYERS):
            assert row_bytes(cache, layer, block) == payload[layer * ROW : (layer + 1) * ROW]


def untouched(cache, block: int, layers=range(LAYERS)) -> bool:
    return all(torch.isnan(cache[layer][block]).all() for layer in layers)


def target(request: str, ids, **extra) -> LoadTarget:
    return LoadTarget(request, as_ids(ids), **extra)


def test_a_load_writes_exactly_the_stored_bytes_into_the_rows_it_names(
    tier, fetcher, swapin, cache
) -> None:
    keys, payloads = store(tier, 5)
    block_ids = [9, 2, 14, 0, 5]  # any rows of the block table, not in order
    load = swapin.submit(fetcher.submit(keys), target("req", block_ids))
    for layer in range(LAYERS):
        load.wait(layer, timeout=60)
    result = load.result(timeout=60)
    assert result.error is None and result.failed_block_ids == () and result.blocks_loaded == 5
    assert_loaded(cache, block_ids, payloads)
    assert all(untouched(cache, b) for b in set(range(BLOCKS)) - set(block_ids))


def test_layer_i_is_usable_before_layer_i_plus_1_is_staged(
    tmp_path, tier, area, rows, swapin, cache
) -> None:
    keys, payloads = store(tier, 3)
    gate = FileGate(tmp_path / "gate", timeout_s=60)
    os.makedirs(gate.directory)
    gate.open(0, 1)  # the fetcher stops before layer 2
    with Fetcher(tier.factory(), area, rows.kv, gate=gate) as fetcher:
        staged = fetcher.submit(keys)
        load = swapin.submit(staged, target("req", (4, 5, 6)))
        load.wait(1, timeout=60)
        assert row_bytes(cache, 1, 4) == payloads[0][ROW : 2 * ROW]
        assert staged.layer_staged(1) and not staged.layer_staged(2)
        assert untouched(cache, 4, layers=(2, 3))
        with pytest.raises(LoadTimeout, match="layer 2"):
            load.wait(2, timeout=0.2)
        gate.open(2, 3)
        assert load.result(timeout=60).blocks_loaded == 3
    assert_loaded(cache, (4, 5, 6), payloads)


def test_missing_and_corrupt_blocks_are_reported_and_their_rows_left_alone(
    tier, fetcher, swapin, cache
) -> None:
    keys, payloads = store(tier, 4)
    tier.block_path(keys[1]).unlink()  # a miss
    path = tier.block_path(keys[3])  # a corrupted file: also a miss, never its bytes
    raw = bytearray(path.read_bytes())
    raw[100] ^= 1
    path.write_bytes(bytes(raw))
    result = swapin.submit(fetcher.submit(keys), target("req", (10, 11, 12, 13))).result(60)
    assert result.error is None and result.failed_block_ids == (11, 13)
    assert result.blocks_loaded == 2
    assert untouched(cache, 11) and untouched(cache, 13)  # neither zeros nor staged garbage
    assert_loaded(cache, (10, 12), [payloads[0], payloads[2]])


def test_a_whole_load_with_one_block_missing_writes_nothing(tier, fetcher, swapin, cache) -> None:
    keys, _ = store(tier, 3)
    tier.block_path(keys[2]).unlink()
    result = swapin.submit(fetcher.submit(keys), target("req", (0, 1, 2), whole=True)).result(60)
    assert result.error is not None and "1 of 3 blocks" in result.error
    assert result.failed_block_ids == (0, 1, 2) and result.blocks_loaded == 0
    assert all(untouched(cache, b) for b in (0, 1, 2))


def test_the_window_goes_into_the_sliding_layers_rows_and_only_there(tier, area) -> None:
    names = tuple(f"layers.{i}" for i in range(LAYERS))
    groups = EngineGroups(
        BLOCK_TOKENS, ROW, names, (CacheGroup(SLIDING, (0, 2), 128), CacheGroup(FULL, (1, 3)))
    )
    cache = nan_cache()
    rows = KVRows.of(cache, groups)
    keys, full_payloads = store(tier, 3, layers=2)  # a block holds the two full layers' rows
    state = np.random.default_rng(9).integers(0, 256, rows.kv.state_bytes, dtype=np.uint8)
    tier.put_swa_state(keys[2], 384, state.tobytes(), state_bytes=rows.kv.state_bytes)
    swapin = SwapIn(rows, area=area)
    try:
        with Fetcher(tier.factory(), area, rows.kv) as fetcher:
            staged = fetcher.submit(keys, state_key=keys[2], state_position=384)
            load = swapin.submit(
                staged, target("req", (3, 4, 5), windows=(as_ids([7]),), whole=True)
            )
            result = load.result(60)
    finally:
        swapin.close()
    assert result.error is None and result.state_loaded and result.blocks_loaded == 3
    for index, block in enumerate((3, 4, 5)):
        assert row_bytes(cache, 1, block) == full_payloads[index][:ROW]
        assert row_bytes(cache, 3, block) == full_payloads[index][ROW:]
        assert untouched(cache, block, layers=(0, 2))  # sliding layers: only the window
    assert row_bytes(cache, 0, 7) == state[:ROW].tobytes()
    assert row_bytes(cache, 2, 7) == state[ROW:].tobytes()
    assert untouched(cache, 7, layers=(1, 3))


def test_copies_run_on_the_swapin_thread_not_the_engine_thread(
    tier, fetcher, swapin, monkeypatch
) -> None:
    copied_on: list[str] = []
    scatter = SwapIn._scatter

    def spy(self, layer, ids, staged) -> None:
        copied_on.append(threading.current_thread().name)
        scatter(self, layer, ids, staged)

    monkeypatch.setattr(SwapIn, "_scatter", spy)
    keys, _ = store(tier, 2)
    load = swapin.submit(fetcher.submit(keys), target("req", (0, 1)))
    for layer in range(LAYERS):
        load.wait(layer, timeout=60)
    load.result(60)
    assert copied_on == ["kvstore-swapin"] * LAYERS


def test_an_abandoned_load_writes_nothing_more(tmp_path, tier, area, rows, swapin, cache) -> None:
    keys, _ = store(tier, 2)
    gate = FileGate(tmp_path / "gate", timeout_s=60)
    os.makedirs(gate.directory)
    gate.open(0)
    with Fetcher(tier.factory(), area, rows.kv, gate=gate) as fetcher:
        load = swapin.submit(fetcher.submit(keys), target("req", (0, 1)))
        load.wait(0, timeout=60)
        load.abandon()  # the engine recomputes these rows from now on
        gate.open(1, 2, 3)
        result = load.result(60)
    assert result.error is not None and "abandoned" in result.error
    assert untouched(cache, 0, layers=(1, 2, 3)) and untouched(cache, 1, layers=(1, 2, 3))


def test_fetcher_death_fails_every_load_in_flight_without_hanging(
    tmp_path, tier, area, rows, swapin
) -> None:
    keys, _ = store(tier, 3)
    gate = FileGate(tmp_path / "gate", timeout_s=60)
    os.makedirs(gate.directory)
    gate.open(0, 1)
    fetcher = Fetcher(tier.factory(), area, rows.kv, gate=gate)
    try:
        load = swapin.submit(fetcher.submit(keys), target("req", (0, 1, 2)))
        load.wait(1, timeout=60)
        assert fetcher.pid is not None
        os.kill(fetcher.pid, signal.SIGKILL)
        result = load.result(timeout=60)
        assert result.error is not None and "exited" in result.error
        assert result.failed_block_ids == (0, 1, 2) and result.blocks_loaded == 0
        load.wait(LAYERS - 1, timeout=1)  # no layer waits forever
        with pytest.raises(SwapInError, match="gone"):
            fetcher.submit(keys)
        assert area.free_bytes == area.capacity  # the dead fetcher's region came back
    finally:
        fetcher.close()


def test_loads_run_in_order_and_their_regions_come_back(tier, fetcher, swapin, cache, area) -> None:
    first_keys, first = store(tier, 3, seed=1)
    second_keys, second = store(tier, 2, seed=2)
    staged_a, staged_b = fetcher.submit(first_keys), fetcher.submit(second_keys)
    load_a = swapin.submit(staged_a, target("a", (0, 1, 2)))
    load_b = swapin.submit(staged_b, target("b", (3, 4)))
    assert load_b.result(timeout=60).blocks_loaded == 2
    assert load_a.done()
    assert_loaded(cache, (0, 1, 2), first)
    assert_loaded(cache, (3, 4), second)
    staged_a.wait_finished(30)
    staged_b.wait_finished(30)
    assert area.free_bytes == area.capacity and area.used_regions == 0


def test_a_prepared_stage_swaps_in_without_a_fetcher(area, rows, swapin, cache) -> None:
    layout = StageLayout.plan(rows.kv, n_blocks=2, with_state=False)
    stage = PreparedStage(area, layout, block_ok=np.array([True, False]))
    stage.region()[layout.header_bytes :] = np.random.default_rng(3).integers(
        0, 256, layout.total_bytes - layout.header_bytes, dtype=np.uint8
    )
    result = swapin.submit(stage, target("p", (6, 7))).result(timeout=60)
    assert result.blocks_loaded == 1 and result.failed_block_ids == (7,)
    for layer in range(LAYERS):
        assert row_bytes(cache, layer, 6) == layout.blocks_view(stage.region(), layer)[0].tobytes()
    assert untouched(cache, 7)
    assert area.used_regions == 0  # released once copied


def test_submit_refuses_rows_outside_the_cache(area, rows, swapin) -> None:
    stage = PreparedStage(area, StageLayout.plan(rows.kv, n_blocks=1, with_state=False))
    with pytest.raises(InvalidArgument, match="target"):
        swapin.submit(stage, target("x", (0, 1)))
    with pytest.raises(InvalidArgument, match="block_ids"):
        swapin.submit(stage, target("x", (99,)))
    with pytest.raises(InvalidArgument, match="windows"):
        swapin.submit(stage, target("x", (0,), windows=(as_ids([-1]),)))
    stage.release()


class _FailsAfterLayerZero(PreparedStage):
    """A stage whose second block fails after its first layers were staged (as a direct read
    that hands layers on as they arrive reports a block that did not come whole)."""

    def __init__(self, area: StagingArea, layout: StageLayout) -> None:
        super().__init__(area, layout)
        self.asked = 0

    def block_ok(self) -> np.ndarray:
        self.asked += 1
        return np.array([True, self.asked == 1])


def test_a_block_that_fails_after_its_first_layers_is_reported_failed(
    area, rows, swapin, cache
) -> None:
    layout = StageLayout.plan(rows.kv, n_blocks=2, with_state=False)
    stage = _FailsAfterLayerZero(area, layout)
    result = swapin.submit(stage, target("late", (3, 4))).result(timeout=60)
    assert stage.asked >= 2  # asked again once the last layer was in
    assert result.blocks_loaded == 1 and result.failed_block_ids == (4,)
