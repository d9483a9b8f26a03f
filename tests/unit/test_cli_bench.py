"""`kvstore bench` finds and runs the benchmark scripts of the source checkout."""

from __future__ import annotations

import subprocess
import sys

from kvstore.commands.bench import BENCHMARKS, benchmarks_dir


def test_every_listed_benchmark_exists() -> None:
    for name in BENCHMARKS:
        assert (benchmarks_dir() / f"{name}.py").is_file(), name


def test_bench_forwards_arguments_to_the_script() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "bench", "gc", "--", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "usage" in done.stdout.lower()


def test_unknown_benchmark_is_one_line_exit_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "bench", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "nope" in done.stderr
