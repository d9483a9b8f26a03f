"""The CUDA path: pinned staging, side streams, one event per layer, no host sync in the step.

Skipped without a CUDA device; ``gpu/device_check.py`` runs these on a lent GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvstore.engine.fetcher import Fetcher, FileGate
from kvstore.engine.rows import KVRows, as_ids
from kvstore.engine.save import Gatherer, SaveRows
from kvstore.engine.scheduler import PagedScheduler
from kvstore.engine.swapin import LoadTarget, SwapIn
from kvstore.engine.worker import PagedWorker
from kvstore.keys import BLOCK_TOKENS, block_keys
from kvstore.tier.files import DirectoryTier

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: Enough GPU cycles (~0.5–1 s) that the host provably runs ahead of the device.
BUSY_CYCLES = 1_000_000_000
LAYERS, BLOCKS, SHAPE = 4, 16, (2, BLOCK_TOKENS, 64)
ROW = int(np.prod(SHAPE)) * 2  # bf16
FINGERPRINT = b"cuda-test".ljust(32, b"\0")


def cuda_cache(fill: float | None = None) -> list[torch.Tensor]:
    if fill is not None:
        return [
            torch.full((BLOCKS, *SHAPE), fill, dtype=torch.bfloat16, device="cuda")
            for _ in range(LAYERS)
        ]
    return [
        torch.randn((BLOCKS, *SHAPE), dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)
    ]


def stored(tier: DirectoryTier, blocks: int) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(blocks)
    keys = [bytes(k) for k in block_keys(FINGERPRINT, rng.integers(2, 1000, blocks * 128))]
    payloads = [rng.integers(0, 256, LAYERS * ROW, dtype=np.uint8).tobytes() for _ in keys]
    tier.put_blocks(keys, payloads)
    return keys, payloads


def host_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.cpu().view(torch.uint8).numpy().tobytes()


@pytest.fixture
def files(tmp_path) -> DirectoryTier:
    return DirectoryTier(tmp_path / "cuda-tier")


def test_swap_in_to_the_gpu_gives_exactly_the_stored_bytes(files, area) -> None:
    keys, payloads = stored(files, 5)
    cache = cuda_cache(0.0)
    rows = KVRows.of(cache, None)
    swapin = SwapIn(rows, area=area)
    block_ids = [9, 2, 14, 0, 5]
    try:
        assert swapin.pinned_staging  # the /dev/shm area was registered as pinned memory
        with Fetcher(files.factory(), area, rows.kv) as fetcher:
            load = swapin.submit(fetcher.submit(keys), LoadTarget("g", as_ids(block_ids)))
            for layer in range(LAYERS):
                load.wait(layer, timeout=60)
                # Compute on the current stream, ordered after the layer's copy by wait().
                for block, payload in zip(block_ids, payloads, strict=True):
                    assert (
                        host_bytes(cache[layer][block]) == payload[layer * ROW : (layer + 1) * ROW]
                    )
            result = load.result(timeout=60)
    finally:
        swapin.close()
    assert result.error is None and result.blocks_loaded == 5


def test_wait_does_not_block_the_host_on_the_device(files, area) -> None:
    keys, _ = stored(files, 3)
    rows = KVRows.of(cuda_cache(0.0), None)
    swapin = SwapIn(rows, area=area)
    try:
        with Fetcher(files.factory(), area, rows.kv) as fetcher:
            staged = fetcher.submit(keys)
            staged.wait_finished(60)
            torch.cuda._sleep(BUSY_CYCLES)  # the compute stream is busy for a while
            load = swapin.submit(staged, LoadTarget("g", as_ids([0, 1, 2])))
            for layer in range(LAYERS):
                load.wait(layer, timeout=60)  # host returns: the copies are only enqueued
            assert not torch.cuda.current_stream().query()  # the device is still busy
            torch.cuda.current_stream().synchronize()
            assert load.result(timeout=60).blocks_loaded == 3
    finally:
        swapin.close()


def test_layer_i_is_usable_before_layer_i_plus_1_arrives_on_cuda(tmp_path, files, area) -> None:
    keys, payloads = stored(files, 2)
    cache = cuda_cache(0.0)
    rows = KVRows.of(cache, None)
    gate = FileGate(tmp_path / "gate", timeout_s=60)
    os.makedirs(gate.directory)
    gate.open(0, 1)
    swapin = SwapIn(rows, area=area)
    try:
        with Fetcher(files.factory(), area, rows.kv, gate=gate) as fetcher:
            staged = fetcher.submit(keys)
            load = swapin.submit(staged, LoadTarget("g", as_ids([3, 4])))
            load.wait(1, timeout=60)
            # Bytes, not values: random payload bytes read as bf16 include NaNs.
            layer_1 = [payload[ROW : 2 * ROW] for payload in payloads]
            assert [host_bytes(cache[1][block]) for block in (3, 4)] == layer_1
            assert not staged.layer_staged(2)
            gate.open(2, 3)
            assert load.result(timeout=60).failed_block_ids == ()
    finally:
        swapin.close()


def test_the_gather_from_the_gpu_adds_no_host_sync_in_the_step() -> None:
    cache = cuda_cache()
    expected = {layer: host_bytes(cache[layer][[5, 6]]) for layer in range(LAYERS)}
    gatherer = Gatherer(KVRows.of(cache, None))
    try:
        torch.cuda._sleep(BUSY_CYCLES)
        batch = gatherer.begin([SaveRows(as_ids([5, 6]))])
        for layer in range(LAYERS):
            batch.gather_layer(layer)
        batch.seal()
        assert not torch.cuda.current_stream().query()  # seal returned, the device still busy
        host = batch.host_rows(0)  # the put thread's wait
    finally:
        gatherer.close()
    assert all(host[layer].tobytes() == expected[layer] for layer in range(LAYERS))


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
