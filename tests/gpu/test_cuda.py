"""The CUDA path: pinned staging, side streams, one event per layer, no host sync in the step.

Skipped without a CUDA device; ``gpu/device_check.py`` runs these on a lent GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvstore.gpu.fetcher import Fetcher, FileGate
from kvstore.gpu.pools import DevicePools
from kvstore.gpu.save import Saver, SaveSpec, StateSave
from kvstore.gpu.swapin import LoadTarget, SwapIn
from kvstore.integrations.scheduler import PagedScheduler
from kvstore.integrations.worker import PagedWorker
from kvstore.keys import block_keys
from kvstore.tier.files import DirectoryTier

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: Enough GPU cycles (~0.5–1 s) that the host provably runs ahead of the device.
BUSY_CYCLES = 1_000_000_000


@pytest.fixture
def cuda_pools(geometry):
    return DevicePools(geometry, num_blocks=16, device="cuda")


def test_swap_in_to_the_gpu_gives_exactly_the_stored_bytes(
    tier, store, area, cuda_pools, kv, geometry
) -> None:
    prompt = store(6 * 128 + 10, state_at=640)
    keys = prompt.keys[:5]
    swapin = SwapIn(cuda_pools, area=area)
    try:
        assert swapin.pinned_staging  # the /dev/shm area was registered as pinned memory
        with Fetcher(tier.factory(), area, geometry) as fetcher:
            staged = fetcher.submit(keys, state_key=keys[4], state_position=640)
            load = swapin.submit(staged, LoadTarget("g", (9, 2, 14, 0, 5), tuple(keys), 2, 640))
            for layer in range(geometry.num_layers):
                load.wait(layer, timeout=60)
                # Compute on the current stream, ordered after the layer's copy by wait().
                if layer in cuda_pools.block_kv:
                    rows = cuda_pools.block_kv[layer][[9, 2, 14, 0, 5]].cpu().numpy()
                    for row, payload in zip(rows, prompt.payloads[:5], strict=True):
                        assert np.array_equal(row, kv.block_slice(payload, layer))
                if layer in cuda_pools.snapshot:
                    ring = cuda_pools.swa[layer][2].cpu().numpy()
                    assert np.array_equal(ring, kv.state_slice(prompt.state, layer))
            result = load.result(timeout=60)
    finally:
        swapin.close()
    assert result.loaded_block_ids == (9, 2, 14, 0, 5) and result.state_loaded


def test_wait_does_not_block_the_host_on_the_device(
    tmp_path, tier, store, area, cuda_pools, geometry
) -> None:
    prompt = store(3 * 128)
    swapin = SwapIn(cuda_pools, area=area)
    try:
        with Fetcher(tier.factory(), area, geometry) as fetcher:
            staged = fetcher.submit(prompt.keys)
            staged.wait_finished(60)
            torch.cuda._sleep(BUSY_CYCLES)  # the compute stream is busy for a while
            load = swapin.submit(staged, LoadTarget("g", (0, 1, 2), tuple(prompt.keys)))
            for layer in range(geometry.num_layers):
                load.wait(layer, timeout=60)  # host returns: the copies are only enqueued
            assert not torch.cuda.current_stream().query()  # the device is still busy
            torch.cuda.current_stream().synchronize()
            assert load.result(timeout=60).loaded_block_ids == (0, 1, 2)
    finally:
        swapin.close()


def test_layer_i_is_usable_before_layer_i_plus_1_arrives_on_cuda(
    tmp_path, tier, store, area, cuda_pools, geometry
) -> None:
    prompt = store(2 * 128 + 140)
    gate = FileGate(tmp_path / "gate", timeout_s=60)
    os.makedirs(gate.directory)
    gate.open(*range(4))
    swapin = SwapIn(cuda_pools, area=area)
    try:
        with Fetcher(tier.factory(), area, geometry, gate=gate) as fetcher:
            staged = fetcher.submit(prompt.keys[:2])
            load = swapin.submit(staged, LoadTarget("g", (3, 4), tuple(prompt.keys[:2])))
            load.wait(3, timeout=60)
            assert cuda_pools.block_kv[3][[3, 4]].any().item()
            assert not load.is_ready(4) and not staged.layer_staged(4)
            gate.open(*range(4, geometry.num_layers))
            assert load.result(timeout=60).failed_block_ids == ()
    finally:
        swapin.close()


def test_save_from_the_gpu_adds_no_host_sync_and_round_trips(
    tier, cuda_pools, kv, geometry
) -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    for layer in kv.block_layers:
        cuda_pools.block_kv[layer].copy_(
            torch.randint(
                0,
                256,
                cuda_pools.block_kv[layer].shape,
                generator=generator,
                device="cuda",
                dtype=torch.int32,
            ).to(torch.uint8)
        )
    for ring in cuda_pools.swa:
        ring.random_(0, 256, generator=generator)
    keys = block_keys(geometry.fingerprint(), np.arange(300))
    expected = {layer: cuda_pools.read_blocks(layer, [5, 6]).cpu() for layer in kv.block_layers}
    window = {
        layer: cuda_pools.gather_window(layer, 1, 256, written=256).cpu()
        for layer in kv.state_layers
    }
    saver = Saver(cuda_pools, tier)
    try:
        torch.cuda._sleep(BUSY_CYCLES)
        batch = saver.begin([SaveSpec("s", (5, 6), tuple(keys), StateSave(1, keys[1], 256, 256))])
        for layer in range(geometry.num_layers):
            batch.gather_layer(layer)
        (ticket,) = batch.seal()
        assert not ticket.done()  # seal returned while the device is still busy
        result = ticket.result(timeout=60)
    finally:
        saver.close()
    assert result.saved_keys == tuple(keys) and result.state_saved
    for index, read in enumerate(tier.get_blocks(keys)):
        payload = np.frombuffer(read.payload, dtype=np.uint8)
        for layer in kv.block_layers:
            assert np.array_equal(kv.block_slice(payload, layer), expected[layer][index].numpy())
    state = np.frombuffer(tier.get_swa_state(keys[1], 256).state, dtype=np.uint8)
    for layer in kv.state_layers:
        assert np.array_equal(kv.state_slice(state, layer), window[layer].numpy())


def test_paged_connector_core_round_trip_on_cuda(tmp_path) -> None:
    """One engine saves blocks of CUDA KV tensors, a second loads them into its own."""
    files = DirectoryTier(tmp_path / "paged")
    shape = (8, 2, 128, 64)
    prompt = [int(t) for t in np.random.default_rng(5).integers(2, 1000, 300)]
    kv = {
        "a": [torch.randn(shape, device="cuda") for _ in range(2)],
        "b": [torch.full(shape, float("nan"), device="cuda") for _ in range(2)],
    }
    for name, table in (("a", [4, 5, 6]), ("b", [1, 0, 7])):
        scheduler = PagedScheduler(files, b"cuda-engine".ljust(32, b"\0"), mode="full-attention")
        worker = PagedWorker(kv[name], files.factory(), files, staging_bytes=16 << 20)
        try:
            external = scheduler.matched_tokens("r", prompt, 0)
            assert external == (0 if name == "a" else 256)
            scheduler.allocated("r", table, external)
            scheduler.step("r", prompt, len(prompt), table=table)
            worker.start(scheduler.build())
            for layer in range(2):
                worker.wait_layer(layer)
                worker.save_layer(layer)
            worker.finish_step()
            assert worker.flush(60) and worker.load_errors() == set()
        finally:
            worker.close()
    for layer in range(2):
        assert torch.equal(kv["b"][layer][1], kv["a"][layer][4])
        assert torch.equal(kv["b"][layer][0], kv["a"][layer][5])
