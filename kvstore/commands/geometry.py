"""``kvstore geometry``: print every size derived from a model preset and engine settings."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvstore.commands._output import print_document
from kvstore.errors import ConfigError, InvalidArgument
from kvstore.geometry import EC_DATA_SHARDS, LAYER_KINDS, PRESET_NAMES, GeometryConfig
from kvstore.ledger.layout import (
    COMPRESSION,
    CONSUMER_SWA,
    STORED_SWA,
    StateBlockLayout,
    build_layout,
)

NAME = "geometry"
HELP = "print ring sizes, state_size_to_disk, block bytes and the state block layout of a model"
DESCRIPTION = f"""\
Print the sizes kvstore derives from one model preset and engine configuration (docs/rules.md
§2-§4): SWA inference and store rings, state_size_to_disk, compression rings, block-KV bytes per
128-token block, state-table shapes and the per-sequence state block layout.

presets: {", ".join(PRESET_NAMES)}

example:
  kvstore geometry --preset v4.1-flash --truncation compact --yoco-keep 134 --extra-state --json
"""

#: Config field -> the command-line flag that sets it (errors name the flag the user typed).
_FLAGS = {
    "preset": "--preset",
    "role": "--role",
    "truncation": "--truncation",
    "yoco_keep": "--yoco-keep",
    "extra_state": "--extra-state",
    "max_backtracking": "--max-backtracking",
    "num_state_seqs": "--num-state-seqs",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="v4.1-flash", help="model preset (default v4.1-flash)")
    parser.add_argument(
        "--role",
        default=None,
        help="prefill (PE) or decode (CE); default prefill with --extra-state, else decode",
    )
    parser.add_argument("--truncation", default="off", help="YoCo truncation: off, mask, compact")
    parser.add_argument(
        "--yoco-keep",
        type=int,
        default=None,
        metavar="N",
        help="YOCO_PREFILL_KEEP tokens; required (>= window + backtracking) unless truncation off",
    )
    parser.add_argument(
        "--extra-state",
        action="store_true",
        help="prefill extra-state: keep the longer store ring (PE only)",
    )
    parser.add_argument("--max-backtracking", type=int, default=6, metavar="N")
    parser.add_argument("--num-state-seqs", type=int, default=64, metavar="S")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--regions",
        action="store_true",
        help="also list every region of the state block layout (offset and bytes per layer)",
    )


def config_from_args(args: argparse.Namespace) -> GeometryConfig:
    role = args.role if args.role is not None else ("prefill" if args.extra_state else "decode")
    try:
        return GeometryConfig(
            preset=args.preset,
            role=role,
            truncation=args.truncation,
            yoco_keep=args.yoco_keep,
            extra_state=args.extra_state,
            max_backtracking=args.max_backtracking,
            num_state_seqs=args.num_state_seqs,
        )
    except ConfigError as error:
        flag = _FLAGS.get(error.field, error.field)
        message = str(error).removeprefix(f"{error.field}: ")
        raise InvalidArgument(flag, message) from error


REGION_COLUMNS = ["name", "group", "layer", "offset", "nbytes"]


def _layout_dict(layout: StateBlockLayout, regions: bool) -> dict[str, Any]:
    data = layout.to_dict()
    rows = data.pop("regions")
    data["region_count"] = len(rows)
    if regions:
        data["region_columns"] = REGION_COLUMNS
        data["regions"] = [[row[column] for column in REGION_COLUMNS] for row in rows]
    return data


def report(geometry: GeometryConfig, regions: bool = False) -> dict[str, Any]:
    """Everything the command prints, as one JSON-ready mapping."""
    data = geometry.summary()
    data["layout"] = _layout_dict(build_layout(geometry), regions)
    if geometry.store_ring != geometry.inference_ring:
        data["inference_layout"] = _layout_dict(build_layout(geometry.for_decode()), regions)
    return data


def run(args: argparse.Namespace) -> int:
    geometry = config_from_args(args)
    data = report(geometry, regions=args.regions)
    if args.json:
        print_document(dumps(data))
    else:
        print(render(geometry, data, regions=args.regions))
    return 0


def dumps(value: Any, indent: int = 0) -> str:
    """JSON with short containers (and every list of plain values) kept on one line."""
    flat = json.dumps(value)
    plain_list = isinstance(value, list) and not any(isinstance(v, dict | list) for v in value)
    if not isinstance(value, dict | list) or plain_list or indent + len(flat) <= 96:
        return flat
    pad, inner = " " * indent, " " * (indent + 2)
    if isinstance(value, list):
        items = [inner + dumps(item, indent + 2) for item in value]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    items = [f"{inner}{json.dumps(key)}: {dumps(item, indent + 2)}" for key, item in value.items()]
    return "{\n" + ",\n".join(items) + "\n" + pad + "}"


# --- the readable table -------------------------------------------------------------------------


def _n(value: int) -> str:
    return f"{value:,}"


def _layers(layers: list[int]) -> str:
    if not layers:
        return "none"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]} ({len(layers)})"
    return f"{', '.join(map(str, layers))} ({len(layers)})"


def _shape(shape: list[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def render(geometry: GeometryConfig, data: dict[str, Any], regions: bool = False) -> str:
    g = geometry
    counts = data["layer_kind_counts"]
    keep = g.yoco_keep if g.yoco_keep is not None else "-"
    lines = [
        f"model        {g.preset}: {g.model.description}",
        f"engine       role {g.role}, truncation {g.truncation}, yoco_keep {keep}, "
        f"extra_state {'on' if g.extra_state else 'off'}",
        f"layers       {g.num_layers}: "
        + ", ".join(f"{counts[kind]} {kind}" for kind in ("swa", "csa", "hca")),
        f"  SWA stored       layers {_layers(data['stored_swa_layers'])}",
        f"  SWA YoCo dropped layers {_layers(data['consumer_swa_layers'])}",
        "",
        "SWA rings (slots per layer)",
        f"  inference_ring      {g.inference_ring:>11}   window {g.window} + backtracking "
        f"{g.max_backtracking}",
    ]
    if g.extra_state:
        how = (
            f"{g.inference_ring} + prefill extra {g.prefill_store_extra} + yoco keep "
            f"{g.yoco_store_extra}"
        )
    else:
        how = "= inference ring (no extra-state)"
    lines += [
        f"  store_ring          {g.store_ring:>11}   {how}",
        f"  state_size_to_disk  {_n(g.state_size_to_disk):>11}   B/seq = "
        f"{len(g.stored_swa_layers)} layers x {g.inference_ring} x {g.swa_bytes_per_token} B",
        "",
        "compression rings (slots)",
    ]
    for kind, ring in data["compression_rings"].items():
        spec = LAYER_KINDS[kind]
        windows = "2 x " if spec.overlapping_windows else ""
        formula = f"{windows}{spec.compress_ratio} + backtracking {g.max_backtracking}"
        lines.append(f"  {kind}                 {ring:>11}   {formula}")
    lines += [
        "",
        f"block KV per {g.block_tokens}-token block",
        f"  block_bytes         {_n(g.block_bytes):>11}   B = {g.block_bytes / 1024:.1f} KiB, "
        f"{g.block_bytes_per_token:.1f} B/token",
        f"  10+2 data shard     {_n(data['ec_data_shard_bytes']):>11}   B "
        f"(block / {EC_DATA_SHARDS}, rounded up)",
        "",
        f"state tables (first dimension = num_state_seqs {g.num_state_seqs})",
    ]
    for name, table in data["state_tables"].items():
        lines.append(
            f"  {name:<22} {_shape(table['shape']):<22} {table['dtype']:<8} "
            f"x {table['layers']} layers"
        )
    lines += ["", *_render_layout("state block layout (this engine)", data["layout"])]
    if "inference_layout" in data:
        lines += [
            "",
            *_render_layout(
                "state block layout after PE->CE re-order (decode engine)",
                data["inference_layout"],
            ),
        ]
    if regions:
        lines += ["", "regions of this engine's state block"]
        lines.append(f"  {'name':<28} {'group':<13} {'layer':>5} {'offset':>12} {'bytes':>10}")
        for name, group, layer, offset, nbytes in data["layout"]["regions"]:
            lines.append(f"  {name:<28} {group:<13} {layer:>5} {_n(offset):>12} {_n(nbytes):>10}")
    return "\n".join(lines)


def _render_layout(title: str, layout: dict[str, Any]) -> list[str]:
    labels = {
        STORED_SWA: "stored SWA",
        CONSUMER_SWA: "dropped: YoCo consumer SWA",
        COMPRESSION: "dropped: fp32 compression",
    }
    lines = [
        f"{title}, SWA rings of {layout['swa_ring']} slots",
        f"  {'region':<28} {'regions':>7} {'offset':>12} {'bytes':>12}",
    ]
    for group, label in labels.items():
        span = layout["groups"][group]
        members = span["regions"]
        lines.append(
            f"  {label:<28} {members:>7} {_n(span['offset']):>12} {_n(span['nbytes']):>12}"
        )
    lines.append(f"  {'total':<28} {'':>7} {'':>12} {_n(layout['total_bytes']):>12}")
    if layout["swa_ring"] == layout["inference_ring"]:
        lines.append(
            f"  persisted: the first {_n(layout['state_size_to_disk'])} bytes (= the stored region)"
        )
    else:
        lines.append("  persisted: nothing as-is; re-order to the decode layout first")
    return lines
