"""Fetcher process → /dev/shm staging → swap-in thread → device pools, on the CPU path.

Every test uses a real spawned fetcher process reading real files (``DirectoryTier``).
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from kvstore.errors import InvalidArgument, LoadTimeout, SwapInError
from kvstore.gpu.fetcher import Fetcher, FileGate
from kvstore.gpu.pools import DevicePools
from kvstore.gpu.staging import PreparedStage, StageLayout
from kvstore.gpu.swapin import LoadTarget, SwapIn
from kvstore.tier.records import HitRequest

SENTINEL = 0xAB


@pytest.fixture
def pools(geometry):
    return DevicePools(geometry, num_blocks=16)


@pytest.fixture
def swapin(pools, area):
    engine = SwapIn(pools, area=area, stage_timeout_s=60)
    yield engine
    engine.close()


@pytest.fixture
def fetcher(tier, area, geometry):
    process = Fetcher(tier.factory(), area, geometry)
    yield process
    process.close()


def assert_blocks_exact(pools, kv, block_ids, payloads) -> None:
    for layer in kv.block_layers:
        rows = pools.read_blocks(layer, list(block_ids)).numpy()
        for row, payload in zip(rows, payloads, strict=True):
            assert np.array_equal(row, kv.block_slice(payload, layer)), f"layer {layer}"


def assert_window_exact(pools, kv, slot, anchor, state) -> None:
    for layer in kv.state_layers:
        window = pools.gather_window(layer, slot, anchor, written=anchor).numpy()
        assert np.array_equal(window, kv.state_slice(state, layer)), f"layer {layer}"
        # On this decode engine (ring 134) the window is the slot's ring, verbatim.
        assert np.array_equal(pools.swa[layer][slot].numpy(), kv.state_slice(state, layer))


def test_hit_plan_fetched_and_swapped_in_gives_exactly_the_stored_bytes(
    tier, store, fetcher, swapin, pools, kv, geometry
) -> None:
    prompt = store(6 * 128 + 10, state_at=640)
    answer = tier.query_hit(HitRequest(token_ids=list(prompt.tokens)))
    plan = answer.plan
    assert plan.hit_tokens == 640 and plan.swa_hit
    keys = list(answer.hit_block_keys)
    block_ids = [9, 2, 14, 0, 5]  # any rows of the block table, not in order
    slot = 2
    staged = fetcher.submit(keys, state_key=keys[-1], state_position=plan.swa_position)
    load = swapin.submit(
        staged, LoadTarget("req", tuple(block_ids), tuple(keys), slot, plan.swa_position)
    )
    for layer in range(geometry.num_layers):
        load.wait(layer, timeout=60)
    result = load.result(timeout=60)
    assert result.error is None and result.failed_block_ids == ()
    assert result.loaded_block_ids == tuple(block_ids) and result.state_loaded
    assert_blocks_exact(pools, kv, block_ids, prompt.payloads[:5])
    assert_window_exact(pools, kv, slot, 640, prompt.state)
    # Per slot: the other slots, and the consumer layers of this slot, were not touched.
    for other in (0, 1, 3):
        assert not any(pools.swa[layer][other].any() for layer in range(geometry.num_layers))
    assert not any(pools.swa[layer][slot].any() for layer in range(20, geometry.num_layers))
    # Rows not in the table were not touched either.
    untouched = sorted(set(range(16)) - set(block_ids))
    assert not any(pools.read_blocks(layer, untouched).any() for layer in kv.block_layers)
    assert all(pools.loaded_key(b) == k for b, k in zip(block_ids, keys, strict=True))
    assert pools.state_loaded_at(slot) == 640 and pools.ring_origin(slot) == 640
    staged.wait_finished(30)
    assert swapin_done_and_area_free(staged)


def swapin_done_and_area_free(staged) -> bool:
    area = staged._fetcher.area
    return area.free_bytes == area.capacity


def test_layer_i_is_usable_before_layer_i_plus_1_arrives(
    tmp_path, tier, store, area, swapin, pools, kv, geometry
) -> None:
    prompt = store(4 * 128 + 140)
    keys = prompt.keys[:4]
    gate = FileGate(tmp_path / "gate", timeout_s=60)
    os.makedirs(gate.directory)
    gate.open(*range(6))  # layers 0..5 may be written; the fetcher stops before layer 6
    with Fetcher(tier.factory(), area, geometry, gate=gate) as fetcher:
        staged = fetcher.submit(keys)
        load = swapin.submit(staged, LoadTarget("req", (4, 5, 6, 7), tuple(keys)))
        load.wait(5, timeout=60)
        # Layer 5 is in the pools while layer 6 has not even reached staging.
        assert np.array_equal(
            pools.read_blocks(5, [4]).numpy()[0], kv.block_slice(prompt.payloads[0], 5)
        )
        assert staged.layer_staged(5) and not staged.layer_staged(6)
        assert not load.is_ready(6)
        assert not pools.read_blocks(6, [4, 5, 6, 7]).any()
        with pytest.raises(LoadTimeout, match="layer 6"):
            load.wait(6, timeout=0.2)
        gate.open(*range(6, geometry.num_layers))
        result = load.result(timeout=60)
    assert result.loaded_block_ids == (4, 5, 6, 7)
    assert_blocks_exact(pools, kv, (4, 5, 6, 7), prompt.payloads[:4])


def test_state_only_layers_are_usable_before_the_blocks_are_read(
    tmp_path, tier, store, area, swapin, pools, kv, geometry
) -> None:
    prompt = store(5 * 128, state_at=512)
    keys = prompt.keys[:4]
    gate = FileGate(tmp_path / "gate", timeout_s=60)
    os.makedirs(gate.directory)
    gate.open(0, 1)  # V4.1 layers 0 and 1 are pure SWA: they need the state only
    with Fetcher(tier.factory(), area, geometry, gate=gate) as fetcher:
        staged = fetcher.submit(keys, state_key=keys[3], state_position=512)
        load = swapin.submit(staged, LoadTarget("req", (0, 1, 2, 3), tuple(keys), 0, 512))
        load.wait(1, timeout=60)
        for layer in (0, 1):
            assert np.array_equal(pools.swa[layer][0].numpy(), kv.state_slice(prompt.state, layer))
        # The blocks have not been read yet: one that disappears now is a miss.
        tier.block_path(keys[0]).unlink()
        gate.open(*range(2, geometry.num_layers))
        result = load.result(timeout=60)
    assert result.failed_block_ids == (0,) and result.loaded_block_ids == (1, 2, 3)
    assert result.state_loaded


def test_failed_blocks_are_reported_not_zero_and_not_marked_loaded(
    tier, store, fetcher, swapin, pools, kv, geometry
) -> None:
    prompt = store(5 * 128, state_at=512)
    keys = prompt.keys[:4]
    tier.block_path(keys[1]).unlink()  # a miss
    path = tier.block_path(keys[3])  # a corrupted file: also a miss, never its bytes
    raw = bytearray(path.read_bytes())
    raw[100] ^= 1
    path.write_bytes(bytes(raw))
    for layer in kv.block_layers:
        pools.block_kv[layer][:] = SENTINEL
    pools.mark_loaded([11], [keys[1]])  # an old marker on a row this load overwrites
    assert pools.loaded_key(11) == keys[1]
    staged = fetcher.submit(keys, state_key=keys[3], state_position=512)
    load = swapin.submit(staged, LoadTarget("req", (10, 11, 12, 13), tuple(keys), 1, 512))
    result = load.result(timeout=60)
    assert result.failed_block_ids == (11, 13)
    assert result.loaded_block_ids == (10, 12)
    assert not pools.is_loaded(11) and not pools.is_loaded(13)
    assert pools.is_loaded(10) and pools.is_loaded(12)
    for layer in kv.block_layers:
        failed = pools.read_blocks(layer, [11, 13]).numpy()
        assert (failed == SENTINEL).all()  # neither zeros nor staged garbage
    assert_blocks_exact(pools, kv, (10, 12), [prompt.payloads[0], prompt.payloads[2]])
    assert_window_exact(pools, kv, 1, 512, prompt.state)  # the state arrived


def test_missing_state_is_reported_and_the_slot_is_left_alone(
    tier, store, fetcher, swapin, pools, kv
) -> None:
    prompt = store(3 * 128 + 50)
    keys = prompt.keys[:2]
    staged = fetcher.submit(keys, state_key=keys[1], state_position=256)
    load = swapin.submit(staged, LoadTarget("req", (0, 1), tuple(keys), 3, 256))
    result = load.result(timeout=60)
    assert result.state_failed and not result.state_loaded
    assert result.loaded_block_ids == (0, 1)
    assert not any(pools.swa[layer][3].any() for layer in kv.state_layers)
    assert pools.state_loaded_at(3) is None and pools.ring_origin(3) == 0


def test_fetcher_death_fails_every_load_in_flight_without_hanging(
    tmp_path, tier, store, area, swapin, pools, kv, geometry
) -> None:
    prompt = store(3 * 128)
    keys = prompt.keys
    gate = FileGate(tmp_path / "gate", timeout_s=60)
    os.makedirs(gate.directory)
    gate.open(*range(4))
    fetcher = Fetcher(tier.factory(), area, geometry, gate=gate)
    try:
        staged = fetcher.submit(keys)
        load = swapin.submit(staged, LoadTarget("req", (0, 1, 2), tuple(keys)))
        load.wait(3, timeout=60)
        assert fetcher.pid is not None
        os.kill(fetcher.pid, signal.SIGKILL)
        result = load.result(timeout=60)
        assert result.error is not None and "exited" in result.error
        assert result.failed_block_ids == (0, 1, 2) and result.loaded_block_ids == ()
        # Layers 2 and 3 were copied before the death, yet no row counts as loaded.
        assert not any(pools.is_loaded(b) for b in (0, 1, 2))
        load.wait(geometry.num_layers - 1, timeout=1)  # no layer waits forever
        with pytest.raises(SwapInError, match="gone"):
            fetcher.submit(keys)
        assert area.free_bytes == area.capacity  # the dead fetcher's region came back
    finally:
        fetcher.close()


def test_loads_queue_in_order_and_regions_come_back(
    tier, store, fetcher, swapin, pools, kv, area
) -> None:
    first = store(3 * 128, seed=1)
    second = store(2 * 128 + 7, seed=2)
    staged_a = fetcher.submit(first.keys)
    staged_b = fetcher.submit(second.keys[:2])
    load_a = swapin.submit(staged_a, LoadTarget("a", (0, 1, 2), tuple(first.keys)))
    load_b = swapin.submit(staged_b, LoadTarget("b", (3, 4), tuple(second.keys[:2])))
    assert load_b.result(timeout=60).loaded_block_ids == (3, 4)
    assert load_a.done()
    assert_blocks_exact(pools, kv, (0, 1, 2), first.payloads)
    assert_blocks_exact(pools, kv, (3, 4), second.payloads[:2])
    staged_a.wait_finished(30)
    staged_b.wait_finished(30)
    assert area.free_bytes == area.capacity and area.used_regions == 0


def test_prepared_stage_swaps_in_without_a_fetcher(area, swapin, pools, kv) -> None:
    layout = StageLayout.plan(kv, n_blocks=2, with_state=True)
    stage = PreparedStage(area, layout, block_ok=np.array([True, False]))
    rng = np.random.default_rng(3)
    stage.region()[layout.header_bytes :] = rng.integers(
        0, 256, layout.total_bytes - layout.header_bytes, dtype=np.uint8
    )
    load = swapin.submit(stage, LoadTarget("p", (6, 7), (bytes(32), bytes([1]) * 32), 0, 128))
    result = load.result(timeout=60)
    assert result.loaded_block_ids == (6,) and result.failed_block_ids == (7,)
    for layer in kv.block_layers:
        staged = layout.blocks_view(stage.region(), layer)
        assert np.array_equal(pools.read_blocks(layer, [6]).numpy()[0], staged[0])
        assert not pools.read_blocks(layer, [7]).any()
    for layer in kv.state_layers:
        assert np.array_equal(pools.swa[layer][0].numpy(), layout.state_view(stage.region(), layer))
    assert area.used_regions == 0  # released once copied


def test_submit_validates_the_target(area, swapin, kv) -> None:
    stage = PreparedStage(area, StageLayout.plan(kv, n_blocks=1, with_state=False))
    with pytest.raises(InvalidArgument, match="target"):
        swapin.submit(stage, LoadTarget("x", (0, 1), (bytes(32), bytes(32))))
    with pytest.raises(InvalidArgument, match="block_ids"):
        swapin.submit(stage, LoadTarget("x", (99,), (bytes(32),)))
    with pytest.raises(InvalidArgument, match="anchor"):
        LoadTarget("x", (0,), (bytes(32),), slot=1)
    stage.release()
