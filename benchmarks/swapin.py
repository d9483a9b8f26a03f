"""Layer-wise swap-in: how much of the staging → pools copy hides behind per-layer compute.

    python3 benchmarks/swapin.py                 # CPU, and CUDA when a GPU is present
    python3 benchmarks/swapin.py --json --device cpu --blocks 512 --runs 7

A V4.1-Flash hit of ``--blocks`` blocks sits in a /dev/shm staging area (as the fetcher leaves
it); the real ``SwapIn`` (the engine side's one load mechanism, the one vLLM's loads use) copies
it layer by layer into an engine's cache: one ``[blocks, layer bytes]`` tensor per block-KV layer
(V4.1-Flash: layers 2..19), the block table a random permutation. The
"model" is a toy per-layer compute (one matmul per layer, ``[rows_i, 256] @ [256, 256]``, like a
layer's one big kernel), with rows_i calibrated so layer i's compute takes about as long as
layer i's copy. Four timings, medians of ``--runs`` rounds (the
four are interleaved in each round so they share the machine's noise):

- copy-only: the whole swap-in, nothing else running;
- compute-only: the layer loop, nothing loaded;
- serial: swap-in to the end, then the layer loop (no overlap);
- overlapped: swap-in started, then for each layer ``load.wait(i)`` and layer i's compute.

overlap efficiency = (serial − overlapped) / min(copy, compute): 1.0 means the shorter of the two
is completely hidden, 0 means no overlap at all. Target on CPU: ≥ 0.80. torch compute uses one
thread (``torch.set_num_threads(1)``): this machine has 2 shared cores, one for the compute, one
for the copy thread. On CUDA the copy is host → device from the registered (pinned) staging area
on a side stream, and the table also gives its GB/s against a plain pinned → device copy of the
same bytes (the pinned-memory peak).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.engine.kvlayout import KVLayout  # noqa: E402
from kvstore.engine.staging import PreparedStage, StageLayout, StagingArea  # noqa: E402
from kvstore.geometry import GeometryConfig  # noqa: E402

TARGET_CPU = 0.80
WIDTH = 256  # the toy compute is one [rows, WIDTH] @ [WIDTH, WIDTH] matmul per layer
CALIBRATION_ROWS = 4096


def _torch() -> Any:
    import torch

    return torch


class Bench:
    """One device: pools, swap-in, a staging area and the calibrated toy compute."""

    def __init__(self, device: str, blocks: int) -> None:
        torch = _torch()
        from kvstore.engine.rows import KVRows, as_ids
        from kvstore.engine.swapin import LoadTarget, SwapIn

        self.torch = torch
        self.device = device
        self.cuda = device.startswith("cuda")
        model = KVLayout.from_geometry(GeometryConfig(num_state_seqs=2))
        self.cache = [
            torch.zeros((blocks, item.block_nbytes), dtype=torch.uint8, device=device)
            for item in model.layers
            if item.block_nbytes
        ]
        engine_rows = KVRows.of(self.cache, None)
        self.kv = engine_rows.kv
        self.layout = StageLayout.plan(self.kv, blocks, with_state=False)
        self.area = StagingArea(self.layout.total_bytes + (1 << 20))
        self.swapin = SwapIn(engine_rows, area=self.area)
        ids = np.random.default_rng(0).permutation(blocks)  # a scattered block table
        self.target = LoadTarget("bench", as_ids(ids))
        self.payload = np.random.default_rng(1).integers(
            0, 256, self.layout.total_bytes - self.layout.header_bytes, dtype=np.uint8
        )
        self.bytes_per_layer = np.array(
            [blocks * item.block_nbytes + item.state_nbytes for item in self.kv.layers]
        )
        self.x = torch.rand(CALIBRATION_ROWS, WIDTH, device=device)
        self.w = torch.rand(WIDTH, WIDTH, device=device)
        self.rows = np.zeros(self.kv.num_layers, dtype=np.int64)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def stage(self) -> PreparedStage:
        stage = PreparedStage(self.area, self.layout)
        stage.region()[self.layout.header_bytes :] = self.payload
        return stage

    def layer_compute(self, layer: int) -> None:
        rows = int(self.rows[layer])
        if rows:
            self.torch.mm(self.x[:rows], self.w)

    # the four timings ------------------------------------------------------------------------

    def copy_only(self) -> float:
        stage = self.stage()
        self.sync()
        start = time.perf_counter()
        self.swapin.submit(stage, self.target).result(timeout=120)
        self.sync()
        return time.perf_counter() - start

    def compute_only(self) -> float:
        self.sync()
        start = time.perf_counter()
        for layer in range(self.kv.num_layers):
            self.layer_compute(layer)
        self.sync()
        return time.perf_counter() - start

    def serial(self) -> float:
        stage = self.stage()
        self.sync()
        start = time.perf_counter()
        self.swapin.submit(stage, self.target).result(timeout=120)
        for layer in range(self.kv.num_layers):
            self.layer_compute(layer)
        self.sync()
        return time.perf_counter() - start

    def overlapped(self) -> float:
        stage = self.stage()
        self.sync()
        start = time.perf_counter()
        load = self.swapin.submit(stage, self.target)
        for layer in range(self.kv.num_layers):
            load.wait(layer, timeout=120)
            self.layer_compute(layer)
        load.result(timeout=120)
        self.sync()
        return time.perf_counter() - start

    # calibration -----------------------------------------------------------------------------

    def calibrate(self, runs: int) -> None:
        """Size layer i's compute to layer i's share of the measured copy time."""
        copy = statistics.median(self.copy_only() for _ in range(max(runs, 3)))
        self.rows[:] = CALIBRATION_ROWS
        samples = []
        for _ in range(7):
            self.sync()
            start = time.perf_counter()
            self.layer_compute(0)
            self.sync()
            samples.append((time.perf_counter() - start) / CALIBRATION_ROWS)
        per_row = statistics.median(samples)
        share = copy * self.bytes_per_layer / self.bytes_per_layer.sum()
        self._set_rows(share / per_row)
        # A matmul's time per row depends on its size (caches): measure the real layer loop and
        # rescale until it matches the copy.
        for _ in range(2):
            compute = statistics.median(self.compute_only() for _ in range(3))
            self._set_rows(self.rows * (copy / compute))

    def _set_rows(self, rows: np.ndarray) -> None:
        rows = np.rint(np.asarray(rows, dtype=np.float64)).astype(np.int64)
        rows[self.bytes_per_layer == 0] = 0
        if rows.max() > self.x.shape[0]:  # a slow compute device: grow the input
            self.x = self.torch.rand(int(rows.max()), WIDTH, device=self.device)
        self.rows = rows

    def h2d_peak(self, runs: int) -> tuple[float, float]:
        """(pinned → device GB/s for the same bytes, swap-in GB/s) on CUDA."""
        torch = self.torch
        nbytes = int(self.bytes_per_layer.sum())
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        device = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        samples = []
        for _ in range(max(runs, 3)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            device.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            samples.append(time.perf_counter() - start)
        peak = nbytes / statistics.median(samples) / 1e9
        swap = nbytes / statistics.median(self.copy_only() for _ in range(max(runs, 3))) / 1e9
        return peak, swap

    def close(self) -> None:
        self.swapin.close()
        self.area.close()


def run_device(device: str, blocks: int, runs: int) -> dict[str, Any]:
    bench = Bench(device, blocks)
    try:
        bench.copy_only()  # warm up: first-touch pages, thread start, allocator
        bench.calibrate(runs)
        timings: dict[str, list[float]] = {k: [] for k in ("copy", "compute", "serial", "overlap")}
        order: list[tuple[str, Callable[[], float]]] = [
            ("copy", bench.copy_only),
            ("compute", bench.compute_only),
            ("serial", bench.serial),
            ("overlap", bench.overlapped),
        ]
        for _ in range(runs):
            for name, measure in order:
                timings[name].append(measure())
        median = {name: statistics.median(values) for name, values in timings.items()}
        efficiency = (median["serial"] - median["overlap"]) / min(median["copy"], median["compute"])
        row: dict[str, Any] = {
            "device": device,
            "blocks": blocks,
            "tokens": blocks * 128,
            "mib_copied": float(bench.bytes_per_layer.sum()) / 2**20,
            "layers": bench.kv.num_layers,
            "layers_with_data": int((bench.bytes_per_layer > 0).sum()),
            "copy_ms": median["copy"] * 1e3,
            "compute_ms": median["compute"] * 1e3,
            "serial_ms": median["serial"] * 1e3,
            "overlapped_ms": median["overlap"] * 1e3,
            "overlap_efficiency": efficiency,
            "runs": runs,
            # Overlap needs a free core for the copy thread: read the result with the load.
            "load_avg_1m": os.getloadavg()[0],
            "cpus": len(os.sched_getaffinity(0)),
            "samples_ms": {k: [round(v * 1e3, 3) for v in vs] for k, vs in timings.items()},
        }
        if bench.cuda:
            peak, swap = bench.h2d_peak(runs)
            row.update(h2d_gbps=swap, pinned_peak_gbps=peak, h2d_vs_peak=swap / peak)
            row["target"] = None
            row["pass"] = None
        else:
            row["target"] = TARGET_CPU
            row["pass"] = bool(efficiency >= TARGET_CPU)
        return row
    finally:
        bench.close()


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| device | hit | MiB | copy ms | compute ms | serial ms | overlapped ms | overlap eff. "
        "| target | result | H2D GB/s (pinned peak) | load avg / CPUs |"
    )
    lines = [head, "|" + "---|" * 12]
    for row in rows:
        h2d = "—"
        if "h2d_gbps" in row:
            h2d = f"{row['h2d_gbps']:.1f} ({row['pinned_peak_gbps']:.1f}, "
            h2d += f"{100 * row['h2d_vs_peak']:.0f}%)"
        target = "—" if row["target"] is None else f"≥ {row['target']:.2f}"
        result = "—" if row["pass"] is None else ("PASS" if row["pass"] else "FAIL")
        lines.append(
            f"| {row['device']} | {row['blocks']} blocks ({row['tokens']} tok) "
            f"| {row['mib_copied']:.1f} | {row['copy_ms']:.2f} | {row['compute_ms']:.2f} "
            f"| {row['serial_ms']:.2f} | {row['overlapped_ms']:.2f} "
            f"| {row['overlap_efficiency']:.2f} | {target} | {result} | {h2d} "
            f"| {row['load_avg_1m']:.1f} / {row['cpus']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="write JSON to stdout")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--blocks", type=int, default=512, help="hit size in 128-token blocks")
    parser.add_argument("--runs", type=int, default=7, help="rounds per timing (median)")
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.runs < 1:
        parser.error("--blocks and --runs must be >= 1")
    torch = _torch()
    torch.set_num_threads(1)
    devices = ["cpu"] if args.device in ("auto", "cpu") else []
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device here")
        devices.append("cuda")
    rows = [run_device(device, args.blocks, args.runs) for device in devices]
    failed = any(row["pass"] is False for row in rows)
    if args.json:
        print(json.dumps({"benchmark": "swapin", "rows": rows, "passed": not failed}, indent=2))
    else:
        print(table(rows))
        print("PASS" if not failed else "FAIL: overlap efficiency below target")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
