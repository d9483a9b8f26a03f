"""Byte maps (block payload, stored state, staging region), the staging allocator, the file tier."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvstore.engine.kvlayout import KVLayout
from kvstore.engine.staging import FAILED, OK, PENDING, StageLayout, StagingArea, map_staging_fd
from kvstore.errors import InvalidArgument, StagingFull, StateRejected
from kvstore.geometry import GeometryConfig
from kvstore.ledger.layout import build_layout, swa_region_name
from kvstore.tier.records import HitRequest

# --- KVLayout ------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["v4.1-flash", "v4-flash", "v4-pro"])
def test_block_payload_is_layer_major_and_covers_the_block(preset: str) -> None:
    geometry = GeometryConfig(preset=preset)
    kv = KVLayout.from_geometry(geometry)
    offset = 0
    for item in kv.layers:
        assert item.block_offset == offset
        assert item.block_nbytes == geometry.block_bytes_of_layer(item.layer)
        offset += item.block_nbytes
    assert offset == kv.block_bytes == geometry.block_bytes
    assert kv.block_layers == geometry.model.block_kv_layers


def test_v41_flash_numbers(kv: KVLayout) -> None:
    # docs/rules.md §2/§3: ≈111 KiB per block, 20 stored layers × 134 × 528 = 1,415,040 B of state.
    assert kv.block_bytes == 114_048
    assert kv.state_bytes == 1_415_040
    assert kv.state_layers == tuple(range(20))
    assert kv.block_layers == tuple(range(2, 20))
    assert all(item.empty for item in kv.layers[20:])  # YoCo consumers: nothing to load
    assert kv.window_shape == (134, 1, 528)


def test_state_offsets_match_the_ledger_layout(geometry: GeometryConfig, kv: KVLayout) -> None:
    layout = build_layout(geometry.for_decode())
    for layer in kv.state_layers:
        region = layout.region(swa_region_name(layer))
        assert (kv.layers[layer].state_offset, kv.layers[layer].state_nbytes) == (
            region.offset,
            region.nbytes,
        )


def test_pack_block_and_slices_round_trip(kv: KVLayout) -> None:
    rng = np.random.default_rng(1)
    pieces = {
        layer: rng.integers(0, 256, kv.layers[layer].block_nbytes, dtype=np.uint8)
        for layer in kv.block_layers
    }
    payload = kv.pack_block(pieces)
    for layer, piece in pieces.items():
        assert np.array_equal(kv.block_slice(payload, layer), piece)
    with pytest.raises(InvalidArgument, match="layer 2"):
        kv.pack_block({layer: piece for layer, piece in pieces.items() if layer != 2})


def test_layer_out_of_range(kv: KVLayout) -> None:
    with pytest.raises(InvalidArgument, match="layer"):
        kv.layer(kv.num_layers)


# --- StageLayout -----------------------------------------------------------------------------


def test_stage_sections_are_contiguous_per_layer_and_do_not_overlap(kv: KVLayout) -> None:
    layout = StageLayout.plan(kv, n_blocks=5, with_state=True)
    previous_end = layout.header_bytes
    for item in kv.layers:
        offset, nbytes = layout.layer_span(item.layer)
        assert offset == previous_end and offset % 64 == 0
        assert nbytes >= 5 * item.block_nbytes + item.state_nbytes
        previous_end = offset + nbytes
    assert previous_end == layout.total_bytes
    region = np.zeros(layout.total_bytes, dtype=np.uint8)
    # Writing every layer's views fills disjoint bytes: the sum of what we wrote equals the count.
    for item in kv.layers:
        layout.blocks_view(region, item.layer)[:] += 1
        layout.state_view(region, item.layer)[...] += 1
    assert region.max() == 1
    assert int(region.sum()) == sum(5 * i.block_nbytes + i.state_nbytes for i in kv.layers)


def test_stage_without_state_has_no_windows(kv: KVLayout) -> None:
    layout = StageLayout.plan(kv, n_blocks=2, with_state=False)
    region = np.zeros(layout.total_bytes, dtype=np.uint8)
    assert layout.state_view(region, 3).size == 0
    assert layout.total_bytes < StageLayout.plan(kv, 2, True).total_bytes


def test_header_words_belong_to_one_job(kv: KVLayout) -> None:
    layout = StageLayout.plan(kv, n_blocks=3, with_state=True)
    region = np.zeros(layout.total_bytes, dtype=np.uint8)
    header = layout.header(region)
    header.initialise(job_id=7)
    header.check(7)
    with pytest.raises(InvalidArgument, match="job 8"):
        header.check(8)
    assert not header.ready_layers().any()
    header.set_statuses(np.array([True, False, True]), state_ok=False)
    header.publish_layer(4)
    assert header.layer_ready(4) and not header.layer_ready(5)
    assert list(header.block_status()) == [OK, FAILED, OK]
    assert header.state_status == FAILED and header.statuses_final
    # Re-using the region for the next job clears it: a stale ready word never matches.
    header.initialise(job_id=8)
    assert not header.layer_ready(4) and not header.statuses_final
    assert list(header.block_status()) == [PENDING] * 3


# --- StagingArea -----------------------------------------------------------------------------


def test_staging_area_is_a_shared_file_mapped_by_another_mapping() -> None:
    with StagingArea(1 << 20) as area:
        assert str(area.path).startswith(f"/dev/shm/kvstore-{os.geteuid()}/")
        region = area.allocate(10_000)
        area.view(region)[:4] = [1, 2, 3, 4]
        mapping, other = map_staging_fd(area.fileno())  # as the fetcher maps it
        assert list(other[region.offset : region.offset + 4]) == [1, 2, 3, 4]
        other[region.offset + 4] = 9  # and back the other way
        assert area.view(region)[4] == 9
        del other
        mapping.close()
        path = area.path
    assert not os.path.exists(path)


def test_staging_allocator_first_fit_full_and_coalesce() -> None:
    with StagingArea(64 * 1024) as area:
        a = area.allocate(16 * 1024)
        b = area.allocate(16 * 1024)
        c = area.allocate(32 * 1024)
        assert (a.offset, b.offset, c.offset) == (0, 16 * 1024, 32 * 1024)
        with pytest.raises(StagingFull, match="no free extent"):
            area.allocate(1)
        area.free(b)
        again = area.allocate(10)  # first fit, rounded up to a page
        assert (again.offset, again.nbytes) == (b.offset, 4096)
        area.free(a)
        area.free(c)
        with pytest.raises(InvalidArgument, match="not an allocated region"):
            area.free(c)
        area.free(again)
        # Everything free again and coalesced: one allocation of the whole area succeeds.
        assert area.free_bytes == area.capacity
        whole = area.allocate(area.capacity)
        assert whole.offset == 0


def test_staging_rejects_bad_sizes() -> None:
    with pytest.raises(InvalidArgument, match="capacity_bytes"):
        StagingArea(100)
    with StagingArea(8192) as area, pytest.raises(InvalidArgument, match="nbytes"):
        area.allocate(0)


# --- DirectoryTier ---------------------------------------------------------------------------


def test_directory_tier_round_trip_and_misses(tier, store, kv) -> None:
    prompt = store(3 * 128 + 5, state_at=256)
    reads = tier.get_blocks(prompt.keys)
    assert [r.payload for r in reads] == [p.tobytes() for p in prompt.payloads]
    assert tier.get_swa_state(prompt.keys[1], 256).state == prompt.state.tobytes()
    assert tier.get_swa_state(prompt.keys[1], 128).miss_reason == "absent"
    # A flipped byte is a miss, never wrong bytes.
    path = tier.block_path(prompt.keys[0])
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    read = tier.get_blocks(prompt.keys[:1])[0]
    assert read.payload is None and "checksum" in read.miss_reason
    path.write_bytes(bytes(raw[:10]))
    assert "truncated" in tier.get_blocks(prompt.keys[:1])[0].miss_reason


def test_directory_tier_rejects_bad_state(tier, kv) -> None:
    key = bytes(32)
    with pytest.raises(StateRejected, match="position"):
        tier.put_swa_state(key, 100, bytes(kv.state_bytes))
    with pytest.raises(StateRejected, match="blob"):
        tier.put_swa_state(key, 128, bytes(10))


def test_directory_tier_query_hit_applies_the_hit_rule(tier, store) -> None:
    prompt = store(6 * 128 + 10, state_at=640)
    tokens = list(prompt.tokens)
    answer = tier.query_hit(HitRequest(token_ids=tokens))
    # cap = 778 − 134 = 644 → L1 = 640; the state at 640 exists → hit 640.
    assert (answer.plan.block_hit_tokens, answer.plan.hit_tokens) == (640, 640)
    assert answer.plan.swa_hit and answer.swa_owner == "local"
    assert answer.hit_block_keys == tuple(prompt.keys[:5])
    tier.state_path(prompt.keys[4], 640).unlink()
    answer = tier.query_hit(HitRequest(token_ids=tokens))
    assert (answer.plan.hit_tokens, answer.plan.swa_hit) == (512, False)  # back off one block
    answer = tier.query_hit(HitRequest(token_ids=tokens, mode="bounded-replay"))
    assert answer.plan.hit_tokens == 640 and answer.plan.replay_start == 512
    tier.block_path(prompt.keys[2]).unlink()
    assert (
        tier.query_hit(HitRequest(token_ids=tokens)).plan.block_hit_tokens == 256
    )  # the run stops there


def test_files_of_dead_engines_are_removed(tmp_path) -> None:
    # Stale means unlocked: a file nobody holds (its owner died) goes, a locked one stays.
    with StagingArea(8192, tmp_path) as first:
        home = first.path.parent
        stale = home / "kvstore-staging-left-by-a-dead-engine"
        stale.write_bytes(b"x")
        with StagingArea(8192, tmp_path) as area:
            assert not stale.exists() and first.path.exists() and area.path.exists()
