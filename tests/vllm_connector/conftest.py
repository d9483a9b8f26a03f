"""Fixtures of the vLLM connector tests (helpers in ``vllm_harness``): the tiny model and a
real ``kvstore up`` for the module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_harness import PROMPTS, SHAPE, run_engine, start_tier

from kvstore.integrations.tiny_model import build_tiny_llama
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
