"""A slow tier never makes a request slower than cold: a fresh engine's first hit on a distant
tier is recomputed, and its log says so (issue 32 item 4).

The tier (``kvstore.testbed.distant``): a real ``kvstore up`` on one network-namespace host,
the engine under test on another, every byte between them through a 500 kB/s token bucket
each way (a distant tier: its gateway and its blocks alike behind the link). Engine A, on the
tier's own host, serves a long prompt (its measured prefill rate), the prompt, and two short
prompts whose lookups carry that rate to the tier. Engine B, fresh, on the far host, serves
the prompt: it has measured nothing itself, so it weighs one probed block (cut at its budget:
two blocks' compute) against the tier's figure for the model, and computes the prompt instead
of loading its 640 cached tokens, with the tokens and logprobs of an engine without the
connector. Needs root (network namespaces) and vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (see .ci/run: its own venv)")

from vllm_harness import PROMPTS, assert_same_outputs, child_env, run_engine, tokens  # noqa: E402

from kvstore.testbed.distant import CLIENT, TIER, DistantTier  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.hosts, pytest.mark.timeout(1800)]

#: The link's cap, each way: loading the prompt's 640 KiB takes 1.3 s, computing it well under.
LINK_BYTES_PER_S = 500e3
PROMPT = PROMPTS[4]  # 650 tokens: 5 blocks cached


@pytest.fixture(scope="module")
def distant(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DistantTier]:
    root = tmp_path_factory.mktemp("distant")
    env = dict(child_env(), KVSTORE_BLOCKSTORE_SCRUB_BYTES_PER_S="0")
    tier = DistantTier.start(root / "data", bytes_per_s=LINK_BYTES_PER_S, env=env)
    try:
        yield tier
    finally:
        left = tier.stop()
    assert left == [], f"the distant tier left {left}"


def connector_config(distant: DistantTier) -> dict:
    return {"address": distant.address, "lookup_timeout_s": 20.0, "retry_after_s": 30.0}


def test_a_fresh_engines_first_hit_on_a_slow_tier_is_recomputed_and_logged(
    tiny_model: Path, distant: DistantTier, tmp_path: Path
) -> None:
    clean = run_engine(tiny_model, [PROMPT], None, tmp=tmp_path)
    near = run_engine(
        tiny_model,
        [tokens(1024), PROMPT, tokens(300), tokens(300)],
        connector_config(distant),
        tmp=tmp_path,
        prefix=distant.on(TIER),
    )
    assert near["worker"]["saves_failed"] == 0 and near["worker"]["blocks_saved"] >= 5
    fresh = run_engine(
        tiny_model, [PROMPT], connector_config(distant), tmp=tmp_path, prefix=distant.on(CLIENT)
    )
    said = [line for line in fresh["stderr"].splitlines() if "cached in the tier" in line]
    (result,) = fresh["results"]
    assert result["num_cached_tokens"] == 0, f"the slow tier's hit was loaded: {said}"
    assert fresh["worker"]["loads"] == 0 and fresh["worker"]["blocks_saved"] == 0, fresh["worker"]
    assert len(said) == 1 and "640 tokens cached in the tier: recomputing" in said[0], said
    assert "the tier's figure for this model" in said[0] and "(probed)" in said[0], said
    assert "recomputed instead of loaded while the tier is this slow" in said[0]
    assert_same_outputs(fresh, clean, "the fresh engine on the slow tier")
