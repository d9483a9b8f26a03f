"""``kvstore verify {yoco,replay}``: the article's claims as executable checks (docs/rules.md §9).

torch is imported only when a check runs, so ``kvstore --help`` and every other command stay
torch-free.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvstore.commands._output import print_document
from kvstore.errors import ConfigError, InvalidArgument

NAME = "verify"
HELP = "run the YoCo (mask vs compact) and bounded-replay checks on a small V4-style model"
DESCRIPTION = """\
Executable checks of docs/rules.md §9 on a small DeepSeek-V4-style torch model (128-token SWA in
every layer, CSA 4:1 with a top-k indexer, HCA 128:1), deterministic random weights, CPU.

  yoco    truncation mask vs compact on the same inputs and weights, fp32 and bf16, against a
          stated tolerance; a deliberately broken compact must be caught; preemption with
          truncation off (recompute identical) and on (recompute may differ)
  replay  bounded replay from s = L1-128: per-layer state error, error vs s, next-token logits,
          cost vs exact recompute at 8K/32K/128K; decoder-side replay on an encoder/decoder split

Exit status: 0 when every check holds, 1 when one fails, 2 on bad arguments.

examples:
  kvstore verify yoco
  kvstore verify replay --sizes 8192,32768,131072 --json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    checks = parser.add_subparsers(dest="check", metavar="CHECK", parser_class=type(parser))
    checks.required = True
    yoco = checks.add_parser("yoco", help="mask vs compact truncation; preemption under truncation")
    yoco.add_argument("--prompt-len", type=int, default=1536, metavar="N")
    yoco.add_argument("--chunk", type=int, default=256, metavar="N", help="prefill chunk")
    yoco.add_argument("--decode-steps", type=int, default=24, metavar="N")
    yoco.add_argument("--keep", type=int, default=134, metavar="N", help="YOCO_PREFILL_KEEP")
    yoco.add_argument("--layers", type=int, default=6, metavar="N")
    yoco.add_argument("--seed", type=int, default=0)
    yoco.add_argument(
        "--inject-off-by-one",
        action="store_true",
        help="use the broken compact in the main comparison (the check must fail, exit 1)",
    )
    yoco.add_argument("--json", action="store_true", help="print JSON instead of tables")
    replay = checks.add_parser("replay", help="bounded replay error and cost; decoder-side replay")
    replay.add_argument(
        "--sizes",
        default="8192,32768,131072",
        metavar="L1,...",
        help="prefix hit lengths, comma separated, multiples of 128 (default 8K,32K,128K)",
    )
    replay.add_argument("--layers", type=int, default=6, metavar="N")
    replay.add_argument("--suffix", type=int, default=134, metavar="N", help="tokens after L1")
    replay.add_argument("--ced-prompt", type=int, default=4096, metavar="N")
    replay.add_argument("--ced-encoder-layers", type=int, default=20, metavar="N")
    replay.add_argument("--ced-decoder-layers", type=int, default=20, metavar="N")
    replay.add_argument("--seed", type=int, default=0)
    replay.add_argument("--json", action="store_true", help="print JSON instead of tables")


_FLAGS = {
    "prompt_len": "--prompt-len",
    "chunk": "--chunk",
    "decode_steps": "--decode-steps",
    "keep": "--keep",
    "layers": "--layers",
    "sizes": "--sizes",
    "suffix": "--suffix",
    "decoder_layers": "--ced-decoder-layers",
}


def _as_argument(error: ConfigError, default_flag: str) -> InvalidArgument:
    flag = _FLAGS.get(error.field, default_flag)
    return InvalidArgument(flag, str(error).removeprefix(f"{error.field}: "))


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise InvalidArgument(
            "--sizes", f"not a comma-separated list of integers: {text!r}"
        ) from error
    if not sizes:
        raise InvalidArgument("--sizes", "needs at least one size")
    return sizes


def run(args: argparse.Namespace) -> int:
    # Imported here: torch is heavy and only this command needs it.
    from kvstore.verify.model import ModelConfig, torch_settings, v4_layer_kinds
    from kvstore.verify.report import render_replay, render_yoco

    report: Any
    try:
        kinds = v4_layer_kinds(args.layers)
        if args.check == "yoco":
            from kvstore.verify.yoco import YocoCheckConfig, run_yoco

            yoco_config = YocoCheckConfig(
                prompt_len=args.prompt_len,
                decode_steps=args.decode_steps,
                chunk=args.chunk,
                keep=args.keep,
                seed=args.seed,
                model=ModelConfig(layer_kinds=kinds, seed=args.seed),
                inject_off_by_one=args.inject_off_by_one,
            )
            with torch_settings():
                report = run_yoco(yoco_config)
            text = render_yoco(report)
        else:
            from kvstore.verify.ced import CEDConfig
            from kvstore.verify.replay import ReplayCheckConfig, run_replay_check

            if args.ced_encoder_layers < 1:
                raise InvalidArgument("--ced-encoder-layers", "must be >= 1")
            replay_config = ReplayCheckConfig(
                sizes=_sizes(args.sizes),
                suffix=args.suffix,
                seed=args.seed,
                model=ModelConfig(layer_kinds=kinds, seed=args.seed),
            )
            try:
                ced = CEDConfig(
                    encoder_kinds=v4_layer_kinds(args.ced_encoder_layers),
                    decoder_layers=args.ced_decoder_layers,
                    prompt_len=args.ced_prompt,
                    seed=args.seed,
                )
            except ConfigError as error:
                flag = "--ced-prompt" if error.field == "prompt_len" else "--ced-decoder-layers"
                raise InvalidArgument(flag, str(error).removeprefix(f"{error.field}: ")) from error
            with torch_settings():
                report = run_replay_check(replay_config, ced)
            text = render_replay(report)
    except ConfigError as error:
        raise _as_argument(error, "--" + error.field.replace("_", "-")) from error
    if args.json:
        print_document(json.dumps(report.as_dict(), indent=2))
    else:
        print(text)
    return 0 if report.ok else 1
