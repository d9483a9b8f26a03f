"""`kvstore replay` end to end on the session's Ray cluster: real storage nodes, meta shards, GC
and gateway; small traces with tiny payloads so the whole file runs in about a minute.

The hit-rate checks use a trace written here (conversations interleaved round-robin, so a turn
is never in flight beside the turn before it: four engines then see what the sequential oracle
sees). One unbounded tier serves the unbounded check (``--address`` path, in this process) and
the Ctrl-C check (the dev trace's first requests from a ``kvstore replay`` subprocess); the
bounded check stands up its own embedded tier, sized and GC'd by the replay."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.runtime.cluster import LocalCluster
from kvstore.runtime.service import RunningService, embedded_service
from kvstore.trace.mooncake import TRACE_BLOCK_TOKENS, load_trace
from kvstore.trace.replay import ReplayConfig, model_block_bytes, run_replay

REPO = Path(__file__).resolve().parents[2]
DEV_TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_head700.jsonl"
SCALE = 1 / 64  # 1,782 B payloads: the test is about hits and bytes, not bandwidth
#: Hash ids of the trace written here start far above the dev trace's, so the two share no block.
FIRST_ID = 5_000_000


@pytest.fixture(scope="module")
def unbounded_tier(
    ray_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningService]:
    with embedded_service(
        tmp_path_factory.mktemp("replay-tier"),
        cluster=ray_cluster,
        deployment="replay-test",
        environ={**os.environ, "KVSTORE_SWA_NAME": "swa_replay_test"},
        storage_nodes=12,
        fsync="never",
        block_bytes=int(model_block_bytes() * SCALE),
    ) as running:
        yield running


def write_conversations(path: Path, active: int = 16, conversations: int = 16) -> Path:
    """Chat sessions in Mooncake's format: 3 shared system prompts of 2 ids each, then 10 turns
    of two new ids each (the history grows). ``active`` sessions at a time take turns
    round-robin (a finished one is replaced by the next); requests 0.5 s apart in trace time:
    160 requests, 8,160 blocks, 1,288 of them unique. All 16 at once is the worst case of an
    LRU cache smaller than the trace (it evicts each history just before its next turn); 4 at
    once have locality: an LRU cache of half the blocks keeps every live history and evicts
    the finished ones."""
    lines: list[str] = []
    fresh = FIRST_ID + 1000
    history: dict[int, list[int]] = {c: [] for c in range(conversations)}
    waiting = list(range(conversations))
    live = [waiting.pop(0) for _ in range(min(active, conversations))]
    while live:
        for conversation in list(live):
            history[conversation] += [fresh, fresh + 1]
            fresh += 2
            system = [FIRST_ID + 2 * (conversation % 3), FIRST_ID + 2 * (conversation % 3) + 1]
            ids = system + history[conversation]
            record = {
                "timestamp": 500 * len(lines),
                "input_length": len(ids) * TRACE_BLOCK_TOKENS - 100,
                "output_length": 20,
                "hash_ids": ids,
            }
            lines.append(json.dumps(record))
            if len(history[conversation]) == 2 * 10:
                live.remove(conversation)
                if waiting:
                    live.append(waiting.pop(0))
    path.write_text("\n".join(lines) + "\n")
    return path


def replay(cluster: LocalCluster, trace: Path, **changes: object) -> dict[str, object]:
    config = ReplayConfig(payload_scale=SCALE, progress=False, storage_nodes=12, **changes)  # type: ignore[arg-type]
    summary, served, _ = run_replay(config, load_trace(trace), cluster=cluster, say=lambda _: None)
    assert len(served) == summary["requests"]
    return summary


def test_unbounded_replay_hits_what_the_infinite_oracle_does(
    ray_cluster: LocalCluster, unbounded_tier: RunningService, tmp_path: Path
) -> None:
    trace = write_conversations(tmp_path / "chat.jsonl", active=8, conversations=8)
    summary = replay(ray_cluster, trace, address=unbounded_tier.address)
    assert summary["wrong_bytes"] == 0
    assert summary["load_errors"] == 0 and summary["put_failures"] == 0
    infinite = summary["oracles"]["infinite"]  # type: ignore[index]
    assert infinite["token_hit_rate"] > 0.5  # the trace is mostly reuse
    assert abs(infinite["replay_ratio"] - 1) <= 0.02
    assert summary["block_bytes"] == int(model_block_bytes() * SCALE)
    assert summary["evicted"] is None  # over gRPC only: the GC's figures are not reachable
    assert summary["classes"]["chatbot"]["stored_bytes"] > 0  # type: ignore[index]


def test_bounded_replay_evicts_and_keeps_up_with_the_lru_oracle(
    ray_cluster: LocalCluster, tmp_path: Path
) -> None:
    summary = replay(
        ray_cluster,
        write_conversations(tmp_path / "chat.jsonl", active=4),
        capacity_fraction=0.5,
        gc_scan_interval_s=0.25,
    )
    assert summary["wrong_bytes"] == 0
    assert summary["capacity_blocks"] == 1288 // 2
    assert summary["evicted"]["blocks"] > 0  # type: ignore[index]
    lru = summary["oracles"]["lru"]  # type: ignore[index]
    assert lru["blocks_evicted"] > 0 and lru["token_hit_rate"] > 0.6
    assert lru["replay_ratio"] >= 0.9, summary
    chatbot = summary["classes"]["chatbot"]  # type: ignore[index]
    assert chatbot["evicted_blocks"] == summary["evicted"]["blocks"]  # type: ignore[index]


def test_ctrl_c_reports_what_was_done_and_exits_130(
    unbounded_tier: RunningService, tmp_path: Path
) -> None:
    running = unbounded_tier
    stored_before = running.tier.stats().block_bytes_stored
    command = [
        sys.executable,
        "-m",
        "kvstore.cli",
        "replay",
        "--trace",
        str(DEV_TRACE),
        "--limit",
        "400",
        "--address",
        running.address,
        "--no-progress",
        "--report-dir",
        str(tmp_path / "report"),
    ]
    child = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert child.stdout is not None
    for line in child.stdout:  # started serving: the engines are at work
        if line.startswith("replaying against"):
            break
    else:
        pytest.fail(f"no replay started: {child.wait()} {child.stderr.read()}")  # type: ignore[union-attr]
    # Interrupt once the engines stored something, long before 400 requests (~40,000
    # blocks) are done.
    while running.tier.stats().block_bytes_stored == stored_before and child.poll() is None:
        time.sleep(0.1)
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 130, err
    assert "Traceback" not in err
    assert "INTERRUPTED" in out and "wrong bytes" in out
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["interrupted"] is True
    assert 0 < summary["requests"] < 400
    assert summary["wrong_bytes"] == 0
    assert summary["oracles"]["infinite"] is not None
