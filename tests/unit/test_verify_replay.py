"""Bounded replay (encoder side and decoder side): error measured, exactness where theory says
so, constant cost, block KV untouched; and the checks fail when the cache is wrong."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from kvstore.errors import ConfigError  # noqa: E402
from kvstore.verify.ced import CEDConfig, DecoderRebuild, run_ced  # noqa: E402
from kvstore.verify.model import WINDOW, ModelConfig, V4Model, torch_settings, v4_layer_kinds  # noqa: E402
from kvstore.verify.replay import (  # noqa: E402
    Check,
    ReplayCheckConfig,
    ReplayReport,
    SizeReport,
    bounded_replay,
    decoder_checks,
    exact_prefix,
    no_replay,
    replay_checks,
    run_replay,
)
from kvstore.verify.report import render_replay  # noqa: E402
from kvstore.verify.sequence import BlockKV  # noqa: E402
from kvstore.verify.yoco import TOLERANCES  # noqa: E402

TOL = TOLERANCES["fp32"].rel_l2
SMALL = ModelConfig(layer_kinds=v4_layer_kinds(4))
CONFIG = ReplayCheckConfig(sizes=(768, 1024), suffix=134, model=SMALL)


@pytest.fixture(autouse=True)
def _torch_settings() -> Iterator[None]:
    with torch_settings():
        yield


@pytest.fixture(scope="module")
def reports() -> list[SizeReport]:
    with torch_settings():
        return run_replay(CONFIG)


def test_replay_error_is_measured_per_layer(reports: list[SizeReport]) -> None:
    for size in reports:
        errors = size.replay.layer_errors
        assert len(errors) == SMALL.n_layers
        assert errors[0] <= TOL  # layer 0 reads embeddings: exact
        assert all(e > TOL for e in errors[1:])  # deeper layers read truncated attention
        assert size.replay.start == size.hit - WINDOW
        assert size.replay.tokens_computed == WINDOW * SMALL.n_layers
        assert size.exact_tokens == size.hit * SMALL.n_layers


def test_replay_becomes_exact_as_s_moves_back(reports: list[SizeReport]) -> None:
    first = reports[0]
    runs = {first.hit - run.start: run for run in (first.replay, *first.sweep)}
    assert CONFIG.exact_start_bound in runs
    # Layer d's keys at [L1-128, L1) depend on positions back to L1-128-127d.
    for back, run in runs.items():
        for depth, error in enumerate(run.layer_errors):
            if back >= WINDOW + (WINDOW - 1) * depth:
                assert error <= TOL, (back, depth, error)
    assert max(runs[CONFIG.exact_start_bound].layer_errors) <= TOL
    assert runs[CONFIG.exact_start_bound].next_token.rel_l2 <= TOL


def test_replay_beats_no_replay_and_all_checks_hold(reports: list[SizeReport]) -> None:
    for size in reports:
        assert size.baseline.tokens_computed == 0
        assert size.replay.suffix_logits.rel_l2 < size.baseline.suffix_logits.rel_l2
    checks = replay_checks(reports, CONFIG)
    assert checks and all(check.ok for check in checks), [c for c in checks if not c.ok]


def test_replay_never_touches_block_kv() -> None:
    model = V4Model(SMALL)
    tokens = torch.randint(
        0, SMALL.vocab, (1024 + 134,), generator=torch.Generator().manual_seed(1)
    )
    exact = exact_prefix(model, tokens, 1024)
    before = [None if e is None else (e[0].clone(), e[1].clone()) for e in exact.block_kv.layers]
    bounded_replay(model, tokens, exact, 1024 - WINDOW)
    no_replay(model, tokens, exact)
    for kept, now in zip(before, exact.block_kv.layers, strict=True):
        if kept is not None:
            assert now is not None
            assert torch.equal(kept[0], now[0]) and torch.equal(kept[1], now[1])
    with pytest.raises(ConfigError, match="start"):
        bounded_replay(model, tokens, exact, 1024 - 64)  # too short to rebuild a whole window


def test_checks_fail_when_the_cached_block_kv_is_wrong() -> None:
    """A replay fed corrupted block KV can no longer be exact even from far back: the check
    that demands it must fail."""
    model = V4Model(SMALL)
    hit = 768
    tokens = torch.randint(0, SMALL.vocab, (hit + 134,), generator=torch.Generator().manual_seed(2))
    exact = exact_prefix(model, tokens, hit)
    layers = list(exact.block_kv.layers)
    csa = next(i for i, kind in enumerate(SMALL.layer_kinds) if kind == "csa")
    keys, values, index = layers[csa]  # type: ignore[misc]
    layers[csa] = (keys + 0.5, values, index)
    corrupted = type(exact)(
        exact.hit,
        exact.tokens_computed,
        exact.wall_s,
        exact.window,
        BlockKV(hit, tuple(layers)),
        exact.suffix_logits,
    )
    replay = bounded_replay(model, tokens, corrupted, hit - WINDOW)
    far = bounded_replay(model, tokens, corrupted, hit - CONFIG.exact_start_bound)
    report = SizeReport(
        hit, exact.tokens_computed, exact.wall_s, replay, no_replay(model, tokens, exact), (far,)
    )
    checks = {check.name: check for check in replay_checks([report], CONFIG)}
    failed = [name for name, check in checks.items() if not check.ok]
    assert any("exact at every layer" in name for name in failed), checks


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="sizes"):
        ReplayCheckConfig(sizes=(1000,))
    with pytest.raises(ConfigError, match="sizes"):
        ReplayCheckConfig(sizes=(256,), model=SMALL)  # shorter than 128 x layers
    with pytest.raises(ConfigError, match="prompt_len"):
        CEDConfig(decoder_layers=20, prompt_len=2048)


CED = CEDConfig(encoder_kinds=v4_layer_kinds(3), decoder_layers=4, prompt_len=1024)


@pytest.fixture(scope="module")
def decoder_rows() -> list[DecoderRebuild]:
    with torch_settings():
        return run_ced(CED)


def test_decoder_side_replay(decoder_rows: list[DecoderRebuild]) -> None:
    ced = CED
    full, exact, bounded = decoder_rows
    assert full.start == 0 and exact.start == 1024 - 4 * WINDOW and bounded.start == 1024 - WINDOW
    assert exact.decoder_tokens == 4 * 4 * WINDOW and bounded.decoder_tokens == 4 * WINDOW
    assert max(exact.layer_errors) <= TOL and exact.next_token.rel_l2 <= TOL
    assert bounded.layer_errors[0] <= TOL and max(bounded.layer_errors[1:]) > TOL
    # The whole prefill (encoder + decoder) shrinks: decoder work is 128 instead of the prompt.
    assert bounded.prefill_tokens == 1024 * 3 + 4 * WINDOW < full.prefill_tokens
    assert all(check.ok for check in decoder_checks([full, exact, bounded], ced))


def test_report_renders_every_table(
    reports: list[SizeReport], decoder_rows: list[DecoderRebuild]
) -> None:
    checks = replay_checks(reports, CONFIG) + decoder_checks(decoder_rows, CED)
    report = ReplayReport(CONFIG, reports, decoder_rows, CED, checks)
    text = render_replay(report)
    for title in (
        "Bounded replay from s = L1-128",
        "error vs depth",
        "error vs replay start",
        "Decoder-side replay",
    ):
        assert title in text
    assert text.rstrip().endswith("replay: PASS")
    assert report.as_dict()["ok"] is True
    broken = ReplayReport(CONFIG, reports, decoder_rows, CED, [*checks, Check("x", False, "")])
    assert render_replay(broken).rstrip().endswith("replay: FAIL")
