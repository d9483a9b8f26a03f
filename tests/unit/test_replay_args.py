"""`kvstore replay` refuses bad input with one line naming the flag and exit status 2, before
any tier starts. The flags are checked in this process (``kvstore.cli.main``: what the command
line runs, without an interpreter start per case); the trace file's errors through the real
command line."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli_bad_args import assert_one_line_usage_error, run_cli

from kvstore.cli import main
from kvstore.commands.replay import parse_size
from kvstore.errors import InvalidArgument
from kvstore.trace.replay import ReplayConfig, capacity_blocks, model_block_bytes

LINE = '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}\n'


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text(LINE)
    return path


@pytest.mark.parametrize(
    ("extra", "word"),
    [
        ((), "--trace"),  # required
        (("--speed", "0"), "--speed"),
        (("--speed", "-2"), "--speed"),
        (("--limit", "-1"), "--limit"),
        (("--limit", "0"), "--limit"),
        (("--engines", "0"), "--engines"),
        (("--mode", "standard"), "--mode"),
        (("--mode", "fast"), "--mode"),
        (("--traffic-class", "nope"), "--traffic-class"),
        (("--capacity-bytes", "lots"), "--capacity-bytes"),
        (("--capacity-bytes", "20XB"), "--capacity-bytes"),
        (("--capacity-bytes", "100"), "--capacity-bytes"),  # less than one block
        (("--capacity-fraction", "0"), "--capacity-fraction"),
        (("--capacity-fraction", "1.5"), "--capacity-fraction"),
        (("--capacity-bytes", "1GB", "--capacity-fraction", "0.25"), "not both"),
        (("--payload-scale", "2"), "--payload-scale"),
        (("--payload-scale", "big"), "--payload-scale"),
        (("--gc-high", "1.5"), "--gc-high"),
        (("--gc-low", "0.98"), "--gc-low"),
        (("--address", "nohostport"), "--address"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, tuple) else value,
)
def test_bad_flags_are_named(
    trace: Path, extra: tuple[str, ...], word: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", *extra] if extra == () else ["replay", "--trace", str(trace), *extra]
    try:
        status = main(argv)
    except SystemExit as exit:  # argparse's own errors
        status = int(exit.code or 0)
    out, err = capsys.readouterr()
    assert status == 2, err
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstore replay"), err
    assert "error" in lines[0] and word in lines[0], lines[0]


def test_a_missing_trace_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    assert_one_line_usage_error(run_cli("replay", "--trace", str(missing)), str(missing))


def test_a_bad_json_line_is_named_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(LINE + "{not json\n")
    result = run_cli("replay", "--trace", str(path))
    assert_one_line_usage_error(result, "--trace")
    assert f"{path}:2" in result.stderr


def test_help_explains_itself_with_examples() -> None:
    result = run_cli("replay", "--help")
    assert result.returncode == 0
    for word in ("Mooncake", "--capacity-fraction", "--address", "Ctrl-C", "kvstore replay --"):
        assert word in result.stdout


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("20GB", 20 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1000000", 1_000_000),
        ("2e9", 2 * 10**9),
        ("1.5 GiB", 3 * 2**29),
        ("64kb", 64_000),
    ],
)
def test_sizes_take_decimal_and_binary_units(text: str, expected: int) -> None:
    assert parse_size(text, "--capacity-bytes") == expected


def test_capacity_counts_blocks_of_the_model_size_whatever_the_payload_scale() -> None:
    block = model_block_bytes()
    assert capacity_blocks(ReplayConfig(capacity_bytes=10 * block + 5), 1000) == 10
    assert capacity_blocks(ReplayConfig(capacity_bytes=10 * block, payload_scale=0.125), 1) == 10
    assert capacity_blocks(ReplayConfig(capacity_fraction=0.25), 165_035) == 41_258
    assert capacity_blocks(ReplayConfig(), 1000) is None
    with pytest.raises(InvalidArgument, match="--capacity-fraction"):
        ReplayConfig(capacity_bytes=block, capacity_fraction=0.5)
