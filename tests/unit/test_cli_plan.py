"""``kvstore plan``: the hit rule from the command line (JSON, table, errors)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstore.cli import main


def plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one JSON object on one line
    return json.loads(out)


def test_json_swa_found(capsys):
    # 1300 − 134 = 1166 → L1 1152; SWA at 1152 → hit 1152; store at 1280.
    data = plan_json(
        capsys, "--prompt-len", "1300", "--block-hit-tokens", "1280", "--swa-at", "1152"
    )
    assert data["hit_tokens"] == 1152
    assert data["block_hit_tokens"] == 1152
    assert data["swa_hit"] is True
    assert data["replay_start"] is None
    assert data["replay_tokens"] == 0
    assert data["compute_from"] == 1152
    assert data["store_at"] == 1280


def test_json_swa_missing_backs_off_one_block(capsys):
    # SWA only at 1024 (not L1 = 1152): back off to 1024.
    data = plan_json(
        capsys, "--prompt-len", "1300", "--block-hit-tokens", "1280", "--swa-at", "1024"
    )
    assert (data["hit_tokens"], data["swa_hit"], data["compute_from"]) == (1024, False, 1024)


def test_json_bounded_replay(capsys):
    data = plan_json(
        capsys, "--prompt-len", "1300", "--block-hit-tokens", "1280", "--mode", "bounded-replay"
    )
    assert data["hit_tokens"] == 1152
    assert (data["replay_start"], data["replay_tokens"]) == (1024, 128)
    assert data["compute_from"] == 1152


def test_full_attention_caps_at_one_token_and_looks_for_no_state(capsys):
    # 1300 − 1 = 1299 → 10 blocks = 1280 = B: hit 1280, no SWA lookup (the standard rule: 1024).
    argv = ["--prompt-len", "1300", "--block-hit-tokens", "1280", "--mode", "full-attention"]
    data = plan_json(capsys, *argv)
    assert (data["cap"], data["hit_tokens"], data["swa_position"]) == (1299, 1280, None)
    assert main(["plan", *argv]) == 0
    table = capsys.readouterr().out
    assert "cap (L − 1)" in table and "full attention: no window state" in table


def test_json_nothing_to_reuse(capsys):
    data = plan_json(capsys, "--prompt-len", "100", "--block-hit-tokens", "0")
    assert data["hit_tokens"] == 0
    assert data["store_at"] is None
    assert data["swa_position"] is None


def test_swa_at_is_repeatable_and_takes_several_values(capsys):
    # 3000 − 134 = 2866 → 22 blocks = 2816 ≥ B 2560 → L1 2560.
    data = plan_json(
        capsys,
        "--prompt-len",
        "3000",
        "--block-hit-tokens",
        "2560",
        "--swa-at",
        "128",
        "256",
        "--swa-at",
        "2560@node-4",
    )
    assert (data["hit_tokens"], data["swa_location"]) == (2560, "node-4")


def test_max_backtracking_option_moves_the_cap(capsys):
    # 262 − 134 = 128 → one block; with 7 rollback tokens 262 − 135 = 127 → none.
    base = ["--prompt-len", "262", "--block-hit-tokens", "128", "--swa-at", "128"]
    assert plan_json(capsys, *base)["hit_tokens"] == 128
    assert plan_json(capsys, *base, "--max-backtracking", "7")["hit_tokens"] == 0


def test_table_explains_the_back_off(capsys):
    argv = ["plan", "--prompt-len", "1300", "--block-hit-tokens", "1152", "--swa-at", "1000"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "cap (L − 134)      1166" in out
    assert "hit tokens         1024" in out
    assert "store at           1280" in out
    assert "why: SWA state at 1152 missing → back off one block" in out
    assert "SWA at 1000 ignored" in out


def test_table_bounded_replay_and_found(capsys):
    argv = ["plan", "--prompt-len", "1300", "--block-hit-tokens", "1280"]
    assert main([*argv, "--mode", "bounded-replay"]) == 0
    out = capsys.readouterr().out
    assert "replay             [1024, 1152) (128 tokens, SWA only)" in out
    assert main([*argv, "--swa-at", "1152@node-2"]) == 0
    out = capsys.readouterr().out
    assert "1152: found on node-2" in out
    assert "truncated to the cap 1166" in out


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--prompt-len", "-5", "--block-hit-tokens", "0"], "--prompt-len"),
        (["--prompt-len", "0", "--block-hit-tokens", "0"], "--prompt-len"),
        (["--prompt-len", "1300", "--block-hit-tokens", "100"], "--block-hit-tokens"),
        (["--prompt-len", "1300", "--block-hit-tokens", "-128"], "--block-hit-tokens"),
        (["--prompt-len", "300", "--block-hit-tokens", "384"], "--block-hit-tokens"),
        (["--prompt-len", "1300", "--block-hit-tokens", "128", "--swa-at", "-1"], "--swa-at"),
        (["--prompt-len", "1300", "--block-hit-tokens", "128", "--swa-at", "x@y"], "--swa-at"),
        (["--prompt-len", "1300", "--block-hit-tokens", "128", "--mode", "fast"], "--mode"),
        (["--prompt-len", "ten", "--block-hit-tokens", "128"], "--prompt-len"),
        (["--block-hit-tokens", "128"], "--prompt-len"),
        (["--prompt-len", "1300", "--block-hit-tokens", "0", "--window", "0"], "--window"),
    ],
)
def test_bad_arguments_one_line_exit_2(capsys, argv, named):
    with pytest.raises(SystemExit) as exited:
        code = main(["plan", *argv])
        raise SystemExit(code)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("kvstore plan: error: ")
    assert named in captured.err


def test_installed_command_end_to_end():
    # A real interpreter running the real entry module, as a user would.
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore.cli",
            "plan",
            "--prompt-len",
            "1300",
            "--block-hit-tokens",
            "1280",
            "--swa-at",
            "1152",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["hit_tokens"] == 1152
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore.cli",
            "plan",
            "--prompt-len",
            "1300",
            "--block-hit-tokens",
            "100",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "kvstore plan: error: --block-hit-tokens: must be a multiple of 128 (whole blocks), got 100"
    ]
