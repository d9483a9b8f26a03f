"""Plain-text tables for the verify checks (no torch needed to print); the error measures are
``kvstore.verify.measures``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.verify.replay import ReplayReport
    from kvstore.verify.yoco import YocoReport


def sci(value: float) -> str:
    return f"{value:.2e}"


def render_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A fixed-width table: title line, header, rule, rows (numbers right-aligned)."""
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(values: Sequence[str], numeric: Sequence[bool]) -> str:
        parts = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    numeric_cols = [
        all(_looks_numeric(row[i]) for row in cells) if cells else False
        for i in range(len(headers))
    ]
    out = [title, line(list(headers), numeric_cols)]
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(row, numeric_cols) for row in cells)
    return "\n".join(out)


def _looks_numeric(text: str) -> bool:
    cleaned = text.replace(",", "").replace("x", "").replace("%", "").replace("s", "")
    try:
        float(cleaned)
    except ValueError:
        return False
    return True


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def render_yoco(report: YocoReport) -> str:
    from kvstore.verify.yoco import TOLERANCES

    c = report.config
    kinds = " ".join(c.model.layer_kinds)
    rows = [
        [
            row.dtype,
            row.compared,
            sci(row.diff.rel_l2),
            sci(row.diff.max_abs),
            f"{row.tolerance.rel_l2:.0e} / {row.tolerance.max_abs:g}",
            f"{row.diff.rel_l2 / row.tolerance.rel_l2:.2g}",
            "same" if row.expect_same else "differ",
            "same" if row.same else "differ",
            row.rows_held,
            _verdict(row.ok),
        ]
        for row in report.rows
    ]
    table = render_table(
        f"YoCo truncation, mask vs compact: prompt {c.prompt_len}, chunk {c.chunk}, "
        f"keep {c.keep}, {c.decode_steps} decode steps, layers [{kinds}]",
        [
            "dtype",
            "compared",
            "rel L2",
            "max |d|",
            "tolerance (rel / abs)",
            "rel L2 / tol",
            "expect",
            "outcome",
            "SWA rows (mask vs compact)",
            "check",
        ],
        rows,
    )
    notes = ["tolerances:"]
    for name, tol in TOLERANCES.items():
        notes.append(
            f"  {name}: rel L2 <= {tol.rel_l2:.0e}, max |d| <= {tol.max_abs:g} ({tol.why})"
        )
    pre_rows = [
        [
            row.outcome.truncation,
            str(row.outcome.resumed_from),
            sci(row.outcome.logits.rel_l2),
            sci(row.outcome.logits.max_abs),
            _yes(row.outcome.same_tokens),
            "same" if row.expect_same else "may differ",
            _verdict(row.ok),
        ]
        for row in report.preemption
    ]
    pre = render_table(
        "Preemption under truncation (fp32): recompute after preemption vs uninterrupted decode",
        [
            "truncation",
            "recomputed from",
            "logits rel L2",
            "max |d|",
            "same tokens",
            "expect",
            "check",
        ],
        pre_rows,
    )
    verdict = f"yoco: {_verdict(report.ok)}"
    return "\n".join([table, *notes, "", pre, "", verdict])


def render_replay(report: ReplayReport) -> str:
    cfg = report.config
    kinds = " ".join(cfg.model.layer_kinds)
    cost_rows = []
    for size in report.sizes:
        r = size.replay
        cost_rows.append(
            [
                f"{size.hit:,}",
                f"{size.exact_tokens:,}",
                f"{r.tokens_computed:,}",
                f"{size.token_ratio:,.0f}x",
                f"{size.exact_wall_s:.2f}",
                f"{r.wall_s:.3f}",
                f"{size.wall_ratio:,.0f}x",
                sci(r.next_token.rel_l2),
                sci(r.suffix_logits.rel_l2),
                f"{r.top1_agreement:.0%}",
                sci(size.baseline.suffix_logits.rel_l2),
                f"{size.baseline.top1_agreement:.0%}",
            ]
        )
    cost = render_table(
        "Bounded replay from s = L1-128 vs exact recompute (full prefill of L1): "
        f"layers [{kinds}], suffix {cfg.suffix} tokens",
        [
            "prefix L1",
            "exact tok-layers",
            "replay tok-layers",
            "tok ratio",
            "exact s",
            "replay s",
            "wall ratio",
            "next-tok rel L2",
            "suffix rel L2",
            "top-1 agree",
            "no-replay suffix rel L2",
            "no-replay top-1",
        ],
        cost_rows,
    )
    depth_rows = []
    for i, kind in enumerate(cfg.model.layer_kinds):
        depth_rows.append(
            [str(i), kind, *(sci(size.replay.layer_errors[i]) for size in report.sizes)]
        )
    depth = render_table(
        "Rebuilt SWA state error vs depth: rel L2 of keys+values at [L1-128, L1), s = L1-128",
        ["layer", "kind", *(f"L1={size.hit:,}" for size in report.sizes)],
        depth_rows,
    )
    first = report.sizes[0]
    runs = sorted((first.replay, *first.sweep), key=lambda run: -run.start)
    s_rows = [
        [
            f"L1-{first.hit - run.start}",
            f"{run.tokens_computed:,}",
            *(sci(e) for e in run.layer_errors),
            sci(run.next_token.rel_l2),
            f"{run.top1_agreement:.0%}",
        ]
        for run in runs
    ]
    by_s = render_table(
        f"Rebuilt SWA state error vs replay start s (L1 = {first.hit:,}), rel L2 per layer",
        [
            "s",
            "tok-layers",
            *(f"layer {i}" for i in range(cfg.model.n_layers)),
            "next-tok",
            "top-1",
        ],
        s_rows,
    )
    ced = report.ced
    dec_rows = [
        [
            row.method,
            str(row.start),
            f"{row.decoder_tokens:,}",
            f"{row.prefill_tokens:,}",
            f"{row.prefill_tokens / report.decoder[0].prefill_tokens:.2f}",
            f"{row.wall_s:.2f}",
            sci(max(row.layer_errors)),
            sci(row.layer_errors[-1]),
            sci(row.next_token.rel_l2),
            _yes(row.same_top1),
        ]
        for row in report.decoder
    ]
    dec = render_table(
        f"Decoder-side replay (CED: {len(ced.encoder_kinds)} encoder + {ced.decoder_layers} "
        f"decoder layers, prompt {ced.prompt_len}; decoder global KV projected from the encoder)",
        [
            "method",
            "decoder start",
            "decoder tok-layers",
            "prefill tok-layers",
            "vs full",
            "decoder s",
            "worst layer rel L2",
            "last layer",
            "next-tok rel L2",
            "same top-1",
        ],
        dec_rows,
    )
    check_lines = ["checks:"] + [
        f"  {_verdict(check.ok)}  {check.name}: {check.detail}" for check in report.checks
    ]
    verdict = f"replay: {_verdict(report.ok)}"
    return "\n\n".join([cost, depth, by_s, dec, "\n".join(check_lines), verdict])
