"""Fixtures of the vLLM connector tests (helpers in ``vllm_harness``): the tiny models (a dense
Llama, a hybrid Gemma-3), their connector-off outputs, and a real ``kvstore up`` per module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_harness import GEMMA, HYBRID_PROMPTS, PROMPTS, SHAPE, run_engine, start_tier

from kvstore.engine.tiny_gemma import build_tiny_gemma3
from kvstore.engine.tiny_model import build_tiny_llama
from kvstore.runtime.upprocess import TierProcess


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), SHAPE)


@pytest.fixture(scope="module")
def running_tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TierProcess]:
    root = tmp_path_factory.mktemp("tier")
    tier = start_tier(root / "data", root / "kvstore-up.log")
    try:
        yield tier
    finally:
        tier.stop()


@pytest.fixture(scope="module")
def baseline(tiny_model: Path, tmp_path_factory) -> dict:
    """The same prompts in an engine without the connector."""
    return run_engine(tiny_model, PROMPTS, None, tmp=tmp_path_factory.mktemp("baseline"))


@pytest.fixture(scope="session")
def tiny_gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"), GEMMA)


@pytest.fixture(scope="session")
def hybrid_oracle(tiny_gemma: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The hybrid prompts without a connector, vLLM's own prefix cache on, each served twice:
    the first pass is the cold output, the second what vLLM's own cache reuses."""
    both = run_engine(
        tiny_gemma,
        HYBRID_PROMPTS + HYBRID_PROMPTS,
        None,
        tmp=tmp_path_factory.mktemp("hybrid-oracle"),
        extra={"prefix_caching": True},
    )
    count = len(HYBRID_PROMPTS)
    return {"cold": {"results": both["results"][:count]}, "warm": both["results"][count:]}
