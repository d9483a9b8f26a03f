"""``kvstore geometry``: table and JSON output, one-line errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from kvstore.cli import main

V41_PE = [
    "geometry",
    "--preset",
    "v4.1-flash",
    "--truncation",
    "compact",
    "--yoco-keep",
    "134",
    "--extra-state",
]


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_the_article_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, V41_PE)
    assert data["role"] == "prefill"  # the default role with --extra-state
    assert data["inference_ring"] == 134
    assert data["store_ring"] == 396
    assert data["state_size_to_disk"] == 1_415_040
    assert data["block_bytes"] == 114_048
    assert data["stored_swa_layers"] == list(range(20))
    assert data["consumer_swa_layers"] == list(range(20, 40))
    assert data["compression_rings"] == {"csa": 14, "hca": 134}
    assert data["state_tables"]["swa_cache"]["shape"] == [64, 396, 1, 528]
    assert data["layout"]["swa_ring"] == 396
    stored = data["inference_layout"]["groups"]["stored_swa"]
    assert stored == {"offset": 0, "nbytes": 1_415_040, "regions": 20}
    assert data["inference_layout"]["dropped_offset"] == 1_415_040
    assert data["layout"]["groups"]["compression"]["regions"] == 19 * 2 + 19
    assert "regions" not in data["layout"]  # per-region rows only with --regions


def test_regions_lists_every_region_with_contiguous_offsets(
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = run_json(capsys, [*V41_PE, "--regions"])
    for key in ("layout", "inference_layout"):
        layout = data[key]
        assert layout["region_columns"] == ["name", "group", "layer", "offset", "nbytes"]
        rows = layout["regions"]
        assert len(rows) == layout["region_count"] == 97
        end = 0
        for _name, _group, _layer, offset, nbytes in rows:
            assert offset == end
            end = offset + nbytes
        assert end == layout["total_bytes"]
    ring = data["inference_layout"]["swa_ring"]
    assert data["inference_layout"]["regions"][0] == ["swa.0", "stored_swa", 0, 0, ring * 528]
    assert data["inference_layout"]["regions"][20][:4] == [
        "swa.20",
        "consumer_swa",
        20,
        1_415_040,
    ]
    assert main([*V41_PE, "--regions"]) == 0
    table = capsys.readouterr().out
    assert "hca.compressed_state.39" in table


def test_decode_is_the_default_role_and_has_one_layout(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, ["geometry", "--preset", "v4-pro"])
    assert data["role"] == "decode"
    assert data["num_layers"] == 61
    assert data["store_ring"] == data["inference_ring"] == 134
    assert "inference_layout" not in data
    assert data["layout"]["groups"]["stored_swa"]["nbytes"] == data["state_size_to_disk"]


def test_max_backtracking_changes_every_ring(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["geometry", "--max-backtracking", "8", "--truncation", "mask", "--yoco-keep", "136"]
    data = run_json(capsys, [*argv, "--extra-state"])
    assert data["inference_ring"] == 136
    assert data["store_ring"] == 136 + 128 + 136
    assert data["compression_rings"] == {"csa": 16, "hca": 136}


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(V41_PE) == 0
    out = capsys.readouterr().out
    assert "inference_ring" in out and " 134 " in out
    assert "store_ring" in out and "396" in out and "134 + prefill extra 128 + yoco keep 134" in out
    assert "1,415,040" in out
    assert "114,048" in out
    assert "persisted: the first 1,415,040 bytes" in out


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--preset", "v9"], ["--preset", "v9"]),
        (["--truncation", "mask"], ["--yoco-keep", "134"]),
        (["--truncation", "compact", "--yoco-keep", "100"], ["--yoco-keep", "134"]),
        (["--yoco-keep", "-5"], ["--yoco-keep"]),
        (["--truncation", "squeeze"], ["--truncation", "squeeze"]),
        (["--role", "router"], ["--role"]),
        (["--role", "decode", "--extra-state"], ["--extra-state"]),
        (["--num-state-seqs", "0"], ["--num-state-seqs"]),
    ],
)
def test_bad_arguments_print_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], names: list[str]
) -> None:
    assert main(["geometry", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("kvstore geometry: error: ")
    for name in names:
        assert name in lines[0]


def test_non_integer_yoco_keep_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["geometry", "--yoco-keep", "lots"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--yoco-keep" in err[0]


def test_geometry_json_as_a_subprocess() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *V41_PE, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["inference_ring"], data["store_ring"]) == (134, 396)
    assert data["state_size_to_disk"] == 1_415_040
    assert data["stored_swa_layers"] == list(range(20))
