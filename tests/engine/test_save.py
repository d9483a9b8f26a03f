"""Worker side, saves: the save gather reads the engine's rows off the engine thread.

The engine's cache is per-layer tensors shaped like vLLM's; ``test_cuda.py`` runs the same
mechanism on a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvstore.engine import save as save_module
from kvstore.engine.groups import FULL, SLIDING, CacheGroup, EngineGroups
from kvstore.engine.rows import KVRows, as_ids
from kvstore.engine.save import Gatherer, SaveRows
from kvstore.errors import InvalidArgument, SwapInError
from kvstore.keys import BLOCK_TOKENS

LAYERS, BLOCKS, SHAPE = 4, 8, (2, BLOCK_TOKENS, 8)


@pytest.fixture
def cache() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn((BLOCKS, *SHAPE), generator=generator) for _ in range(LAYERS)]


@pytest.fixture
def gatherer(cache) -> Iterator[Gatherer]:
    made = Gatherer(KVRows.of(cache, None))
    yield made
    made.close()


def rows_of(cache, layer: int, ids) -> bytes:
    return cache[layer][list(ids)].numpy().tobytes()


def gathered(gatherer: Gatherer, saves: list[SaveRows]):
    """A batch of ``saves`` with every layer gathered, sealed."""
    batch = gatherer.begin(saves)
    for layer in range(LAYERS):
        batch.gather_layer(layer)
    batch.seal()
    return batch


def test_a_save_reads_its_rows_as_they_were_when_gathered(cache, gatherer) -> None:
    batch = gatherer.begin([SaveRows(as_ids([5, 1, 6]))])
    expected = {layer: rows_of(cache, layer, [5, 1, 6]) for layer in range(LAYERS)}
    for layer in range(LAYERS):
        batch.gather_layer(layer)
    batch.seal()
    for tensor in cache:  # the engine reuses the rows once the step is over
        tensor.fill_(7.0)
    host = batch.host_rows(0)
    assert batch.complete(0) and sorted(host) == list(range(LAYERS))
    assert all(host[layer].tobytes() == expected[layer] for layer in range(LAYERS))


def test_the_device_to_host_gather_is_not_on_the_engine_thread(
    cache, gatherer, monkeypatch
) -> None:
    gathered_on: list[str] = []
    gather = save_module._gather

    def spy(source, index, out) -> None:
        gathered_on.append(threading.current_thread().name)
        gather(source, index, out)

    monkeypatch.setattr(save_module, "_gather", spy)
    batch = gathered(gatherer, [SaveRows(as_ids([0, 1])), SaveRows(as_ids([3]))])
    assert batch.host_rows(1)[2].tobytes() == rows_of(cache, 2, [3])
    assert gathered_on == ["kvstore-save-gather"] * (2 * LAYERS)


def test_a_save_missing_a_layer_is_incomplete(gatherer) -> None:
    batch = gatherer.begin([SaveRows(as_ids([0]))])
    batch.gather_layer(0)
    batch.seal()
    assert not batch.complete(0)
    with pytest.raises(InvalidArgument, match="sealed"):
        batch.gather_layer(1)


def test_a_window_state_reads_the_sliding_layers_window_rows(cache) -> None:
    row = int(np.prod(SHAPE)) * 4
    groups = EngineGroups(
        BLOCK_TOKENS,
        row,
        tuple(f"layers.{i}" for i in range(LAYERS)),
        (CacheGroup(SLIDING, (0, 2), 128), CacheGroup(FULL, (1, 3))),
    )
    gatherer = Gatherer(KVRows.of(cache, groups))
    try:
        batch = gathered(gatherer, [SaveRows(as_ids([2, 3]), (as_ids([6]),))])
        host = batch.host_rows(0)
    finally:
        gatherer.close()
    assert host[1].tobytes() == rows_of(cache, 1, [2, 3])  # full layers: the blocks
    assert host[0].tobytes() == rows_of(cache, 0, [6])  # sliding layers: the window
    assert host[2].tobytes() == rows_of(cache, 2, [6])


def test_a_failed_gather_fails_its_saves_and_the_next_batch_works(
    cache, gatherer, monkeypatch
) -> None:
    def broken(source, index, out) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(save_module, "_gather", broken)
    batch = gathered(gatherer, [SaveRows(as_ids([0]))])
    with pytest.raises(SwapInError, match="device lost"):
        batch.host_rows(0)
    monkeypatch.undo()
    again = gathered(gatherer, [SaveRows(as_ids([0]))])
    assert again.host_rows(0)[0].tobytes() == rows_of(cache, 0, [0])


def test_bad_rows_are_refused_before_anything_is_gathered(gatherer) -> None:
    with pytest.raises(InvalidArgument, match="block_ids"):
        gatherer.begin([SaveRows(as_ids([BLOCKS]))])
    with pytest.raises(InvalidArgument, match="windows"):
        gatherer.begin([SaveRows(as_ids([0]), (as_ids([-1]),))])
    batch = gatherer.begin([SaveRows(as_ids([0]))])
    with pytest.raises(SwapInError, match="sealed"):
        batch.host_rows(0)


def test_an_engine_in_inference_mode_has_its_rows_gathered() -> None:
    """Engines (vLLM) run the forward in inference mode: their cache and the host buffers
    made on their thread are inference tensors, which the gather thread must be able to fill."""
    with torch.inference_mode():
        cache = [torch.randn((BLOCKS, *SHAPE)) for _ in range(LAYERS)]
        gatherer = Gatherer(KVRows.of(cache, None))
        try:
            batch = gathered(gatherer, [SaveRows(as_ids([2, 4]))])
            host = batch.host_rows(0)
        finally:
            gatherer.close()
    assert all(host[layer].tobytes() == rows_of(cache, layer, [2, 4]) for layer in range(LAYERS))
