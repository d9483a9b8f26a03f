"""Save (pools → tier) and the save-then-load round trip, on the CPU path."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from kvstore.errors import InvalidArgument
from kvstore.geometry import GeometryConfig
from kvstore.gpu.fetcher import Fetcher
from kvstore.gpu.pools import DevicePools
from kvstore.gpu.save import Saver, SaveSpec, StateSave
from kvstore.gpu.swapin import LoadTarget, SwapIn
from kvstore.keys import block_keys
from kvstore.ledger.layout import CONSUMER_SWA, STORED_SWA, build_layout, pe_to_ce


def fill_random(pools: DevicePools, block_ids, slot: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for layer in pools.kv.block_layers:
        rows = pools.block_kv[layer]
        for block in block_ids:
            rows[block] = torch.from_numpy(rng.integers(0, 256, rows.shape[1], dtype=np.uint8))
    for ring in pools.swa:
        ring[slot] = torch.from_numpy(rng.integers(0, 256, tuple(ring.shape[1:]), dtype=np.uint8))


def token_bytes(layer: int, tokens) -> np.ndarray:
    """What a toy engine writes for ``tokens`` in ``layer``: one recognisable byte per token."""
    marks = (np.asarray(tokens, dtype=np.int64) * 7 + layer) % 256
    return np.broadcast_to(marks[:, None, None], (len(marks), 1, 528)).astype(np.uint8)


def test_prefill_save_then_load_round_trips(tier, area, kv) -> None:
    pe = GeometryConfig(
        role="prefill", extra_state=True, truncation="mask", yoco_keep=134, num_state_seqs=4
    )
    ce = pe.for_decode()
    assert pe.store_ring == 396 and pe.fingerprint() == ce.fingerprint()
    source = DevicePools(pe, num_blocks=8)
    tokens = np.arange(5 * 128 + 50) % 1000
    keys = block_keys(pe.fingerprint(), tokens)
    table = [3, 6, 1, 0, 7]
    fill_random(source, table, slot=2, seed=5)
    saver = Saver(source, tier)
    try:
        spec = SaveSpec(
            "r", tuple(table), tuple(keys), StateSave(2, keys[4], 640, written=len(tokens))
        )
        result = saver.save(spec).result(timeout=60)
    finally:
        saver.close()
    assert result.saved_keys == tuple(keys) and result.state_saved and result.error is None

    # The saved state equals what the ledger's own PE→CE transfer makes of this slot.
    layout = build_layout(pe)
    block = layout.new_block()
    for region in (*layout.regions_of(STORED_SWA), *layout.regions_of(CONSUMER_SWA)):
        layout.view(block, region.name)[:] = source.swa[region.layer][2].numpy()
    expected_state = pe_to_ce(block, pe, seq_len=len(tokens))[: ce.state_size_to_disk]
    stored_state = np.frombuffer(tier.get_swa_state(keys[4], 640).state, dtype=np.uint8)
    assert np.array_equal(stored_state, expected_state)

    # Load it all back into a decode engine's pools: the same bytes, row for row.
    target = DevicePools(ce, num_blocks=8)
    with Fetcher(tier.factory(), area, ce) as fetcher:
        swapin = SwapIn(target, area=area)
        staged = fetcher.submit(keys, state_key=keys[4], state_position=640)
        load = swapin.submit(staged, LoadTarget("r", (0, 1, 2, 3, 4), tuple(keys), 1, 640))
        loaded = load.result(timeout=60)
        swapin.close()
    assert loaded.loaded_block_ids == (0, 1, 2, 3, 4) and loaded.state_loaded
    for layer in kv.block_layers:
        assert np.array_equal(
            target.read_blocks(layer, [0, 1, 2, 3, 4]).numpy(),
            source.read_blocks(layer, table).numpy(),
        )
    for layer in kv.state_layers:
        saved = source.gather_window(layer, 2, 640, written=len(tokens)).numpy()
        assert np.array_equal(target.swa[layer][1].numpy(), saved)
        assert np.array_equal(saved, kv.state_slice(expected_state, layer))


def test_state_outside_the_ring_is_not_saved_but_blocks_are(tier, kv) -> None:
    # A prefill engine without extra-state keeps 134 tokens: after 690 tokens the window at 640
    # ([512, 640)) is gone, so the state cannot be stored; the blocks still can.
    pe = GeometryConfig(role="prefill", extra_state=False, num_state_seqs=2)
    pools = DevicePools(pe, num_blocks=6)
    keys = block_keys(pe.fingerprint(), np.arange(690))
    saver = Saver(pools, tier)
    try:
        state = StateSave(0, keys[4], 640, written=690)
        result = saver.save(SaveSpec("r", (0, 1, 2, 3, 4), tuple(keys), state)).result(60)
    finally:
        saver.close()
    assert not result.state_saved and "not in a 134-slot ring" in result.state_error
    assert result.saved_keys == tuple(keys)
    assert tier.get_swa_state(keys[4], 640).state is None


def test_decode_snapshot_saves_the_window_at_the_boundary_below(tier, geometry, kv) -> None:
    pools = DevicePools(geometry, num_blocks=4)
    slot, anchor_loaded = 1, 256
    pools.set_ring_origin(slot, anchor_loaded)  # as after loading a state anchored at 256
    for layer in kv.state_layers:
        ring = pools.swa[layer][slot]
        old = np.arange(anchor_loaded - 134, anchor_loaded)
        ring[pools.ring_slots(slot, old)] = torch.from_numpy(token_bytes(layer, old))
        new = np.arange(anchor_loaded, 387)  # decode up to 387: 3 tokens past boundary 384
        ring[pools.ring_slots(slot, new)] = torch.from_numpy(token_bytes(layer, new))
    pools.snapshot_window(slot, 387)
    for layer in kv.state_layers:  # decoding goes on: the live ring changes, the copy does not
        pools.swa[layer][slot].fill_(0)
    keys = block_keys(geometry.fingerprint(), np.arange(387))
    saver = Saver(pools, tier)
    try:
        state = StateSave(slot, keys[2], 384, from_snapshot=True)
        result = saver.save(SaveSpec("d", state=state)).result(60)
    finally:
        saver.close()
    assert result.state_saved, result.state_error
    stored = np.frombuffer(tier.get_swa_state(keys[2], 384).state, dtype=np.uint8)
    for layer in kv.state_layers:
        window = kv.state_slice(stored, layer)  # slot j = token 250 + j
        assert np.array_equal(window[6:], token_bytes(layer, np.arange(256, 384)))
        assert np.array_equal(window[3:6], token_bytes(layer, np.arange(253, 256)))
        # The 3-token overrun landed in the spare slots of the 3 oldest tokens (SPEC §6).
        assert np.array_equal(window[:3], token_bytes(layer, np.arange(384, 387)))


def test_snapshot_overrun_beyond_the_spare_slots_is_refused(geometry) -> None:
    pools = DevicePools(geometry, num_blocks=2)
    pools.snapshot_window(0, 391)  # 7 past 384: the ring has lost [250, 257)
    with pytest.raises(InvalidArgument, match="anchor"):
        pools.window_positions(0, 384, written=0, from_snapshot=True)


def test_rows_may_change_once_the_batch_is_sealed(tier, geometry, kv) -> None:
    pools = DevicePools(geometry, num_blocks=4)
    fill_random(pools, [0, 1], slot=0, seed=9)
    before = {layer: pools.read_blocks(layer, [0, 1]).numpy().copy() for layer in kv.block_layers}
    keys = block_keys(geometry.fingerprint(), np.arange(256) + 7)
    saver = Saver(pools, tier)
    try:
        batch = saver.begin([SaveSpec("s", (0, 1), tuple(keys))])
        for layer in range(geometry.num_layers):  # as the forward pass finishes each layer
            batch.gather_layer(layer)
        (ticket,) = batch.seal()
        for layer in kv.block_layers:
            pools.block_kv[layer].fill_(0)  # the next step overwrites the rows
        result = ticket.result(60)
    finally:
        saver.close()
    assert result.saved_keys == tuple(keys)
    for index, read in enumerate(tier.get_blocks(keys)):
        payload = np.frombuffer(read.payload, dtype=np.uint8)
        for layer in kv.block_layers:
            assert np.array_equal(kv.block_slice(payload, layer), before[layer][index])
    with pytest.raises(InvalidArgument, match="sealed"):
        batch.gather_layer(3)


def test_a_failed_put_is_a_result_not_an_exception(tmp_path, geometry, kv) -> None:
    from kvstore.tier.files import DirectoryTier

    broken = DirectoryTier(tmp_path / "gone")
    shutil.rmtree(tmp_path / "gone")  # the writer's directory vanished
    pools = DevicePools(geometry, num_blocks=2)
    keys = block_keys(geometry.fingerprint(), np.arange(128))
    saver = Saver(pools, broken)
    try:
        result = saver.save(SaveSpec("f", (1,), tuple(keys))).result(60)
    finally:
        saver.close()
    assert result.saved_keys == () and result.failed_keys == tuple(keys)
    assert "put_blocks" in result.error


def test_save_spec_validation(geometry) -> None:
    with pytest.raises(InvalidArgument, match="block_ids"):
        SaveSpec("x", (0, 1), (bytes(32),))
    with pytest.raises(InvalidArgument, match="keys"):
        SaveSpec("x", (0,), (b"short",))
    pools = DevicePools(geometry, num_blocks=2)
    saver = Saver(pools, writer=None)  # type: ignore[arg-type]
    try:
        with pytest.raises(InvalidArgument, match="block_ids"):
            saver.begin([SaveSpec("x", (5,), (bytes(32),))])
    finally:
        saver.close()
