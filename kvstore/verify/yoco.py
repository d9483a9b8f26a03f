"""YoCo prefill truncation, executable: ``mask`` and ``compact`` must give the same outputs.

One run = a chunked prefill of a prompt, truncating every layer's SWA keys to the last ``keep``
positions after each chunk, then teacher-forced decode steps (the same tokens in every run, so
every run sees identical inputs). The three truncation modes differ only in the key store:

- ``off``: the whole buffer stays and is attended (window mask only);
- ``mask``: the whole buffer stays, positions older than the kept suffix are masked out;
- ``compact``: the kept suffix is moved to the front of a ``keep + chunk`` buffer (memory
  really freed) and decode runs on the 134-slot ring.

Outputs (logits of every position) are compared by relative L2 and max absolute difference
against ``TOLERANCES`` (justified in ``Tolerance``). A deliberately broken compact (its move
copies one row too early) runs through the same comparison and must be reported as different,
and so must a ``keep`` shorter than the window: that is what proves the check can fail.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from kvstore.errors import ConfigError
from kvstore.verify.kvstores import CompactKV, LinearKV, RingKV
from kvstore.verify.measures import Diff, diff
from kvstore.verify.model import (
    BACKTRACK,
    RING_SLOTS,
    WINDOW,
    CompressedKV,
    LayerContext,
    ModelConfig,
    SwaKeyStore,
    V4Model,
)
from kvstore.verify.preemption import PreemptionOutcome, preempt_and_resume

TRUNCATION_MODES = ("off", "mask", "compact")


@dataclass(frozen=True)
class Tolerance:
    """Largest difference two runs may show and still count as the same outputs.

    mask and compact feed the same numbers to the same kernels; only the length and alignment
    of the reduced rows differ (the full buffer with masked zeros vs the compacted rows), so only
    the order of the softmax and value sums changes. A reordered sum of n terms moves by at most
    about n*u relative (u: unit roundoff), typically sqrt(n)*u, and each layer feeds it forward.
    The bounds below sit ~20x above the largest gap measured (default model, seeds 0-4: fp32
    4e-7, bf16 5e-4 relative L2) and well below what one misplaced key produces (the broken
    compact: ~4e-2 in both dtypes).
    """

    rel_l2: float
    max_abs: float
    why: str

    def holds(self, d: Diff) -> bool:
        return d.rel_l2 <= self.rel_l2 and d.max_abs <= self.max_abs


TOLERANCES: dict[str, Tolerance] = {
    # fp32: u = 2^-24 ~ 6e-8; ~150-term sums, 4-6 layers: a few 1e-7 expected, 1e-5 allowed.
    "fp32": Tolerance(rel_l2=1e-5, max_abs=1e-4, why="u=6.0e-8: reordered ~150-term sums x layers"),
    # bf16: every activation is rounded to 8 significant bits (u = 2^-8 ~ 3.9e-3); a reordered
    # fp32 softmax sum that lands on the other side of a bf16 rounding boundary flips one ulp,
    # which the next layers carry. Allow 1e-2 relative (~2.5 ulp) and 0.25 absolute on logits
    # of magnitude ~4.
    "bf16": Tolerance(rel_l2=1e-2, max_abs=0.25, why="u=3.9e-3: one-ulp flips carried on"),
}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class YocoCheckConfig:
    prompt_len: int = 1536
    decode_steps: int = 24
    chunk: int = 256
    keep: int = RING_SLOTS
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    #: Run the main comparison with the broken compact: the check must then fail (a demo that
    #: the CLI's exit status follows the check).
    inject_off_by_one: bool = False

    def __post_init__(self) -> None:
        # docs/rules.md §3: with truncation on, KEEP must cover window + backtracking.
        if self.keep < WINDOW + BACKTRACK:
            raise ConfigError(
                "keep", f"must be >= window + backtracking = {WINDOW + BACKTRACK}, got {self.keep}"
            )
        if self.chunk < 1:
            raise ConfigError("chunk", f"must be >= 1, got {self.chunk}")
        if self.prompt_len <= self.keep + self.chunk:
            raise ConfigError(
                "prompt_len",
                f"must exceed keep + chunk = {self.keep + self.chunk} so truncation happens",
            )
        if self.decode_steps < 1:
            raise ConfigError("decode_steps", f"must be >= 1, got {self.decode_steps}")


@dataclass(frozen=True)
class TruncatedRun:
    logits: torch.Tensor  # [prompt_len + decode_steps, vocab]
    swa_rows_held: int  # largest number of SWA key rows one layer held at any time


def run_truncated(
    model: V4Model,
    tokens: torch.Tensor,
    prompt_len: int,
    mode: str,
    *,
    chunk: int,
    keep: int,
    off_by_one: bool = False,
) -> TruncatedRun:
    """Chunked prefill of ``tokens[:prompt_len]`` then teacher-forced decode of the rest."""
    if mode not in TRUNCATION_MODES:
        raise ConfigError("mode", f"unknown truncation mode {mode!r}; one of {TRUNCATION_MODES}")
    if off_by_one and mode != "compact":
        raise ConfigError("off_by_one", "only a compact move can be off by one")
    cfg = model.config

    def store(_: int) -> SwaKeyStore:
        if mode == "compact":
            return CompactKV(keep + chunk, cfg.head_dim, model.dtype, off_by_one=off_by_one)
        return LinearKV(0, cfg.window, attend_whole=True, mask_truncation=(mode == "mask"))

    contexts = _contexts(model, store)
    held = 0
    logits = []
    with torch.inference_mode():
        for a in range(0, prompt_len, chunk):
            b = min(prompt_len, a + chunk)
            logits.append(model.logits(model.forward(tokens[a:b], a, contexts)))
            held = max(held, *(c.swa.rows for c in contexts))
            for context in contexts:
                context.swa.truncate(keep)
        if mode == "compact":
            contexts = [_to_ring(c) for c in contexts]
        for p in range(prompt_len, tokens.shape[0]):
            logits.append(model.logits(model.forward(tokens[p : p + 1], p, contexts)))
            held = max(held, *(c.swa.rows for c in contexts))
            for context in contexts:
                context.swa.truncate(keep)
    return TruncatedRun(torch.cat(logits), held)


def _contexts(model: V4Model, store: Callable[[int], SwaKeyStore]) -> list[LayerContext]:
    return [
        LayerContext(store(i), CompressedKV(layer, 0) if layer.compressor is not None else None)
        for i, layer in enumerate(model.layers)
    ]


def _to_ring(context: LayerContext) -> LayerContext:
    """PE->CE: re-order the compacted suffix into decode-ring order (positions from slots)."""
    store = context.swa
    assert isinstance(store, CompactKV)
    keys, values = store.window_rows(store.end, RING_SLOTS)
    ring = RingKV.from_window(keys, values, store.end - RING_SLOTS, RING_SLOTS, WINDOW)
    return LayerContext(ring, context.compressed)


@dataclass(frozen=True)
class YocoRow:
    dtype: str
    compared: str
    diff: Diff
    tolerance: Tolerance
    expect_same: bool
    rows_held: str

    @property
    def same(self) -> bool:
        return self.tolerance.holds(self.diff)

    @property
    def ok(self) -> bool:
        return self.same == self.expect_same

    def as_dict(self) -> dict[str, object]:
        return {
            "dtype": self.dtype,
            "compared": self.compared,
            **self.diff.as_dict(),
            "tolerance_rel_l2": self.tolerance.rel_l2,
            "tolerance_max_abs": self.tolerance.max_abs,
            "expect": "same" if self.expect_same else "differ",
            "outcome": "same" if self.same else "differ",
            "swa_rows_held": self.rows_held,
            "ok": self.ok,
        }


def check_yoco(config: YocoCheckConfig | None = None) -> list[YocoRow]:
    """Every comparison of the check; each row says what was expected and whether it held."""
    config = config or YocoCheckConfig()
    gen = torch.Generator().manual_seed(config.seed + 1)
    total = config.prompt_len + config.decode_steps
    tokens = torch.randint(0, config.model.vocab, (total,), generator=gen)
    rows: list[YocoRow] = []
    keep = config.keep
    for dtype_name, dtype in DTYPES.items():
        # Same seed, so the bf16 model holds the fp32 weights rounded to bf16.
        model = V4Model(config.model, dtype)
        tol = TOLERANCES[dtype_name]
        run = partial(run_truncated, model, tokens, config.prompt_len, chunk=config.chunk)
        off, mask = run("off", keep=keep), run("mask", keep=keep)
        compact = run("compact", keep=keep, off_by_one=config.inject_off_by_one)
        held = f"{mask.swa_rows_held} vs {compact.swa_rows_held}"
        rows.append(
            YocoRow(
                dtype_name, "mask vs compact", diff(compact.logits, mask.logits), tol, True, held
            )
        )
        rows.append(
            YocoRow(dtype_name, "off vs mask", diff(mask.logits, off.logits), tol, True, "")
        )
        rows.append(
            YocoRow(dtype_name, "off vs compact", diff(compact.logits, off.logits), tol, True, "")
        )
        broken = run("compact", keep=keep, off_by_one=True)
        rows.append(
            YocoRow(
                dtype_name,
                "BROKEN compact (off-by-one) vs mask",
                diff(broken.logits, mask.logits),
                tol,
                False,
                "",
            )
        )
        if dtype is torch.float32:
            short_keep = WINDOW - 32
            short = run("mask", keep=short_keep)
            rows.append(
                YocoRow(
                    dtype_name,
                    f"mask with keep={short_keep} < window vs off",
                    diff(short.logits, off.logits),
                    tol,
                    False,
                    "",
                )
            )
    return rows


@dataclass(frozen=True)
class PreemptionRow:
    outcome: PreemptionOutcome
    tolerance: Tolerance

    @property
    def expect_same(self) -> bool:
        return self.outcome.truncation == "off"

    @property
    def same(self) -> bool:
        return self.tolerance.holds(self.outcome.logits) and self.outcome.same_tokens

    @property
    def ok(self) -> bool:
        # Off: the recompute must reproduce the run. On: it must be seen to differ (the logits
        # move beyond fp32 noise); whether a greedy token flips depends on the margins.
        if self.expect_same:
            return self.same
        return not self.tolerance.holds(self.outcome.logits)

    def as_dict(self) -> dict[str, object]:
        return {**self.outcome.as_dict(), "ok": self.ok}


@dataclass(frozen=True)
class YocoReport:
    config: YocoCheckConfig
    rows: list[YocoRow]
    preemption: list[PreemptionRow]

    @property
    def ok(self) -> bool:
        return all(row.ok for row in self.rows) and all(row.ok for row in self.preemption)

    def as_dict(self) -> dict[str, object]:
        c = self.config
        return {
            "check": "yoco",
            "ok": self.ok,
            "prompt_len": c.prompt_len,
            "chunk": c.chunk,
            "keep": c.keep,
            "decode_steps": c.decode_steps,
            "layer_kinds": list(c.model.layer_kinds),
            "tolerances": {
                name: {"rel_l2": t.rel_l2, "max_abs": t.max_abs, "why": t.why}
                for name, t in TOLERANCES.items()
            },
            "comparisons": [row.as_dict() for row in self.rows],
            "preemption": [row.as_dict() for row in self.preemption],
        }


def run_yoco(config: YocoCheckConfig | None = None) -> YocoReport:
    """The mask/compact comparisons plus preemption with truncation off and on (fp32)."""
    config = config or YocoCheckConfig()
    rows = check_yoco(config)
    model = V4Model(config.model)
    gen = torch.Generator().manual_seed(config.seed + 4)
    prompt = torch.randint(0, config.model.vocab, (config.prompt_len,), generator=gen)
    after = max(1, config.decode_steps // 3)
    preemption = [
        PreemptionRow(
            preempt_and_resume(model, prompt, config.decode_steps, after, truncation),
            TOLERANCES["fp32"],
        )
        for truncation in (False, True)
    ]
    return YocoReport(config, rows, preemption)
