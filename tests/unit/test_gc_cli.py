"""`kvstore gc`: dry run against an index snapshot, and its argument errors."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from kvstore.blockstore.index import BlockIndex
from kvstore.blockstore.indexsnapshot import index_to_table
from kvstore.cli import main
from kvstore.gc.config import DAY

T0 = 1_700_000_000.0
ISO_T0 = datetime.fromtimestamp(T0, UTC).isoformat()
SIZE = 100_000


def key(i: int) -> bytes:
    return hashlib.blake2b(b"cli-%d" % i, digest_size=32).digest()


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    """10 default, 10 agent, 10 chatbot blocks; block i last accessed at T0 + i seconds."""
    index = BlockIndex()
    n = 30
    rows = index.upsert(
        [key(i) for i in range(n)],
        np.zeros((n, 12), np.int32),
        np.full(n, SIZE),
        np.repeat([0, 1, 2], 10),
        T0,
    )
    for i, row in enumerate(rows):
        index.touch([row], T0 + i)
    path = tmp_path / "index.parquet"
    pq.write_table(index_to_table(index), path)
    return path


def at(days: float, seconds: float = 0) -> str:
    return datetime.fromtimestamp(T0 + days * DAY + seconds, UTC).isoformat()


def test_dry_run_on_a_snapshot_expires_by_class(snapshot: Path, capsys) -> None:
    code = main(
        ["gc", "--dry-run", "--json", "--index-snapshot", str(snapshot), "--now", at(3, 11)]
    )
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    # 3 days and 11 s after T0: default blocks (1 day) all gone, agent blocks idle > 3 days are
    # those last touched before T0 + 11 s: agent ids 10..19 touched at T0+10..T0+19 -> only 10.
    assert plan["expired"]["default"] == {"blocks": 10, "bytes": 10 * SIZE}
    assert plan["expired"]["agent"] == {"blocks": 1, "bytes": SIZE}
    assert plan["expired"]["chatbot"] == {"blocks": 0, "bytes": 0}
    assert plan["evicted"]["default"]["blocks"] == 0


def test_dry_run_plans_lru_eviction_after_expiry(snapshot: Path, capsys) -> None:
    # At T0: nothing expired. 30 blocks in a capacity of 32: 93.75 % > 90 %; down to 80 %
    # (25.6 blocks) means evicting 5 - the oldest 5 (ids 0..4, all default).
    code = main(
        [
            "gc", "--dry-run", "--json", "--index-snapshot", str(snapshot),
            "--now", ISO_T0, "--capacity-bytes", str(32 * SIZE),
        ]
    )  # fmt: skip
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["evicted"]["default"] == {"blocks": 5, "bytes": 5 * SIZE}
    assert plan["evicted"]["agent"]["blocks"] == 0
    assert plan["used_bytes_after"] == 25 * SIZE


def test_dry_run_table_output(snapshot: Path, capsys) -> None:
    assert main(["gc", "--dry-run", "--index-snapshot", str(snapshot), "--now", at(8)]) == 0
    out = capsys.readouterr().out
    assert "dry run: 30 blocks" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    assert lines["agent"][1:3] == ["10", str(10 * SIZE)]
    assert lines["chatbot"][1:3] == ["10", str(10 * SIZE)]
    assert lines["total"][1:3] == ["30", str(30 * SIZE)]


def test_in_days_moves_from_the_wall_clock(snapshot: Path, capsys) -> None:
    # T0 is in the past: any --in-days >= 0 is more than 7 days after it.
    assert (
        main(["gc", "--dry-run", "--json", "--index-snapshot", str(snapshot), "--in-days", "1"])
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert sum(v["blocks"] for v in plan["expired"].values()) == 30


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--now", "yesterday"], "--now"),
        (["--in-days", "-1"], "--in-days"),
        (["--capacity-bytes", "-5"], "--capacity-bytes"),
        (["--classes", "default,,chatbot"], "--classes"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(snapshot: Path, capsys, extra, needle) -> None:
    assert main(["gc", "--dry-run", "--index-snapshot", str(snapshot), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvstore gc: error: " + needle)
    assert len(err.strip().splitlines()) == 1


def test_now_and_in_days_together_is_a_usage_error(snapshot: Path, capsys) -> None:
    with pytest.raises(SystemExit) as caught:
        main(
            [
                "gc",
                "--dry-run",
                "--index-snapshot",
                str(snapshot),
                "--now",
                ISO_T0,
                "--in-days",
                "2",
            ]
        )
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "not allowed with argument" in err and len(err.strip().splitlines()) == 1


def test_snapshot_without_dry_run_is_refused(snapshot: Path, capsys) -> None:
    assert main(["gc", "--index-snapshot", str(snapshot)]) == 2
    err = capsys.readouterr().err
    assert "--dry-run" in err and len(err.strip().splitlines()) == 1


def test_missing_or_foreign_snapshot(tmp_path: Path, capsys) -> None:
    assert main(["gc", "--dry-run", "--index-snapshot", str(tmp_path / "nope.parquet")]) == 2
    assert "no such file" in capsys.readouterr().err
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    assert main(["gc", "--dry-run", "--index-snapshot", str(junk)]) == 2
    assert "not a parquet file" in capsys.readouterr().err


def test_bad_policy_file_names_the_key(snapshot: Path, tmp_path: Path, capsys) -> None:
    policy = tmp_path / "gc.toml"
    policy.write_text("[gc.watermarks]\nhigh = 0.5\nlow = 0.7\n")
    code = main(["gc", "--dry-run", "--config", str(policy), "--index-snapshot", str(snapshot)])
    assert code == 2
    err = capsys.readouterr().err
    assert "gc.watermarks.low" in err and len(err.strip().splitlines()) == 1


def test_no_cluster_at_address_is_one_line_exit_1(tmp_path: Path) -> None:
    # A subprocess: this pytest process may hold the session's Ray connection.
    result = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "gc", "--dry-run", "--address", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "kvstore gc: StoreError: no kvstore cluster at 127.0.0.1:1 (Connection refused)"
    ]


def test_malformed_address_exits_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "gc", "--address", "nowhere"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert "--address" in result.stderr and len(result.stderr.strip().splitlines()) == 1
