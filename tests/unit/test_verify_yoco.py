"""YoCo truncation check: mask vs compact agree; a broken compact and a short keep are caught;
preemption with truncation on changes results, with truncation off it does not."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from kvstore.errors import ConfigError  # noqa: E402
from kvstore.verify.measures import diff  # noqa: E402
from kvstore.verify.model import ModelConfig, V4Model, torch_settings, v4_layer_kinds  # noqa: E402
from kvstore.verify.preemption import preempt_and_resume  # noqa: E402
from kvstore.verify.yoco import (  # noqa: E402
    TOLERANCES,
    TruncatedRun,
    YocoCheckConfig,
    check_yoco,
    run_truncated,
)

SMALL = ModelConfig(layer_kinds=v4_layer_kinds(3))  # swa, csa, hca
PROMPT, CHUNK, KEEP, DECODE = 520, 128, 134, 6


@pytest.fixture(autouse=True)
def _torch_settings() -> Iterator[None]:
    with torch_settings():
        yield


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    gen = torch.Generator().manual_seed(11)
    return torch.randint(0, SMALL.vocab, (PROMPT + DECODE,), generator=gen)


def _run(model: V4Model, tokens: torch.Tensor, mode: str, keep: int = KEEP, broken: bool = False):
    return run_truncated(model, tokens, PROMPT, mode, chunk=CHUNK, keep=keep, off_by_one=broken)


@pytest.fixture(scope="module")
def runs(tokens: torch.Tensor) -> dict[tuple[str, str], TruncatedRun]:
    """Every run the tests compare, made once: (dtype, variant) -> run."""
    out = {}
    with torch_settings():
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            model = V4Model(SMALL, dtype)
            out[name, "mask"] = _run(model, tokens, "mask")
            out[name, "compact"] = _run(model, tokens, "compact")
            out[name, "broken"] = _run(model, tokens, "compact", broken=True)
        model = V4Model(SMALL)
        out["fp32", "off"] = _run(model, tokens, "off")
        out["fp32", "short"] = _run(model, tokens, "mask", keep=96)
    return out


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_mask_and_compact_agree_and_broken_compact_is_caught(
    dtype_name: str, runs: dict[tuple[str, str], TruncatedRun]
) -> None:
    tol = TOLERANCES[dtype_name]
    mask, compact = runs[dtype_name, "mask"], runs[dtype_name, "compact"]
    broken = runs[dtype_name, "broken"]
    assert mask.logits.shape == (PROMPT + DECODE, SMALL.vocab)
    good = diff(compact.logits, mask.logits)
    bad = diff(broken.logits, mask.logits)
    assert tol.holds(good), good
    assert not tol.holds(bad), bad
    assert bad.rel_l2 > 3 * tol.rel_l2
    # compact really frees memory: at most keep + chunk rows per layer; mask keeps them all.
    assert compact.swa_rows_held == KEEP + CHUNK
    assert mask.swa_rows_held == PROMPT + DECODE


def test_fp32_gap_is_orders_of_magnitude(runs: dict[tuple[str, str], TruncatedRun]) -> None:
    mask = runs["fp32", "mask"]
    noise = diff(runs["fp32", "compact"].logits, mask.logits).rel_l2
    bug = diff(runs["fp32", "broken"].logits, mask.logits).rel_l2
    assert bug > 1000 * TOLERANCES["fp32"].rel_l2
    assert bug > 1e4 * max(noise, 1e-12)


def test_off_equals_mask_and_short_keep_changes_outputs(
    runs: dict[tuple[str, str], TruncatedRun],
) -> None:
    off = runs["fp32", "off"]
    assert TOLERANCES["fp32"].holds(diff(runs["fp32", "mask"].logits, off.logits))
    assert not TOLERANCES["fp32"].holds(diff(runs["fp32", "short"].logits, off.logits))


def test_check_rows_all_hold_at_small_size() -> None:
    config = YocoCheckConfig(prompt_len=PROMPT, chunk=CHUNK, decode_steps=DECODE, model=SMALL)
    rows = check_yoco(config)
    assert {(r.dtype, r.compared) for r in rows} >= {
        ("fp32", "mask vs compact"),
        ("bf16", "mask vs compact"),
        ("fp32", "BROKEN compact (off-by-one) vs mask"),
        ("bf16", "BROKEN compact (off-by-one) vs mask"),
    }
    assert all(r.ok for r in rows), [r.as_dict() for r in rows if not r.ok]


def test_config_requires_keep_covering_window_and_backtracking() -> None:
    with pytest.raises(ConfigError, match="keep"):
        YocoCheckConfig(keep=133)
    with pytest.raises(ConfigError, match="prompt_len"):
        YocoCheckConfig(prompt_len=300, chunk=256)
    with pytest.raises(ConfigError, match="mode"):
        run_truncated(
            V4Model(SMALL), torch.zeros(400, dtype=torch.long), 300, "trim", chunk=64, keep=134
        )


def test_preemption_changes_results_only_with_truncation_on() -> None:
    model = V4Model(SMALL)
    prompt = torch.randint(0, SMALL.vocab, (520,), generator=torch.Generator().manual_seed(5))
    tol = TOLERANCES["fp32"]
    off = preempt_and_resume(model, prompt, steps=10, preempt_after=4, truncation=False)
    on = preempt_and_resume(model, prompt, steps=10, preempt_after=4, truncation=True)
    assert off.resumed_from == 0 and on.resumed_from > 0
    assert off.same_tokens and tol.holds(off.logits), off
    assert on.logits.rel_l2 > 100 * tol.rel_l2, on
