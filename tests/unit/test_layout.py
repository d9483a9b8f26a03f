"""Per-sequence state block layout and the PE -> CE ring re-order (docs/rules.md §4)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvstore.errors import InvalidArgument, LayoutError
from kvstore.geometry import GeometryConfig
from kvstore.ledger.layout import (
    COMPRESSION,
    CONSUMER_SWA,
    GROUPS,
    STORED_SWA,
    RegionSpec,
    StateBlockLayout,
    build_layout,
    finalize,
    pe_to_ce,
    plan_regions,
    swa_region_name,
)

CE = GeometryConfig.default()
PE = GeometryConfig(role="prefill", truncation="compact", yoco_keep=134, extra_state=True)


def finalize_for(geometry: GeometryConfig, specs: list[RegionSpec]) -> StateBlockLayout:
    return finalize(
        specs,
        swa_ring=geometry.store_ring,
        inference_ring=geometry.inference_ring,
        state_size_to_disk=geometry.state_size_to_disk,
        expected_total_bytes=geometry.state_block_bytes,
    )


# --- layout -----------------------------------------------------------------------------------


def test_ce_layout_stored_region_is_state_size_to_disk_then_dropped() -> None:
    layout = build_layout(CE)
    assert layout.swa_ring == 134
    assert layout.group_span(STORED_SWA) == (0, 1_415_040)
    assert layout.dropped_offset == layout.state_size_to_disk == 1_415_040
    consumer_offset, consumer_bytes = layout.group_span(CONSUMER_SWA)
    assert consumer_offset == 1_415_040
    assert consumer_bytes == 20 * 134 * 528
    compression_offset, compression_bytes = layout.group_span(COMPRESSION)
    assert compression_offset == consumer_offset + consumer_bytes
    assert compression_offset + compression_bytes == layout.total_bytes == CE.state_block_bytes


def test_regions_are_contiguous_ordered_and_aligned() -> None:
    for geometry in (CE, PE, GeometryConfig(preset="v4-pro")):
        layout = build_layout(geometry)
        offset = 0
        group_order = []
        for region in layout.regions:
            assert region.offset == offset
            offset = region.end
            if region.dtype == "float32":
                assert region.offset % 4 == 0
            group_order.append(GROUPS.index(region.group))
        assert offset == layout.total_bytes
        assert group_order == sorted(group_order)


def test_every_layer_has_one_swa_region_and_each_compressed_layer_its_state() -> None:
    layout = build_layout(CE)
    swa = [r for r in layout.regions if r.group != COMPRESSION]
    assert sorted(r.layer for r in swa) == list(range(CE.num_layers))
    assert [r.layer for r in layout.regions_of(STORED_SWA)] == list(range(20))
    assert all(r.shape == (134, 1, 528) and r.dtype == "uint8" for r in swa)
    csa_layers = [i for i, k in enumerate(CE.layer_kinds) if k == "csa"]
    hca_layers = [i for i, k in enumerate(CE.layer_kinds) if k == "hca"]
    index = [r for r in layout.regions if ".index_state." in r.name]
    assert [r.layer for r in index] == csa_layers
    assert all(r.shape == (14, 2, CE.model.index_dim) for r in index)
    hca = [r for r in layout.regions if r.name.startswith("hca.compressed_state.")]
    assert [r.layer for r in hca] == hca_layers
    assert all(r.shape == (134, 2, CE.model.compressed_state_dim) for r in hca)


def test_pe_extra_state_layout_keeps_every_swa_ring_at_396() -> None:
    layout = build_layout(PE)
    assert layout.swa_ring == 396
    assert not layout.persistable
    for region in layout.regions:
        if region.group != COMPRESSION:
            assert region.shape == (396, 1, 528)
    with pytest.raises(LayoutError, match="pe_to_ce"):
        layout.persisted_bytes(layout.new_block())


def test_dropped_layers_come_from_the_model_not_the_truncation_mode() -> None:
    layouts = [
        build_layout(GeometryConfig(truncation="off")),
        build_layout(GeometryConfig(truncation="mask", yoco_keep=134)),
        build_layout(GeometryConfig(truncation="compact", yoco_keep=300)),
    ]
    assert layouts[0] == layouts[1] == layouts[2]
    assert [r.layer for r in layouts[0].regions_of(CONSUMER_SWA)] == list(range(20, 40))


def test_truncating_at_state_size_to_disk_excludes_the_whole_dropped_region() -> None:
    layout = build_layout(CE)
    block = layout.new_block()
    for region in layout.regions:
        block[region.offset : region.end] = 1 if region.group == STORED_SWA else 2
    persisted = layout.persisted_bytes(block)
    assert persisted.size == CE.state_size_to_disk == 1_415_040
    assert np.all(persisted == 1)
    assert np.all(block[CE.state_size_to_disk :] == 2)
    for region in layout.regions:
        if region.group != STORED_SWA:
            assert region.offset >= CE.state_size_to_disk


def test_view_is_typed_and_shares_memory() -> None:
    layout = build_layout(CE)
    block = layout.new_block()
    state = layout.view(block, "hca.compressed_state.3")
    assert state.dtype == np.float32 and state.shape == (134, 2, CE.model.compressed_state_dim)
    state[0, 0, 0] = 1.5
    region = layout.region("hca.compressed_state.3")
    assert block[region.offset : region.offset + 4].view(np.float32)[0] == 1.5
    with pytest.raises(InvalidArgument):
        layout.region("swa.99")
    with pytest.raises(InvalidArgument):
        layout.view(np.zeros(10, dtype=np.uint8), "swa.0")
    with pytest.raises(InvalidArgument):
        layout.persisted_bytes(np.zeros(layout.total_bytes, dtype=np.int8))


# --- finalize catches drift -------------------------------------------------------------------


def test_finalize_accepts_the_planned_regions() -> None:
    assert finalize_for(CE, plan_regions(CE)) == build_layout(CE)


def test_finalize_rejects_a_missing_region() -> None:
    specs = plan_regions(CE)
    del specs[-1]
    with pytest.raises(LayoutError, match="disagree"):
        finalize_for(CE, specs)


def test_finalize_rejects_a_region_sized_by_a_stale_backtracking() -> None:
    # The article's trap: a ring sized with the old backtracking value while the total uses the new.
    specs = plan_regions(CE)
    stale = dataclasses.replace(specs[0], shape=(136, 1, 528))
    with pytest.raises(LayoutError):
        finalize_for(CE, [stale, *specs[1:]])


def test_finalize_rejects_a_dropped_region_before_the_stored_one() -> None:
    specs = plan_regions(CE)
    consumer = next(i for i, s in enumerate(specs) if s.group == CONSUMER_SWA)
    specs[0], specs[consumer] = specs[consumer], specs[0]
    with pytest.raises(LayoutError, match="precede"):
        finalize_for(CE, specs)


def test_finalize_rejects_duplicates_unknown_groups_and_misalignment() -> None:
    specs = plan_regions(CE)
    with pytest.raises(LayoutError, match="twice"):
        finalize_for(CE, [specs[0], specs[0], *specs[2:]])
    odd = RegionSpec("odd", STORED_SWA, 0, (3,), "uint8")
    with pytest.raises(LayoutError, match="misaligned"):
        finalize_for(CE, [odd, *specs[-1:]])
    with pytest.raises(LayoutError, match="unknown group"):
        finalize_for(CE, [RegionSpec("x", "scratch", 0, (4,), "uint8")])


def test_finalize_rejects_a_stored_region_that_is_not_state_size_to_disk() -> None:
    specs = plan_regions(CE)
    # Move one stored layer into the consumer group: the total still adds up, the split does not.
    moved = dataclasses.replace(specs[19], group=CONSUMER_SWA)
    with pytest.raises(LayoutError, match="state_size_to_disk"):
        finalize_for(CE, [*specs[:19], moved, *specs[20:]])


# --- PE -> CE transfer ------------------------------------------------------------------------


def tag(layer: int, tokens: np.ndarray) -> np.ndarray:
    """528 bytes per token naming (layer, token): token+1 as int32 in bytes 0..3, layer in 4..5."""
    out = np.zeros((tokens.size, 528), dtype=np.uint8)
    out[:, 0:4] = (tokens + 1).astype("<i4").view(np.uint8).reshape(-1, 4)
    out[:, 4:6] = np.full(tokens.size, layer, dtype="<u2").view(np.uint8).reshape(-1, 2)
    out[:, 6:] = (tokens % 251).astype(np.uint8)[:, None]
    return out


def filled_pe_block(geometry: GeometryConfig, seq_len: int, seed: int = 0) -> np.ndarray:
    """A PE block after writing tokens 0..seq_len-1 one by one into every SWA ring (token t at
    slot t % ring), with random compression state."""
    layout = build_layout(geometry)
    block = layout.new_block()
    ring = layout.swa_ring
    rng = np.random.default_rng(seed)
    for region in layout.regions:
        if region.group == COMPRESSION:
            block[region.offset : region.end] = rng.integers(0, 256, region.nbytes, dtype=np.uint8)
            continue
        view = layout.view(block, region.name)
        for t in range(seq_len):  # the engine's writes, in order: later tokens overwrite
            view[t % ring, 0] = tag(region.layer, np.array([t]))[0]
    return block


def expected_window(layer: int, anchor: int, ring: int = 134) -> np.ndarray:
    tokens = np.arange(anchor - ring, anchor)
    expected = tag(layer, tokens)
    expected[tokens < 0] = 0
    return expected


@pytest.mark.parametrize(
    ("seq_len", "anchor", "expected_anchor"),
    [
        (1000, None, 896),  # PE ring wrapped twice; the window wraps across slot 395 -> 0
        (257, None, 256),
        (256, None, 128),  # one token held back: floor(255 / 128) * 128
        (200, None, 128),  # window starts at token -6: those slots stay zero
        (1000, 1000, 1000),  # live hand-off at the current position
        (1262, 1000, 1000),  # the window's oldest token is the oldest the 396-slot ring keeps
    ],
)
def test_pe_to_ce_reorders_both_swa_groups_into_window_order(
    seq_len: int, anchor: int | None, expected_anchor: int
) -> None:
    pe_block = filled_pe_block(PE, seq_len)
    ce_block = pe_to_ce(pe_block, PE, seq_len, anchor)
    ce_layout = build_layout(PE.for_decode())
    pe_layout = build_layout(PE)
    assert ce_block.size == ce_layout.total_bytes
    for region in ce_layout.regions:
        if region.group == COMPRESSION:
            source = pe_layout.region(region.name)
            assert np.array_equal(
                ce_block[region.offset : region.end], pe_block[source.offset : source.end]
            )
            continue
        window = ce_layout.view(ce_block, region.name)[:, 0]
        assert np.array_equal(window, expected_window(region.layer, expected_anchor)), region.name
    # The persisted prefix is exactly the stored layers' windows, in layer order.
    persisted = ce_layout.persisted_bytes(ce_block).reshape(20, 134, 528)
    for layer in range(20):
        assert np.array_equal(persisted[layer], expected_window(layer, expected_anchor))


def test_pe_to_ce_window_order_wraps_in_the_pe_ring() -> None:
    # seq_len 1000, anchor 896: window tokens 762..895 sit in PE slots 366..395 then 0..103.
    seq_len = 1000
    pe_block = filled_pe_block(PE, seq_len)
    ce_block = pe_to_ce(pe_block, PE, seq_len)
    ce_layout = build_layout(PE.for_decode())
    window = ce_layout.view(ce_block, swa_region_name(25))[:, 0]
    tokens = window[:, 0:4].copy().view("<i4")[:, 0] - 1
    assert tokens[0] == 762 and tokens[-1] == 895
    assert list(tokens) == list(range(762, 896))
    assert 762 % 396 == 366 and 895 % 396 == 103
    # The CE resumes by writing token 896 into slot 0: slot = (t - anchor) % 134.
    assert all((t - 896) % 134 == j for j, t in enumerate(tokens))


def test_pe_to_ce_from_a_ring_without_extra_state() -> None:
    geometry = GeometryConfig(role="prefill")  # ring 134: only a window ending at seq_len is whole
    pe_block = filled_pe_block(geometry, 700)
    ce_block = pe_to_ce(pe_block, geometry, 700, anchor=700)
    window = build_layout(geometry.for_decode()).view(ce_block, swa_region_name(0))[:, 0]
    assert np.array_equal(window, expected_window(0, 700))
    with pytest.raises(InvalidArgument) as error:
        pe_to_ce(pe_block, geometry, 700)  # aligned anchor 640 needs tokens already overwritten
    assert error.value.argument == "anchor"


def test_pe_to_ce_rejects_bad_arguments() -> None:
    layout = build_layout(PE)
    block = layout.new_block()
    with pytest.raises(InvalidArgument) as short:
        pe_to_ce(block, PE, 100)  # L <= 128: no aligned store position
    assert short.value.argument == "seq_len"
    with pytest.raises(InvalidArgument) as overwritten:
        pe_to_ce(block, PE, 2000, anchor=1280)
    assert overwritten.value.argument == "anchor"
    with pytest.raises(InvalidArgument, match="1000"):
        pe_to_ce(block, PE, 1263, anchor=1000)  # one token past what the ring keeps
    with pytest.raises(InvalidArgument):
        pe_to_ce(block, PE, 500, anchor=501)
    with pytest.raises(InvalidArgument):
        pe_to_ce(block, PE, 0)
    with pytest.raises(InvalidArgument) as size:
        pe_to_ce(block[:-1], PE, 500)
    assert size.value.argument == "pe_block"
