"""A simulated inference engine that uses kvstore the way a real one would, through the tier seam
(``kvstore.tier.protocols.EngineTier``: in the demo, the gRPC client).

Per request it asks ``QueryHit`` how much of the prompt is cached, loads the hit blocks it does not
already hold in its own (simulated) GPU prefix cache with ``GetBlocks``, fetches the SWA state when
the plan says so, "computes" the rest, and saves the new full blocks and the docs/rules.md §6 state
snapshot. Payloads are a pure function of the block key, so every byte read back is checked: a
wrong byte is counted, never hidden.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from kvstore.demo.workload import Request
from kvstore.keys import BLOCK_TOKENS, BlockKey, block_keys
from kvstore.tier.protocols import EngineTier
from kvstore.tier.records import HitRequest


def expected_payload(key: bytes, size: int) -> bytes:
    """The bytes a block (or state) with this key must hold: seeded by the key, so checkable."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).bytes(size)


@dataclass
class RequestOutcome:
    index: int
    at_s: float
    traffic_class: str
    prompt_tokens: int
    hit_tokens: int
    block_hit_tokens: int
    swa_hit: bool
    advice: str | None
    blocks_fetched: int
    blocks_from_local: int
    load_errors: int
    wrong_bytes: int
    degraded_reads: int
    blocks_put: int
    query_hit_s: float
    fetch_s: float | None
    after_failure: bool


@dataclass
class EngineCache:
    """The engine's own GPU prefix cache: keys only, LRU (the bytes are checked then dropped)."""

    capacity_blocks: int
    _keys: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    def __contains__(self, key: bytes) -> bool:
        if key in self._keys:
            self._keys.move_to_end(key)
            return True
        return False

    def add(self, key: bytes) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.capacity_blocks:
            self._keys.popitem(last=False)


class SimEngine:
    def __init__(
        self,
        name: str,
        tier: EngineTier,
        model_fingerprint: bytes,
        block_bytes: int,
        state_bytes: int,
        cache_blocks: int = 1_500,
        mode: str = "standard",
    ) -> None:
        self.name = name
        self._tier = tier
        self._fingerprint = model_fingerprint
        self._block_bytes = block_bytes
        self._state_bytes = state_bytes
        self._cache = EngineCache(cache_blocks)
        self._mode = mode

    def serve(self, index: int, request: Request, after_failure: bool) -> RequestOutcome:
        keys = block_keys(self._fingerprint, request.tokens)
        started = time.perf_counter()
        answer = self._tier.query_hit(
            HitRequest(
                block_keys=keys,
                prompt_len=request.prompt_len,
                mode=self._mode,
                traffic_class=request.traffic_class,
                take_lease=True,
            )
        )
        query_s = time.perf_counter() - started
        plan = answer.plan
        hit_blocks = plan.hit_tokens // BLOCK_TOKENS
        wanted = [key for key in keys[:hit_blocks] if key not in self._cache]
        wrong = load_errors = degraded = 0
        fetch_s: float | None = None
        if wanted:
            started = time.perf_counter()
            reads = self._tier.get_blocks(wanted, lease_id=answer.lease_id)
            fetch_s = time.perf_counter() - started
            for read in reads:
                if read.payload is None:
                    load_errors += 1  # the engine recomputes this block: a miss, not an error
                    continue
                if read.payload != expected_payload(read.key, self._block_bytes):
                    wrong += 1
                degraded += int(read.degraded)
                self._cache.add(read.key)
        elif answer.lease_id:
            self._tier.release_lease(answer.lease_id)
        if load_errors:
            # Blocks that failed to load are recomputed from the first failure on.
            first_bad = next(i for i, key in enumerate(keys[:hit_blocks]) if key not in self._cache)
            compute_from = first_bad * BLOCK_TOKENS
        else:
            compute_from = plan.compute_from
            if plan.swa_hit and plan.swa_position is not None:
                state_key = state_key_at(keys, plan.swa_position)
                state = self._tier.get_swa_state(state_key, plan.swa_position)
                if state.state is not None and state.state != expected_payload(
                    state_key, self._state_bytes
                ):
                    wrong += 1
        new_keys = keys[compute_from // BLOCK_TOKENS :]
        fresh = [key for key in new_keys if key not in self._cache]
        if fresh:
            self._tier.put_blocks(
                fresh,
                [expected_payload(key, self._block_bytes) for key in fresh],
                request.traffic_class,
            )
            for key in fresh:
                self._cache.add(key)
        if plan.store_at is not None:
            state_key = state_key_at(keys, plan.store_at)
            self._tier.put_swa_state(
                state_key, plan.store_at, expected_payload(state_key, self._state_bytes)
            )
        return RequestOutcome(
            index=index,
            at_s=request.at_s,
            traffic_class=request.traffic_class,
            prompt_tokens=request.prompt_len,
            hit_tokens=plan.hit_tokens if not load_errors else compute_from,
            block_hit_tokens=plan.block_hit_tokens,
            swa_hit=plan.swa_hit,
            advice=answer.advice,
            blocks_fetched=len(wanted),
            blocks_from_local=hit_blocks - len(wanted),
            load_errors=load_errors,
            wrong_bytes=wrong,
            degraded_reads=degraded,
            blocks_put=len(fresh),
            query_hit_s=query_s,
            fetch_s=fetch_s,
            after_failure=after_failure,
        )


def state_key_at(keys: list[BlockKey], position: int) -> BlockKey:
    """The SWA state at aligned ``position`` is keyed by the block ending there."""
    return keys[position // BLOCK_TOKENS - 1]
