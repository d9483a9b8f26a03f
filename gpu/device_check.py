"""The one script to run on a machine with a CUDA GPU: CUDA tests + swap-in benchmark, one table.

    python3 gpu/device_check.py            # from anywhere; needs torch with CUDA and the repo

It runs, each under its own time limit (about 5 minutes in all):

1. ``pytest tests/engine/test_cuda.py -m cuda``: pinned /dev/shm staging, side-stream swap-in
   with one event per layer, ``wait(layer)`` without a host sync, layer i usable before
   layer i+1 is staged, save from the GPU without a host sync, the connector round trip;
2. ``benchmarks/swapin.py --json``: overlap efficiency on CPU and CUDA, and the swap-in's
   host → device GB/s against a plain pinned → device copy of the same bytes.

Prints one table and exits 0 when every check passed (1 otherwise, 2 without a CUDA device).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TEST_LIMIT_S = 150
BENCH_LIMIT_S = 120


def run(command: list[str], limit_s: float) -> tuple[int, str, float]:
    # The repository on the import path: a lent GPU machine runs this from a bare checkout,
    # without `pip install` (it cannot reach a registry) and without Ray, which these checks
    # do not use.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    start = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s, check=False
        )
    except subprocess.TimeoutExpired as expired:
        output = (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else ""
        return 124, output + f"\n(timed out after {limit_s} s)", time.monotonic() - start
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


def device_row() -> tuple[bool, list[str]]:
    import torch

    if not torch.cuda.is_available():
        return False, ["device", "FAIL", f"no CUDA device (torch {torch.__version__})"]
    props = torch.cuda.get_device_properties(0)
    detail = (
        f"{props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}"
    )
    return True, ["device", "ok", detail]


def test_row() -> tuple[bool, list[str]]:
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "cuda.xml"
        code, output, seconds = run(
            [
                sys.executable,
                "-m",
                "pytest",
                "tests/engine/test_cuda.py",
                "-m",
                "cuda",
                "-q",
                "-p",
                "no:cacheprovider",
                "--timeout",
                "120",
                f"--junitxml={report}",
            ],
            TEST_LIMIT_S,
        )
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        if report.exists():
            suite = ElementTree.parse(report).getroot()
            suite = suite if suite.tag == "testsuite" else suite[0]
            counts = {key: int(suite.get(key, 0)) for key in counts}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    ok = code == 0 and passed > 0 and counts["skipped"] == 0
    detail = (
        f"{passed} passed, {counts['failures'] + counts['errors']} failed, "
        f"{counts['skipped']} skipped in {seconds:.0f} s"
    )
    if not ok:
        detail += " | " + " ".join(output.strip().splitlines()[-3:])
    return ok, ["CUDA tests (pytest -m cuda)", "PASS" if ok else "FAIL", detail]


def bench_rows() -> tuple[bool, list[list[str]]]:
    code, output, seconds = run(
        [sys.executable, "benchmarks/swapin.py", "--json", "--runs", "5"], BENCH_LIMIT_S
    )
    try:
        data: dict[str, Any] = json.loads(output[output.index("{") :])
    except ValueError:
        tail = " ".join(output.strip().splitlines()[-3:])
        return False, [["swap-in benchmark", "FAIL", f"exit {code} after {seconds:.0f} s: {tail}"]]
    rows = []
    ok = True
    for row in data["rows"]:
        detail = (
            f"{row['blocks']} blocks, {row['mib_copied']:.0f} MiB: copy {row['copy_ms']:.1f} ms, "
            f"compute {row['compute_ms']:.1f} ms, serial {row['serial_ms']:.1f} ms, "
            f"overlapped {row['overlapped_ms']:.1f} ms, efficiency "
            f"{row['overlap_efficiency']:.2f}"
        )
        if "h2d_gbps" in row:
            detail += (
                f"; H2D {row['h2d_gbps']:.1f} GB/s vs pinned peak "
                f"{row['pinned_peak_gbps']:.1f} GB/s ({100 * row['h2d_vs_peak']:.0f}%)"
            )
        verdict = "info" if row["pass"] is None else ("PASS" if row["pass"] else "FAIL")
        ok &= row["pass"] is not False
        rows.append([f"swap-in overlap ({row['device']})", verdict, detail])
    return ok, rows


def main() -> int:
    started = time.monotonic()
    has_device, first = device_row()
    table = [first]
    ok = has_device
    if has_device:
        tests_ok, row = test_row()
        table.append(row)
        bench_ok, rows = bench_rows()
        table.extend(rows)
        ok = tests_ok and bench_ok
    table.append(["total", "PASS" if ok else "FAIL", f"{time.monotonic() - started:.0f} s"])
    print("| check | result | detail |")
    print("|---|---|---|")
    for check, result, detail in table:
        print(f"| {check} | {result} | {detail} |")
    if not has_device:
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
