"""The small V4-style model and its key stores (kvstore.verify.model / kvstores / sequence)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from kvstore.errors import ConfigError, InvalidArgument  # noqa: E402
from kvstore.verify.kvstores import CompactKV, LinearKV, RingKV  # noqa: E402
from kvstore.verify.measures import diff  # noqa: E402
from kvstore.verify.model import (  # noqa: E402
    RING_SLOTS,
    CompressedKV,
    ModelConfig,
    V4Model,
    torch_settings,
    v4_layer_kinds,
)
from kvstore.verify.sequence import fresh_contexts, ring_contexts  # noqa: E402
from kvstore.verify.yoco import TOLERANCES  # noqa: E402

FP32 = TOLERANCES["fp32"]
SMALL = ModelConfig(layer_kinds=v4_layer_kinds(4))


@pytest.fixture(autouse=True)
def _torch_settings() -> Iterator[None]:
    with torch_settings():
        yield


@pytest.fixture(scope="module")
def model() -> V4Model:
    return V4Model(SMALL)


def _tokens(n: int, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, SMALL.vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_chunked_prefill_matches_one_shot(model: V4Model) -> None:
    tokens = _tokens(700)
    with torch.inference_mode():
        whole = model.forward(tokens, 0, fresh_contexts(model))
        contexts = fresh_contexts(model)
        parts = [model.forward(tokens[a : a + 130], a, contexts) for a in range(0, 700, 130)]
    assert FP32.holds(diff(torch.cat(parts), whole))


def test_ring_decode_matches_prefill(model: V4Model) -> None:
    tokens = _tokens(600)
    with torch.inference_mode():
        reference = model.logits(model.forward(tokens, 0, fresh_contexts(model)))
        contexts = fresh_contexts(model)
        model.forward(tokens[:560], 0, contexts)
        ring = ring_contexts(contexts)
        steps = [model.logits(model.forward(tokens[p : p + 1], p, ring)) for p in range(560, 600)]
    assert FP32.holds(diff(torch.cat(steps), reference[560:]))


def test_window_is_128_tokens(model: V4Model) -> None:
    # Changing a token 128 positions back must not move layer 0's output; 127 back must.
    tokens = _tokens(300)
    layer = model.layers[0]
    with torch.inference_mode():
        x = model.embed(tokens)
        base = layer.forward(x, 0, fresh_contexts(model)[0], 0, 128)
        for back, moves in ((128, False), (127, True)):
            changed = tokens.clone()
            changed[299 - back] = (changed[299 - back] + 1) % SMALL.vocab
            out = layer.forward(model.embed(changed), 0, fresh_contexts(model)[0], 0, 128)
            assert bool((out[299] != base[299]).any()) is moves


def test_weights_are_deterministic_and_shared_across_dtypes() -> None:
    a, b = V4Model(SMALL), V4Model(SMALL)
    other = V4Model(ModelConfig(layer_kinds=SMALL.layer_kinds, seed=1))
    half = V4Model(SMALL, torch.bfloat16)
    assert torch.equal(a.layers[2].wq, b.layers[2].wq)
    assert not torch.equal(a.layers[2].wq, other.layers[2].wq)
    assert torch.equal(a.layers[2].wq.to(torch.bfloat16), half.layers[2].wq)


def test_compressed_entries_do_not_depend_on_chunking(model: V4Model) -> None:
    layer = model.layers[2]  # csa
    assert layer.compressor is not None and layer.compressor.window > layer.compressor.ratio
    raw = layer.raw_rows(
        torch.randn(300, SMALL.d_model, generator=torch.Generator().manual_seed(3))
    )
    one = CompressedKV(layer, 0)
    one.extend(raw, 0)
    pieces = CompressedKV(layer, 0)
    for a in range(0, 300, 7):
        pieces.extend(raw[a : a + 7], a)
    assert one.count == pieces.count == 300 // 4
    assert torch.allclose(one.keys, pieces.keys, atol=1e-6)
    assert one.index_keys is not None and pieces.index_keys is not None
    assert torch.allclose(one.index_keys, pieces.index_keys, atol=1e-6)
    with pytest.raises(InvalidArgument, match="start"):
        pieces.extend(raw[:1], 5)


def test_compact_moves_the_kept_suffix_to_the_front() -> None:
    rows = torch.arange(10, dtype=torch.float32)[:, None].repeat(1, 2)
    good = CompactKV(12, 2, torch.float32)
    good.append(rows, rows, 0)
    good.truncate(4)
    keys, _, positions = good.view(10, 11)
    assert positions.tolist() == [6, 7, 8, 9]
    assert keys[:, 0].tolist() == [6, 7, 8, 9]  # slot i holds position base + i
    broken = CompactKV(12, 2, torch.float32, off_by_one=True)
    broken.append(rows, rows, 0)
    broken.truncate(4)
    keys, _, positions = broken.view(10, 11)
    assert positions.tolist() == [6, 7, 8, 9]
    assert keys[:, 0].tolist() == [5, 6, 7, 8]  # labelled one position too late
    with pytest.raises(InvalidArgument, match="overflow"):
        good.append(torch.zeros(9, 2), torch.zeros(9, 2), 10)


def test_mask_hides_but_keeps_rows() -> None:
    store = LinearKV(0, 128, attend_whole=True, mask_truncation=True)
    store.append(torch.zeros(300, 2), torch.zeros(300, 2), 0)
    store.truncate(134)
    _, _, positions = store.view(300, 301)
    assert store.rows == 300
    assert (positions[:166] == -1).all() and positions[166:].tolist() == list(range(166, 300))


def test_ring_slots_and_overflow() -> None:
    keys = torch.arange(200, dtype=torch.float32)[:, None]
    ring = RingKV.from_window(keys[-RING_SLOTS:], keys[-RING_SLOTS:], 66, RING_SLOTS, 128)
    k, _, positions = ring.view(200, 201)
    assert sorted(positions.tolist()) == list(range(66, 200))
    assert torch.equal(k[positions % RING_SLOTS][:, 0], positions.float())
    with pytest.raises(InvalidArgument, match="overflow"):
        ring.append(torch.zeros(8, 1), torch.zeros(8, 1), 200)  # > 134 - 128 + 1 rows at once
    with pytest.raises(InvalidArgument, match="start"):
        ring.append(torch.zeros(1, 1), torch.zeros(1, 1), 201)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="layer_kinds"):
        ModelConfig(layer_kinds=("swa", "mla"))
    with pytest.raises(ConfigError, match="head_dim"):
        ModelConfig(head_dim=31)
    with pytest.raises(ConfigError, match="score_gain"):
        ModelConfig(score_gain=0.0)
    with pytest.raises(ConfigError, match="layers"):
        v4_layer_kinds(0)
    assert v4_layer_kinds(6) == ("swa", "swa", "csa", "hca", "csa", "hca")


def test_torch_settings_restore() -> None:
    before = torch.are_deterministic_algorithms_enabled()
    with torch_settings(threads=1):
        assert torch.get_num_threads() == 1
        assert torch.are_deterministic_algorithms_enabled()
    assert torch.are_deterministic_algorithms_enabled() == before


def test_cli_import_does_not_import_torch() -> None:
    code = "import sys, kvstore.cli, kvstore.commands.verify, kvstore.verify; "
    code += "sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
