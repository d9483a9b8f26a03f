"""Bounded replay, executable: rebuild SWA state from ``s = L1 - 128`` and measure the error.

A prefix of ``L1`` tokens hits in the block-KV cache (compressed entries of every layer) but its
SWA state is missing. Bounded replay runs the model over ``[s, L1)`` only, query ``i`` attending
keys ``[max(s, i-127), i]``, reusing the cached entries verbatim, and keeps the SWA keys of
``[L1-128, L1)`` as the rebuilt state. Layer 0's keys are exact (its input is the embedding);
every deeper layer's input came through truncated attention, so its keys are approximate. This
module measures that error per layer, against the replay start ``s`` and in the logits of the
suffix computed on top (docs/rules.md §5: at least the last 134 prompt tokens are always computed),
and the cost against an exact recompute (a full prefill of the prefix).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstore.errors import ConfigError
from kvstore.verify.ced import CEDConfig, DecoderRebuild, run_ced
from kvstore.verify.measures import Diff, best_wall, diff
from kvstore.verify.model import RING_SLOTS, WINDOW, LayerContext, ModelConfig, V4Model
from kvstore.verify.sequence import (
    BlockKV,
    block_kv_of,
    fresh_contexts,
    replay_contexts,
    swa_window,
)
from kvstore.verify.yoco import TOLERANCES

DEFAULT_SIZES = (8192, 32768, 131072)


@dataclass(frozen=True)
class ReplayCheckConfig:
    sizes: tuple[int, ...] = DEFAULT_SIZES
    #: Tokens computed after the hit (docs/rules.md §5: the last 134 of a prompt are always
    #: computed).
    suffix: int = RING_SLOTS
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)

    def __post_init__(self) -> None:
        if not self.sizes:
            raise ConfigError("sizes", "need at least one prefix size")
        for size in self.sizes:
            if size % WINDOW or size < WINDOW * self.model.n_layers:
                raise ConfigError(
                    "sizes",
                    f"each size must be a multiple of {WINDOW} and >= {WINDOW} x layers "
                    f"= {WINDOW * self.model.n_layers}, got {size}",
                )
        if self.suffix < 1:
            raise ConfigError("suffix", f"must be >= 1, got {self.suffix}")

    @property
    def exact_start_bound(self) -> int:
        """Distance back from L1 at which replay is exact at every layer: layer d's keys at
        ``[L1-128, L1)`` depend on positions back to ``L1 - 128 - 127*d``."""
        return WINDOW + (WINDOW - 1) * (self.model.n_layers - 1)


@dataclass(frozen=True)
class ReplayRun:
    """One bounded replay from ``start`` of a prefix hit at ``hit`` tokens."""

    hit: int
    start: int
    layer_errors: tuple[float, ...]  # rel L2 of rebuilt vs exact SWA keys+values, per layer
    next_token: Diff  # logits of the last prompt position (what the engine samples from)
    suffix_logits: Diff  # logits of every suffix position
    top1_agreement: float  # share of suffix positions whose argmax matches exact
    tokens_computed: int  # token-layers the replay ran
    wall_s: float

    def as_dict(self) -> dict[str, object]:
        return {
            "hit_tokens": self.hit,
            "replay_start": self.start,
            "layer_rel_l2": list(self.layer_errors),
            "next_token_logits": self.next_token.as_dict(),
            "suffix_logits": self.suffix_logits.as_dict(),
            "top1_agreement": self.top1_agreement,
            "tokens_computed": self.tokens_computed,
            "wall_s": self.wall_s,
        }


@dataclass(frozen=True)
class ExactRun:
    hit: int
    tokens_computed: int
    wall_s: float
    window: list[torch.Tensor]  # per layer, exact SWA keys+values at [hit-128, hit)
    block_kv: BlockKV
    suffix_logits: torch.Tensor


@dataclass(frozen=True)
class SizeReport:
    hit: int
    exact_tokens: int
    exact_wall_s: float
    replay: ReplayRun  # from s = hit - 128
    baseline: ReplayRun  # no replay: suffix on an empty window
    sweep: tuple[ReplayRun, ...]  # other starts (only for the first size)

    @property
    def token_ratio(self) -> float:
        return self.exact_tokens / self.replay.tokens_computed

    @property
    def wall_ratio(self) -> float:
        return self.exact_wall_s / max(self.replay.wall_s, 1e-9)

    def as_dict(self) -> dict[str, object]:
        return {
            "hit_tokens": self.hit,
            "exact_tokens_computed": self.exact_tokens,
            "exact_wall_s": self.exact_wall_s,
            "token_ratio": self.token_ratio,
            "wall_ratio": self.wall_ratio,
            "replay": self.replay.as_dict(),
            "no_replay": self.baseline.as_dict(),
            "sweep": [run.as_dict() for run in self.sweep],
        }


def exact_prefix(model: V4Model, tokens: torch.Tensor, hit: int) -> ExactRun:
    """Full prefill of ``tokens[:hit]`` (timed), its SWA state and block KV, then the suffix."""
    n_layers = model.config.n_layers

    def prefill() -> list[LayerContext]:
        contexts = fresh_contexts(model)
        model.forward(tokens[:hit], 0, contexts)
        return contexts

    with torch.inference_mode():
        wall, contexts = best_wall(hit * n_layers, prefill)
        window = swa_window(contexts, hit, WINDOW)
        block_kv = block_kv_of(contexts, hit)
        suffix = model.logits(model.forward(tokens[hit:], hit, contexts))
    return ExactRun(hit, hit * n_layers, wall, window, block_kv, suffix)


def bounded_replay(model: V4Model, tokens: torch.Tensor, exact: ExactRun, start: int) -> ReplayRun:
    """Replay ``[start, hit)`` with windows truncated at ``start``, then compute the suffix."""
    hit = exact.hit
    if not 0 <= start <= hit - WINDOW:
        raise ConfigError("start", f"replay start must lie in [0, {hit - WINDOW}], got {start}")

    def replay() -> list[LayerContext]:
        contexts = replay_contexts(model, exact.block_kv, start)
        model.forward(tokens[start:hit], start, contexts, lo=start)
        return contexts

    with torch.inference_mode():
        wall, contexts = best_wall((hit - start) * model.config.n_layers, replay)
        window = swa_window(contexts, hit, WINDOW)
        suffix = model.logits(model.forward(tokens[hit:], hit, contexts, lo=start))
    errors = tuple(diff(got, want).rel_l2 for got, want in zip(window, exact.window, strict=True))
    agree = float((suffix.argmax(-1) == exact.suffix_logits.argmax(-1)).float().mean())
    return ReplayRun(
        hit=hit,
        start=start,
        layer_errors=errors,
        next_token=diff(suffix[-1], exact.suffix_logits[-1]),
        suffix_logits=diff(suffix, exact.suffix_logits),
        top1_agreement=agree,
        tokens_computed=(hit - start) * model.config.n_layers,
        wall_s=wall,
    )


def no_replay(model: V4Model, tokens: torch.Tensor, exact: ExactRun) -> ReplayRun:
    """Baseline: skip the rebuild and compute the suffix on an empty SWA window. Its state
    error is 1 by definition (nothing is there); its logits show what replay buys."""
    hit = exact.hit
    with torch.inference_mode():
        contexts = replay_contexts(model, exact.block_kv, hit, forget_tail=True)
        suffix = model.logits(model.forward(tokens[hit:], hit, contexts, lo=hit))
    agree = float((suffix.argmax(-1) == exact.suffix_logits.argmax(-1)).float().mean())
    return ReplayRun(
        hit=hit,
        start=hit,
        layer_errors=tuple(1.0 for _ in exact.window),
        next_token=diff(suffix[-1], exact.suffix_logits[-1]),
        suffix_logits=diff(suffix, exact.suffix_logits),
        top1_agreement=agree,
        tokens_computed=0,
        wall_s=0.0,
    )


def sweep_starts(hit: int, config: ReplayCheckConfig) -> list[int]:
    """Replay starts for the error-vs-s table: the article's 128 and longer replays, down to
    one that covers every layer's dependency span (which must be exact)."""
    back = [WINDOW, 2 * WINDOW, 4 * WINDOW, config.exact_start_bound]
    return sorted({hit - b for b in back if hit - b >= 0}, reverse=True)


def run_replay(config: ReplayCheckConfig | None = None) -> list[SizeReport]:
    config = config or ReplayCheckConfig()
    model = V4Model(config.model)
    gen = torch.Generator().manual_seed(config.seed + 2)
    reports = []
    for i, hit in enumerate(config.sizes):
        tokens = torch.randint(0, config.model.vocab, (hit + config.suffix,), generator=gen)
        exact = exact_prefix(model, tokens, hit)
        replay = bounded_replay(model, tokens, exact, hit - WINDOW)
        sweep: tuple[ReplayRun, ...] = ()
        if i == 0:
            sweep = tuple(
                bounded_replay(model, tokens, exact, s)
                for s in sweep_starts(hit, config)
                if s != hit - WINDOW
            )
        baseline = no_replay(model, tokens, exact)
        reports.append(
            SizeReport(hit, exact.tokens_computed, exact.wall_s, replay, baseline, sweep)
        )
    return reports


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str

    def as_dict(self) -> dict[str, object]:
        return {"check": self.name, "ok": self.ok, "detail": self.detail}


def replay_checks(reports: list[SizeReport], config: ReplayCheckConfig) -> list[Check]:
    """What must hold; each can fail."""
    tol = TOLERANCES["fp32"].rel_l2
    checks = []
    layer0 = max(r.replay.layer_errors[0] for r in reports)
    checks.append(
        Check("layer 0 rebuilt exactly (input is the embedding)", layer0 <= tol, f"{layer0:.2e}")
    )
    deeper = min(max(r.replay.layer_errors[1:], default=0.0) for r in reports)
    if config.model.n_layers > 1:
        checks.append(
            Check(
                "deeper layers approximate (error measured, not zero)",
                deeper > tol,
                f"smallest worst-layer error {deeper:.2e} vs tolerance {tol:.0e}",
            )
        )
    first = reports[0]
    bound = first.hit - config.exact_start_bound
    far = [run for run in first.sweep if run.start <= bound]
    if far:
        worst = max(max(run.layer_errors) for run in far)
        checks.append(
            Check(
                f"replay from s <= L1-{config.exact_start_bound} exact at every layer",
                worst <= tol,
                f"{worst:.2e}",
            )
        )
    runs = sorted((first.replay, *first.sweep), key=lambda run: -run.start)
    worst_by_start = [max(run.layer_errors) for run in runs]
    monotone = all(b <= a + tol for a, b in zip(worst_by_start, worst_by_start[1:], strict=False))
    checks.append(
        Check(
            "error shrinks as s moves back",
            monotone,
            ", ".join(
                f"s=L1-{first.hit - r.start}: {e:.1e}"
                for r, e in zip(runs, worst_by_start, strict=True)
            ),
        )
    )
    worst_ratio = max(
        r.replay.suffix_logits.rel_l2 / max(r.baseline.suffix_logits.rel_l2, 1e-30) for r in reports
    )
    checks.append(
        Check(
            "replayed state usable: suffix logit error <= half of no-replay's",
            worst_ratio <= 0.5,
            f"worst replay/no-replay error ratio {worst_ratio:.2f}",
        )
    )
    timed = [r for r in reports if r.hit >= 8192]  # below that, fixed overheads dominate
    if timed:
        slowest = min(r.wall_ratio for r in timed)
        checks.append(
            Check(
                "replay faster than exact recompute (prefixes >= 8K)",
                slowest > 1.0,
                f"smallest wall ratio {slowest:.0f}x",
            )
        )
    costs = {r.replay.tokens_computed for r in reports}
    checks.append(
        Check(
            "replay cost constant in prefix length",
            costs == {WINDOW * config.model.n_layers},
            f"token-layers {sorted(costs)}",
        )
    )
    return checks


@dataclass(frozen=True)
class ReplayReport:
    config: ReplayCheckConfig
    sizes: list[SizeReport]
    decoder: list[DecoderRebuild]
    ced: CEDConfig
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    def as_dict(self) -> dict[str, object]:
        return {
            "check": "replay",
            "ok": self.ok,
            "layer_kinds": list(self.config.model.layer_kinds),
            "suffix": self.config.suffix,
            "sizes": [size.as_dict() for size in self.sizes],
            "decoder_side": {
                "encoder_layers": len(self.ced.encoder_kinds),
                "decoder_layers": self.ced.decoder_layers,
                "prompt_len": self.ced.prompt_len,
                "rows": [row.as_dict() for row in self.decoder],
            },
            "checks": [check.as_dict() for check in self.checks],
        }


def decoder_checks(rows: list[DecoderRebuild], ced: CEDConfig) -> list[Check]:
    tol = TOLERANCES["fp32"].rel_l2
    full, exact, bounded = rows
    worst_exact = max(max(exact.layer_errors), exact.next_token.rel_l2)
    saved = exact.decoder_tokens / bounded.decoder_tokens
    return [
        Check(
            f"decoder exact rebuild over {ced.exact_span} tokens is exact",
            worst_exact <= tol,
            f"{worst_exact:.2e}",
        ),
        Check(
            "decoder bounded replay saves a factor of decoder layers",
            bounded.decoder_tokens == WINDOW * ced.decoder_layers and saved == ced.decoder_layers,
            f"{exact.decoder_tokens:,} vs {bounded.decoder_tokens:,} token-layers ({saved:.0f}x)",
        ),
        Check(
            "decoder bounded replay approximate past layer 0 (measured)",
            bounded.layer_errors[0] <= tol
            and (ced.decoder_layers == 1 or max(bounded.layer_errors[1:]) > tol),
            f"layer 0 {bounded.layer_errors[0]:.1e}, worst {max(bounded.layer_errors):.1e}",
        ),
    ]


def run_replay_check(
    config: ReplayCheckConfig | None = None, ced: CEDConfig | None = None
) -> ReplayReport:
    config = config or ReplayCheckConfig()
    ced = ced or CEDConfig()
    sizes = run_replay(config)
    decoder = run_ced(ced)
    checks = replay_checks(sizes, config) + decoder_checks(decoder, ced)
    return ReplayReport(config, sizes, decoder, ced, checks)
