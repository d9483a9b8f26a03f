"""Bad command-line arguments, for every command: one clear line on stderr naming the argument,
nothing on stdout, exit status 2 — and nothing started (each case fails before any work)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: (argv, a word the one error line must contain)
CASES: list[tuple[tuple[str, ...], str]] = [
    ((), "COMMAND"),
    (("frobnicate",), "frobnicate"),
    (("plan",), "--prompt-len"),
    (("plan", "--prompt-len", "abc", "--block-hit-tokens", "0"), "--prompt-len"),
    (("plan", "--prompt-len", "1000", "--block-hit-tokens", "100"), "--block-hit-tokens"),
    (("plan", "--prompt-len", "1000", "--block-hit-tokens", "0", "--swa-at", "x@"), "--swa-at"),
    (("plan", "--prompt-len", "1000", "--block-hit-tokens", "0", "--mode", "fast"), "--mode"),
    (("hit", "--random", "-1"), "--random"),
    (("hit", "--random", "5", "--timeout", "-1"), "--timeout"),
    (("hit", "--tokens-file", "/nonexistent/tokens"), "--tokens-file"),
    (("put",), "FILE"),
    (("put", "--key", "zz", "/etc/hostname"), "--key"),
    (("put", "--key", "00", "/etc/hostname"), "64 hex"),
    (("put", "/nonexistent/file"), "/nonexistent/file"),
    (("get", "zz"), "key"),
    (("get", "00"), "64 hex"),
    (("stats", "--timeout", "0"), "--timeout"),
    (("status", "--timeout", "-3"), "--timeout"),
    (("geometry", "--preset", "nope"), "--preset"),
    (("geometry", "--yoco-keep", "-1"), "--yoco-keep"),
    (("geometry", "--max-backtracking", "-1"), "--max-backtracking"),
    (("geometry", "--num-state-seqs", "0"), "--num-state-seqs"),
    (("gc", "--dry-run", "--index-snapshot", "/nonexistent/shard.parquet"), "--index-snapshot"),
    (("gc", "--config", "/nonexistent/gc.toml", "--dry-run"), "/nonexistent/gc.toml"),
    (("gc", "--address", "nohostport"), "--address"),
    (("gc", "--dry-run", "--in-days", "soon"), "--in-days"),
    (("demo", "--sessions", "-1"), "--sessions"),
    (("demo", "--engines", "0"), "--engines"),
    (("up", "--port", "70000"), "port"),
    (("up", "--storage-nodes", "5"), "--storage-nodes"),
    (("up", "--tls-cert", "/etc/hostname"), "tls"),
    (("up", "--token-file", "/nonexistent/token"), "token"),
    (("up", "--fsync", "sometimes"), "--fsync"),
    (("up", "--meta-shards", "0"), "--meta-shards"),
    (("up", "--host", "0.0.0.0"), "--host"),
    (("up", "--tokens-file", "/nonexistent/tokens.toml"), "--tokens-file"),
    (("up", "--tls-client-ca", "/etc/hostname"), "--tls-client-ca"),
    (("up", "--capacity-bytes", "0"), "--capacity-bytes"),
    (("stats", "--tls-client-cert", "/etc/hostname"), "--tls-client-cert"),
    (("chaos",), "--scenario"),
    (("chaos", "--scenario", "nope"), "--scenario"),
    (("chaos", "--scenario", "all", "--machines", "3"), "--machines"),
    (("chaos", "--scenario", "all", "--machines", "many"), "--machines"),
    (("bench", "nope"), "nope"),
    (("verify", "--nope"), "kvstore verify"),
]


def run_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        env=None if env is None else {**os.environ, **env},
    )


def assert_one_line_usage_error(result: subprocess.CompletedProcess[str], word: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvstore"), lines[0]
    assert "error" in lines[0] and word in lines[0], lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("argv", "word"), CASES, ids=[" ".join(a) or "<none>" for a, _ in CASES])
def test_bad_arguments_print_one_line_and_exit_2(argv: tuple[str, ...], word: str) -> None:
    assert_one_line_usage_error(run_cli(*argv), word)


def test_chaos_refuses_a_data_dir_that_holds_files(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("not chaos data")
    result = run_cli("chaos", "--scenario", "kill-two", "--data-dir", str(tmp_path))
    assert_one_line_usage_error(result, "--data-dir")
    assert (tmp_path / "precious.txt").read_text() == "not chaos data"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("KVSTORE_BLOCKSTORE_CALL_TIMEOUT_S", "soon"),
        ("KVSTORE_SWA_TTL_S", "-5"),
        ("KVSTORE_PRESET", "v9"),
        ("KVSTORE_GC_FILE", "/nonexistent/gc.toml"),
    ],
)
def test_up_reads_its_settings_from_the_environment_and_names_a_bad_one(
    variable: str, value: str
) -> None:
    """`kvstore up` takes every setting without a flag from the environment (one loader,
    ``kvstore.envconfig``); a bad one is refused before any cluster starts, by its name."""
    result = run_cli("up", "--port", "0", env={variable: value})
    assert_one_line_usage_error(result, "gc.toml" if variable == "KVSTORE_GC_FILE" else variable)
