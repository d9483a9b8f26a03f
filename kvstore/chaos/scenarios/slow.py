"""Scenario 10, ``slow-node``: one storage node answers every read late.

The node is swapped (same data dir, same machine) for the delayed variant of the storage node
actor. One reader (a client that lives through the change) reads single blocks; the node is
slow or not in alternating short stretches, so both samples see the same noise of a shared
host. Hedged reads — ask the k fastest nodes, ask the rest after a short delay, rank nodes seen
slow last — must keep the get p99 with the slow node within 2x of the p99 without it, and the
typical read must not wait for the slow node at all.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import numpy as np
import ray

from kvstore.blockstore.client import BlockStoreClient
from kvstore.chaos.faults import make_normal, make_slow
from kvstore.chaos.table import ScenarioResult
from kvstore.chaos.tier import ChaosTier
from kvstore.keys import BlockKey

DELAY_S = 0.5
STRETCHES = 16
READS_PER_STRETCH = 20
WARMUP_READS = 20


def _timed_reads(
    tier: ChaosTier,
    client: BlockStoreClient,
    keys: Sequence[bytes],
    count: int,
    rng: random.Random,
    result: ScenarioResult,
) -> list[float]:
    latencies = []
    for _ in range(count):
        key = rng.choice(keys)
        started = time.perf_counter()
        data = client.get_blocks([key])[0]
        latencies.append(time.perf_counter() - started)
        verdict = tier.ledger.classify(key, data)
        result.operations += 1
        result.reads_ok += verdict == "ok"
        result.failed_reads += verdict == "miss"
        result.wrong_bytes += verdict == "wrong"
    return latencies


def slow_node(tier: ChaosTier) -> ScenarioResult:
    result = ScenarioResult("slow-node", "a slow node: hedged reads keep get p99 within 2x")
    config = tier.config
    rng = random.Random(config.seed + 10)
    keys = tier.put_fresh(32)
    victim = rng.choice(sorted(tier.handles.nodes))
    # The swaps are restarts, not failures: the repair loop stays paused until the node is
    # back to normal (a probe of the swapped node in between declared it dead and moved all
    # its shards away, leaving nothing slow to read).
    tier.pause_repair(True)
    try:
        return _with_slow_node(tier, result, victim, keys, rng)
    finally:
        tier.pause_repair(False)


def _with_slow_node(
    tier: ChaosTier,
    result: ScenarioResult,
    victim: int,
    keys: list[BlockKey],
    rng: random.Random,
) -> ScenarioResult:
    slow = make_slow(tier, victim, 0.0)
    # A client made after the swap: one from before would find the old node's socket gone
    # and skip the node for node_retry_s (the whole run takes ~4 s on the direct sockets).
    client = tier.handles.client()
    placements = tier.placements()
    placed = sum(1 for key in keys if victim in placements[key])
    result.require(placed > 0, f"node {victim} holds no shard of the blocks read")
    _timed_reads(tier, client, keys, WARMUP_READS, rng, result)
    normal: list[float] = []
    delayed: list[float] = []
    first_slow: list[float] = []
    try:
        for stretch in range(STRETCHES):
            is_slow = stretch % 2 == 1
            ray.get(slow.set_delay.remote(DELAY_S if is_slow else 0.0), timeout=30)
            result.faults += is_slow
            latencies = _timed_reads(tier, client, keys, READS_PER_STRETCH, rng, result)
            if stretch == 1:
                first_slow = latencies  # the client had not seen the node slow yet
            (delayed if is_slow else normal).extend(latencies)
    finally:
        make_normal(tier, victim)
    p99_normal = float(np.percentile(normal, 99))
    p99_slow = float(np.percentile(delayed, 99))
    p50_slow = float(np.percentile(delayed, 50))
    result.details.update(
        victim=victim,
        delay_ms=DELAY_S * 1e3,
        reads=len(normal) + len(delayed),
        get_p50_normal_ms=round(float(np.percentile(normal, 50)) * 1e3, 2),
        get_p99_normal_ms=round(p99_normal * 1e3, 2),
        get_p50_slow_ms=round(p50_slow * 1e3, 2),
        get_p99_slow_ms=round(p99_slow * 1e3, 2),
        first_slow_stretch_max_ms=round(max(first_slow) * 1e3, 2) if first_slow else None,
        hedged_reads=int(client.counters.get("hedged_reads", 0)),
        ratio=round(p99_slow / p99_normal, 2),
    )
    result.require(
        p99_slow <= 2 * p99_normal,
        f"get p99 {p99_slow * 1e3:.1f} ms with a slow node vs {p99_normal * 1e3:.1f} ms normal",
    )
    result.require(
        p50_slow < DELAY_S / 2,
        f"the typical read waited for the slow node (p50 {p50_slow * 1e3:.0f} ms)",
    )
    final = tier.read(reader=tier.fresh_reader())
    result.operations += len(tier.ledger)
    result.wrong_bytes += final.wrong
    result.blocks_lost = final.misses
    return result
