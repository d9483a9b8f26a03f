"""Shared pieces of the engine-side tests: a small geometry, a file tier, a staging area.

The tier is ``kvstore.tier.files.DirectoryTier``: real checksummed files under ``tmp_path``
that the fetcher process (a real spawned process) reads. The staging area is a real file in
/dev/shm. Nothing here is faked except the GPU (tests run on the CPU path; CUDA tests skip).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from kvstore.engine.kvlayout import KVLayout
from kvstore.engine.staging import StagingArea
from kvstore.geometry import GeometryConfig
from kvstore.keys import BlockKey, block_keys
from kvstore.tier.files import DirectoryTier


@dataclass
class StoredPrompt:
    """A prompt whose blocks (and one state) were written to the tier, with the exact bytes."""

    tokens: np.ndarray
    keys: list[BlockKey]
    payloads: list[np.ndarray]
    state: np.ndarray | None
    state_position: int | None


@pytest.fixture
def geometry() -> GeometryConfig:
    return GeometryConfig(num_state_seqs=4)


@pytest.fixture
def kv(geometry: GeometryConfig) -> KVLayout:
    return KVLayout.from_geometry(geometry)


@pytest.fixture
def tier(tmp_path, geometry: GeometryConfig, kv: KVLayout) -> DirectoryTier:
    assert kv.state_bytes == geometry.state_size_to_disk
    return DirectoryTier(tmp_path / "tier", geometry)


@pytest.fixture
def area() -> Iterator[StagingArea]:
    staging = StagingArea(64 << 20)
    try:
        yield staging
    finally:
        staging.close()


def store_prompt(
    tier: DirectoryTier,
    geometry: GeometryConfig,
    kv: KVLayout,
    num_tokens: int,
    *,
    seed: int = 0,
    state_at: int | None = None,
) -> StoredPrompt:
    """Random tokens; every full block and (optionally) the state at ``state_at`` put to the
    tier as random bytes."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, num_tokens)
    keys = block_keys(geometry.fingerprint(), tokens)
    payloads = [rng.integers(0, 256, kv.block_bytes, dtype=np.uint8) for _ in keys]
    tier.put_blocks(keys, [p.tobytes() for p in payloads])
    state = None
    if state_at is not None:
        state = rng.integers(0, 256, kv.state_bytes, dtype=np.uint8)
        tier.put_swa_state(keys[state_at // 128 - 1], state_at, state.tobytes())
    return StoredPrompt(tokens, keys, payloads, state, state_at)


@pytest.fixture
def store(tier: DirectoryTier, geometry: GeometryConfig, kv: KVLayout):
    """``store(num_tokens, seed=..., state_at=...) -> StoredPrompt`` into this test's tier."""

    def put(num_tokens: int, *, seed: int = 0, state_at: int | None = None) -> StoredPrompt:
        return store_prompt(tier, geometry, kv, num_tokens, seed=seed, state_at=state_at)

    return put
