"""Every command with ``--json`` prints exactly one JSON document on stdout, and nothing else.

Each command runs with its ``run`` wrapped in noise (``cli_noise``: a print, a write to
descriptor 1 and a child process printing on the stdout it inherits, before and after the
command) and the test reads stdout at the descriptor (``capfd``): ``json.loads`` of the whole of
it must succeed, and the noise must be on stderr. The commands that talk to a gateway ask a real
one in this process over the in-process tier (no Ray); drain/undrain, demo, chaos and verify run
on stand-ins for their cluster or their check (what is under test is their output, not a real
demo's 14 storage nodes, chaos's 13 machines or verify's half minute of model runs: their own
tests run those); ``replay`` runs as a real ``kvstore replay`` process that is also a Ray driver
of the session's cluster forwarding its workers' output (the case of the report, issue 30; the
one test here on the ``ray_cluster`` fixture, so marked ``ray``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_noise import MARK, RAY_ADDRESS_ENV, noisy
from tier_parts import GEOMETRY, InProcessTier

from kvstore.api.gateway import Gateway
from kvstore.api.server import ServerOptions
from kvstore.cli import build_parser, main
from kvstore.trace.mooncake import TRACE_BLOCK_TOKENS

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "tests" / "data" / "mooncake_synthetic_head700.jsonl"
NOISE = Path(__file__).with_name("cli_noise.py")


def has_json(parser: argparse.ArgumentParser) -> bool:
    for action in parser._actions:
        if "--json" in action.option_strings:
            return True
        if isinstance(action, argparse._SubParsersAction):
            if any(has_json(sub) for sub in action.choices.values()):
                return True
    return False


def json_commands() -> list[str]:
    """The commands whose parser (or a sub-command's) has --json: what must be covered here."""
    (commands,) = (
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    return sorted(name for name, sub in commands.choices.items() if has_json(sub))


COVERED = (
    "bench chaos demo drain gc geometry get hit plan put replay simulate stats status undrain "
    "verify"
).split()


def test_every_command_with_json_is_covered_here() -> None:
    assert json_commands() == COVERED


def run_json(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], argv: list[str]
) -> tuple[int, Any, str]:
    """``kvstore ARGV`` in this process, noisy; its exit status, the document, stderr."""
    module = importlib.import_module(f"kvstore.commands.{argv[0]}")
    monkeypatch.setattr(module, "run", noisy(module.run))
    capfd.readouterr()
    code = main(argv)
    captured = capfd.readouterr()
    assert MARK not in captured.out, captured.out
    document = json.loads(captured.out)  # the whole of stdout: one document
    for where in ("print", "fd1", "child"):
        for when in ("before", "after"):
            assert f"{MARK} {where} {when}" in captured.err, captured.err
    return code, document, captured.err


# --- commands without a tier ------------------------------------------------------------------


def test_geometry(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    code, document, _ = run_json(monkeypatch, capfd, ["geometry", "--json"])
    assert code == 0 and "layout" in document


def test_plan(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--prompt-len", "1300", "--block-hit-tokens", "1280", "--swa-at", "1152"]
    code, document, _ = run_json(monkeypatch, capfd, [*argv, "--json"])
    assert code == 0 and document["hit_tokens"] == 1152


def test_gc_dry_run(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import numpy as np
    import pyarrow.parquet as pq

    from kvstore.blockstore.index import BlockIndex
    from kvstore.blockstore.indexsnapshot import index_to_table

    index = BlockIndex()
    keys = [bytes([i]) * 32 for i in range(3)]
    index.upsert(keys, np.zeros((3, 12), np.int32), np.full(3, 10), np.zeros(3, np.int32), 0.0)
    snapshot = tmp_path / "index.parquet"
    pq.write_table(index_to_table(index), snapshot)
    argv = ["gc", "--dry-run", "--json", "--index-snapshot", str(snapshot)]
    code, document, _ = run_json(monkeypatch, capfd, argv)
    assert code == 0 and "expired" in document


def test_simulate(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--trace", str(TRACE), "--limit", "20", "--machines", "14"]
    code, document, _ = run_json(
        monkeypatch, capfd, [*argv, "--no-sizing", "--no-progress", "--json"]
    )
    assert code == 0 and isinstance(document, dict)


def test_verify(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    # The check itself takes half a minute on a busy machine (tests/unit/test_verify_cli.py runs
    # it, JSON included); what is under test here is what the command prints around its report.
    pytest.importorskip("torch")

    class Report:
        ok = True

        def as_dict(self) -> dict[str, Any]:
            print("a check's progress on stdout", flush=True)
            return {"ok": True}

    monkeypatch.setattr("kvstore.verify.yoco.run_yoco", lambda config: Report())
    monkeypatch.setattr("kvstore.verify.report.render_yoco", lambda report: "the table")
    code, document, err = run_json(monkeypatch, capfd, ["verify", "yoco", "--json"])
    assert code == 0 and document == {"ok": True}
    assert "a check's progress on stdout" in err


def test_bench(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    # The benchmark is a process of its own: its stdout is the document, checked and passed on.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    argv = ["bench", "gc", "--json", "--", "--runs", "1", "--sizes", "1000", "--naive", "1000"]
    code, document, _ = run_json(monkeypatch, capfd, argv)
    assert code in (0, 1) and "index" in document  # 1: a target missed at this tiny size


def test_bench_output_that_is_not_json_goes_to_stderr(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "gc.py").write_text("print('a table, not JSON')\n")
    monkeypatch.setattr("kvstore.commands.bench.benchmarks_dir", lambda: tmp_path)
    assert main(["bench", "gc", "--json"]) == 1
    captured = capfd.readouterr()
    assert captured.out == ""
    assert "a table, not JSON" in captured.err and "not one JSON document" in captured.err


def test_drain_and_undrain(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from fake_repair import FakeRepair

    from kvstore.runtime import drain

    live = drain.LiveRepair("kvstore", FakeRepair(stripes=40, per_look=20), tuple(range(13)))
    monkeypatch.setattr(drain, "attach", lambda address, deployment: live)
    monkeypatch.setattr(drain, "DRAIN_POLL_S", 0.01)
    code, document, err = run_json(monkeypatch, capfd, ["drain", "3", "--json"])
    assert code == 0 and document["done"] is True
    assert "draining node 3" in err  # the progress bar
    code, document, _ = run_json(monkeypatch, capfd, ["undrain", "3", "--json"])
    assert code == 0 and document["draining"] is False


def test_demo(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    # A real demo stands up its own Ray and 14 storage nodes (tens of seconds); what is under
    # test is what the command prints around the summary the run hands back.
    def run_demo(config: Any) -> dict[str, Any]:
        print("demo progress on stdout", flush=True)
        return {"requests": 1, "wrong_bytes_reads": 0}

    monkeypatch.setattr("kvstore.demo.runner.run_demo", run_demo)
    code, document, err = run_json(monkeypatch, capfd, ["demo", "--no-progress", "--json"])
    assert code == 0 and document == {"requests": 1, "wrong_bytes_reads": 0}
    assert "demo progress on stdout" in err


def test_chaos(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    # Real scenarios need 13 machines of Ray (minutes; run by -m chaos): stood in for here.
    from kvstore.chaos.catalog import SCENARIO_NAMES

    def scenarios(args: Any, chosen: Any, data_root: Path) -> list[Any]:
        os.write(1, b"a raylet notice on descriptor 1\n")
        return []

    monkeypatch.setattr("kvstore.commands.chaos._run_scenarios", scenarios)
    argv = ["chaos", "--scenario", SCENARIO_NAMES[0], "--json"]
    code, document, err = run_json(monkeypatch, capfd, argv)
    assert code == 0 and document["scenarios"] == [] and document["ok"] is True
    assert "a raylet notice on descriptor 1" in err


# --- commands that ask a gateway: a real one over the in-process tier -------------------------


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    parts = InProcessTier(tmp_path_factory.mktemp("json-tier"), release_batch_s=0)
    served = Gateway(parts.tier, ServerOptions())
    try:
        yield served.address
    finally:
        served.stop()


def test_put_get_hit_stats_status(
    gateway: str,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    block = tmp_path / "block.bin"
    block.write_bytes(b"\x05" * GEOMETRY.block_bytes)
    server = ["--server", gateway]
    code, put, _ = run_json(monkeypatch, capfd, ["put", str(block), *server, "--json"])
    assert code == 0 and put["committed"] == 1
    key = put["blocks"][0]["key"]
    code, got, _ = run_json(monkeypatch, capfd, ["get", key, *server, "--json"])
    assert code == 0 and got["found"] is True and got["bytes"] == GEOMETRY.block_bytes
    code, missed, _ = run_json(monkeypatch, capfd, ["get", "ab" * 32, *server, "--json"])
    assert code == 1 and missed["found"] is False  # a miss: still one document
    code, hit, _ = run_json(monkeypatch, capfd, ["hit", "--random", "300", *server, "--json"])
    assert code == 0 and "hit_tokens" in hit
    code, stats, _ = run_json(monkeypatch, capfd, ["stats", *server, "--json"])
    assert code == 0 and "storage_nodes" in stats
    code, status, _ = run_json(monkeypatch, capfd, ["status", *server, "--json"])
    assert code in (0, 1) and status["serving"] is True


def test_status_watch_json_is_one_document_per_line(
    gateway: str, capfd: pytest.CaptureFixture[str]
) -> None:
    argv = ["status", "--server", gateway, "--watch", "--count", "2", "--interval", "0.01"]
    main([*argv, "--json"])
    lines = capfd.readouterr().out.splitlines()
    assert len(lines) == 2
    assert all(json.loads(line)["serving"] is True for line in lines)


# --- replay: a real process, a Ray driver forwarding its workers' output ----------------------


def tiny_trace(path: Path) -> Path:
    """Two requests of one 512-token prefix block each, the second the first's prefix again."""
    record = {"timestamp": 0, "input_length": TRACE_BLOCK_TOKENS, "output_length": 1}
    lines = [json.dumps({**record, "hash_ids": [7]}), json.dumps({**record, "hash_ids": [7]})]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_replay_json_with_ray_output_on_the_driver(
    ray_cluster: Any, gateway: str, tmp_path: Path
) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(NOISE),
            "replay",
            "--trace",
            str(tiny_trace(tmp_path / "trace.jsonl")),
            "--address",
            gateway,
            "--engines",
            "1",
            "--no-progress",
            "--report-dir",
            str(tmp_path / "report"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        env={**os.environ, RAY_ADDRESS_ENV: ray_cluster.address, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)  # the whole of stdout: one document
    assert summary["requests"] == 2 and summary["wrong_bytes"] == 0
    for line in ("ray worker print", "ray worker warning", "raylet warning", "fd1 after"):
        assert f"{MARK} {line}" in done.stderr, done.stderr
    # Ray held the repeated raylet warning back and printed it at ray.shutdown, once the
    # command was done (after its last noise): on stderr too.
    assert done.stderr.count(f"{MARK} raylet warning") == 2
    assert done.stderr.rindex(f"{MARK} raylet warning") > done.stderr.index(f"{MARK} child after")
    assert "trace: 2 requests" in done.stderr  # the command's own progress lines
