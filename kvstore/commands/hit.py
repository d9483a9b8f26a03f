"""`kvstore hit`: ask a running kvstore how much of a prompt is cached (QueryHit)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import grpc
import numpy as np

from kvstore.commands._client import add_client_arguments, connect, print_json, rpc_error
from kvstore.errors import InvalidArgument
from kvstore.tier.records import HitRequest

NAME = "hit"
HELP = "ask a running kvstore how much of a prompt is cached (QueryHit)"
DESCRIPTION = """Send a prompt's token ids to a running gateway and print the docs/rules.md §5 hit
plan: hit tokens, the block-store hit, whether the SWA state was found and on which machine,
fetch-or-replay advice, and the first token the engine must compute.

The prompt comes from --tokens-file (a JSON list, a .npy array, or whitespace-separated
integers) or, to try things out, --random N --seed S (N random token ids).

  kvstore hit --tokens-file prompt.json --class chatbot
  kvstore hit --random 40000 --seed 1 --mode bounded-replay --json"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokens-file", type=Path, help="token ids: .json list, .npy, or text")
    source.add_argument("--random", type=int, metavar="N", help="use N random token ids")
    parser.add_argument("--seed", type=int, default=0, help="seed for --random (default 0)")
    parser.add_argument(
        "--mode", choices=["standard", "bounded-replay"], default="standard", help="hit rule mode"
    )
    parser.add_argument("--class", dest="traffic_class", default="", help="traffic class")
    parser.add_argument(
        "--no-lease", action="store_true", help="do not lease the hit blocks (a pure query)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON")


def read_tokens(path: Path) -> np.ndarray:
    try:
        if path.suffix == ".npy":
            tokens = np.load(path)
        elif path.suffix == ".json":
            tokens = np.asarray(json.loads(path.read_text()))
        else:
            tokens = np.asarray(path.read_text().split(), dtype=np.int64)
    except (OSError, ValueError) as error:
        raise InvalidArgument(
            "--tokens-file", f"cannot read token ids from {path}: {error}"
        ) from None
    if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
        raise InvalidArgument("--tokens-file", f"{path} must hold a flat list of integers")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**32):
        raise InvalidArgument("--tokens-file", f"{path}: token ids must lie in [0, 2^32)")
    return tokens.astype(np.uint32)


def run(args: argparse.Namespace) -> int:
    if args.random is not None:
        if args.random < 0:
            raise InvalidArgument("--random", f"must be ≥ 0, got {args.random}")
        tokens = np.random.default_rng(args.seed).integers(0, 128_000, args.random, dtype=np.uint32)
    else:
        tokens = read_tokens(args.tokens_file)
    with connect(args) as client:
        try:
            answer = client.query_hit(
                HitRequest(
                    token_ids=tokens.tolist(),
                    mode=args.mode,
                    traffic_class=args.traffic_class,
                    take_lease=not args.no_lease,
                )
            )
        except grpc.RpcError as error:
            raise rpc_error(error, args.server) from None
        plan = answer.plan
        figures = {
            **plan.to_dict(),
            "swa_owner": answer.swa_owner,
            "advice": answer.advice,
            "fetch_seconds": answer.fetch_seconds,
            "replay_seconds": answer.replay_seconds,
            "lease_id": answer.lease_id,
        }
    if args.json:
        print_json(figures)
        return 0
    print(f"prompt            {plan.prompt_len} tokens ({args.mode})")
    print(f"cap (L-134)       {plan.cap}")
    print(f"block-store hit   {plan.block_hit_tokens} tokens")
    where = f" on {answer.swa_owner}" if answer.swa_owner else ""
    print(f"SWA state         {'found' + where if plan.swa_hit else 'missing'}")
    print(f"hit               {plan.hit_tokens} tokens")
    if plan.replay_tokens:
        print(f"replay            {plan.replay_tokens} tokens from {plan.replay_start}")
    print(f"compute from      token {plan.compute_from}")
    if answer.advice:
        print(
            f"advice            {answer.advice} (fetch ≈ {answer.fetch_seconds * 1e3:.2f} ms, "
            f"replay ≈ {answer.replay_seconds * 1e3:.2f} ms)"
        )
    if answer.lease_id:
        print(f"lease             {answer.lease_id}")
    return 0
