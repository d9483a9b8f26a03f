"""``kvstore plan``: what the docs/rules.md §5 hit rule does with one prompt, and why."""

from __future__ import annotations

import argparse
import json
import sys

from kvstore import hitplan
from kvstore.commands._output import print_document
from kvstore.errors import InvalidArgument

NAME = "plan"
HELP = (
    "plan the prefix hit of one prompt "
    "(docs/rules.md §5: cap L−134, block hit, SWA check, back-off)"
)
DESCRIPTION = """\
Apply the prefix hit rule to one prompt and say what the engine reuses and computes.

  cap  = L − (window + backtracking) = L − 134     the last 134 tokens are always computed
  L1   = cached block run, whole blocks within the cap
  SWA  looked for only at L1 (the snapshot of [L1 − 128, L1])
  standard:        found → hit L1; missing → hit L1 − 128 (back off one block, recompute it)
  bounded-replay:  hit L1; missing → replay [L1 − 128, L1) to rebuild SWA only
  full-attention:  no window (a dense model): cap L − 1, no SWA lookup, hit L1

example:
  kvstore plan --prompt-len 1300 --block-hit-tokens 1280 --swa-at 1024
"""

# Python argument names in hitplan's errors → the flags a user typed.
_FLAGS = {
    "prompt_len": "--prompt-len",
    "block_hit_tokens": "--block-hit-tokens",
    "mode": "--mode",
    "window": "--window",
    "max_backtracking": "--max-backtracking",
}


def _swa_at(text: str) -> tuple[int, str | None]:
    """``P`` or ``P@MACHINE``: an SWA state exists at position P (held by MACHINE)."""
    position_text, _, machine = text.partition("@")
    try:
        position = int(position_text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected P or P@MACHINE, got {text!r}") from None
    if position < 0:
        raise argparse.ArgumentTypeError(f"position must be ≥ 0, got {position}")
    return position, machine or None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompt-len", type=int, required=True, metavar="L", help="prompt length in tokens"
    )
    parser.add_argument(
        "--block-hit-tokens",
        type=int,
        required=True,
        metavar="B",
        help="leading run of cached blocks in tokens (a multiple of 128; may exceed the cap)",
    )
    parser.add_argument(
        "--swa-at",
        type=_swa_at,
        action="extend",
        nargs="+",
        default=[],
        metavar="P[@MACHINE]",
        help="an SWA state exists at position P (repeatable; only L1 is looked up)",
    )
    parser.add_argument(
        "--mode",
        choices=hitplan.MODES,
        default=hitplan.STANDARD,
        help="hit rule (default: %(default)s)",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=hitplan.DEFAULT_WINDOW,
        help="SWA window (default: %(default)s)",
    )
    parser.add_argument(
        "--max-backtracking",
        type=int,
        default=hitplan.DEFAULT_MAX_BACKTRACKING,
        help="speculative rollback tokens (default: %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def run(args: argparse.Namespace) -> int:
    swa = {position: machine or "" for position, machine in args.swa_at}
    try:
        plan = hitplan.plan_hit(
            args.prompt_len,
            args.block_hit_tokens,
            swa,
            mode=args.mode,
            window=args.window,
            max_backtracking=args.max_backtracking,
        )
    except InvalidArgument as error:
        flag = _FLAGS.get(error.argument)
        if flag is None:
            raise
        raise InvalidArgument(flag, str(error).split(": ", 1)[1]) from None
    if args.json:
        print_document(json.dumps(plan.to_dict(), sort_keys=True))
        return 0
    ignored = sorted(p for p in swa if p != plan.swa_position)
    sys.stdout.write(render(plan, ignored))
    return 0


def render(plan: hitplan.HitPlan, ignored_swa: list[int]) -> str:
    """The human-readable table."""

    def show(value: object) -> str:
        return "—" if value is None else str(value)

    if plan.mode == hitplan.FULL_ATTENTION:
        swa = "not looked up (full attention: no window state)"
    elif plan.swa_position is None:
        swa = "not looked up (L1 = 0)"
    elif plan.swa_hit:
        swa = f"{plan.swa_position}: found" + (
            f" on {plan.swa_location}" if plan.swa_location else ""
        )
    else:
        swa = f"{plan.swa_position}: missing"
    replay = "—"
    if plan.replay_start is not None:
        end = plan.replay_start + plan.replay_tokens
        replay = f"[{plan.replay_start}, {end}) ({plan.replay_tokens} tokens, SWA only)"
    protected = plan.protected_tokens
    rows = [
        ("prompt tokens (L)", str(plan.prompt_len)),
        ("mode", plan.mode),
        (f"cap (L − {protected})", str(plan.cap)),
        ("cached block run", show(plan.block_run_tokens)),
        ("block hit (L1)", str(plan.block_hit_tokens)),
        ("SWA state", swa),
        ("hit tokens", str(plan.hit_tokens)),
        ("replay", replay),
        ("compute from", f"{plan.compute_from} ({plan.compute_tokens} tokens)"),
        ("store at", show(plan.store_at)),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {value}" for label, value in rows]
    lines.append(f"why: {plan.reason}")
    if ignored_swa:
        lines.append(
            "note: SWA at "
            + ", ".join(str(p) for p in ignored_swa)
            + " ignored (only the state at L1 is looked up)"
        )
    return "\n".join(lines) + "\n"
