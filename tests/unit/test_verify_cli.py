"""``kvstore verify {yoco,replay}``: tables, JSON, exit status (0 pass, 1 check failed, 2 usage)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from kvstore.cli import main  # noqa: E402

YOCO_SMALL = ["--prompt-len", "520", "--chunk", "128", "--decode-steps", "6", "--layers", "3"]
REPLAY_SMALL = [
    "--sizes",
    "768",
    "--layers",
    "4",
    "--ced-prompt",
    "768",
    "--ced-encoder-layers",
    "2",
    "--ced-decoder-layers",
    "4",
]


def test_yoco_table_and_exit_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "yoco", *YOCO_SMALL]) == 0
    out = capsys.readouterr().out
    assert "mask vs compact" in out and "BROKEN compact (off-by-one) vs mask" in out
    assert "Preemption under truncation" in out
    assert out.rstrip().endswith("yoco: PASS")


def test_yoco_injected_bug_exits_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "yoco", *YOCO_SMALL, "--inject-off-by-one", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    main_row = next(r for r in report["comparisons"] if r["compared"] == "mask vs compact")
    assert main_row["dtype"] == "fp32" and main_row["ok"] is False
    off_compact = next(r for r in report["comparisons"] if r["compared"] == "off vs compact")
    assert off_compact["ok"] is False


def test_replay_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "replay", *REPLAY_SMALL, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True
    (size,) = report["sizes"]
    assert size["hit_tokens"] == 768
    assert size["replay"]["tokens_computed"] == 128 * 4
    assert len(size["replay"]["layer_rel_l2"]) == 4
    assert [row["decoder_start"] for row in report["decoder_side"]["rows"]] == [0, 256, 640]
    assert all(check["ok"] for check in report["checks"])


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["verify", "replay", "--sizes", "1000"], "--sizes"),
        (["verify", "replay", "--sizes", "8k"], "--sizes"),
        (["verify", "replay", "--ced-prompt", "1000"], "--ced-prompt"),
        (["verify", "yoco", "--keep", "100"], "--keep"),
        (["verify", "yoco", "--layers", "0"], "--layers"),
    ],
)
def test_bad_arguments_exit_two(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err


def test_check_word_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["verify"])
    assert stop.value.code == 2
