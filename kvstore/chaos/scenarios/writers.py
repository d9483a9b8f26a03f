"""Scenario 8, ``writer``: writer processes killed in the middle of their puts.

Four writer actors are killed by ``ray.kill`` at random moments of a put loop (once each has
stored a random part of its blocks, so the kill lands in the loop however fast puts are), and one
dies at the worst moment on purpose: with every shard written, and so committed, on its node but
the block not yet in its meta shard's index. Afterwards each block a writer attempted is either
fully visible and bit-exact or a clean miss, and once the writers' reservations lapse the orphan
scrub reclaims every unindexed (and any pending) shard: nodes hold exactly the shards the index
points at.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from typing import Any

import ray
from ray.exceptions import RayError

from kvstore.blockstore.client import BlockStoreClient
from kvstore.blockstore.config import BlockStoreConfig
from kvstore.chaos.ledger import payload_for
from kvstore.chaos.table import ScenarioResult
from kvstore.chaos.tier import ChaosTier
from kvstore.keys import BlockKey
from kvstore.runtime.cluster import pin_to_machine
from kvstore.runtime.deploy import BlockStoreHandles

#: Blocks a writer attempts at most, in batches (the driver checks all of them afterwards).
WRITER_BLOCKS = 480
WRITER_BATCH = 8
#: Where a writer dies on purpose (None: wherever the kill finds it).
DIE_AT = (None, None, None, None, "_commit_in_meta")
#: A killed writer is killed once it has stored this many blocks or more (at random in the
#: range): at most a quarter of its blocks, so most of its loop is still ahead of the kill.
KILL_AFTER_BLOCKS = (WRITER_BATCH, WRITER_BLOCKS // 4)
#: How often the driver asks a writer how far it got.
PROGRESS_POLL_S = 0.002


def writer_key(writer: int, seed: int, index: int) -> BlockKey:
    return BlockKey(
        hashlib.blake2b(b"chaos-writer-%d-%d-%d" % (seed, writer, index), digest_size=32).digest()
    )


def _dying_client(die_at: str | None) -> type[BlockStoreClient]:
    if die_at is None:
        return BlockStoreClient

    def die(self: Any, *args: Any, **kwargs: Any) -> Any:
        os._exit(1)  # the process ends here, mid-put

    return type("DyingClient", (BlockStoreClient,), {die_at: die})


@ray.remote(num_cpus=0, max_restarts=0)
class ChaosWriter:
    """Puts ``WRITER_BLOCKS`` blocks in batches until done or killed."""

    def __init__(self, config: BlockStoreConfig, die_at: str | None, block_bytes: int) -> None:
        handles = BlockStoreHandles.from_names(config)
        client_class = _dying_client(die_at)
        self._client = client_class(config, handles.fanout(), node_ids=sorted(handles.nodes))
        self._block_bytes = block_bytes
        self._stored = 0

    def ping(self) -> bool:
        return True

    def progress(self) -> int:
        """Blocks stored so far."""
        return self._stored

    def run(self, writer: int, seed: int) -> int:
        # Payloads are made up front, so the loop the kill lands in is puts and nothing else.
        keys = [writer_key(writer, seed, i) for i in range(WRITER_BLOCKS)]
        payloads = [payload_for(key, self._block_bytes) for key in keys]
        for start in range(0, WRITER_BLOCKS, WRITER_BATCH):
            batch = slice(start, start + WRITER_BATCH)
            self._stored += len(self._client.put_blocks(keys[batch], payloads[batch]).stored)
        return self._stored


def _kill_once_progressed(actor: Any, run: Any, target: int) -> None:
    """``ray.kill`` the writer once it has stored ``target`` blocks (or at once if it finished)."""
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        ready, _ = ray.wait([run], timeout=0)
        if ready or ray.get(actor.progress.remote(), timeout=60) >= target:
            break
        time.sleep(PROGRESS_POLL_S)
    ray.kill(actor, no_restart=True)


def writer_killed(tier: ChaosTier) -> ScenarioResult:
    result = ScenarioResult("writer", "kill writers mid-put: nothing partial, space reclaimed")
    config = tier.config
    rng = random.Random(config.seed + 8)
    machines = [tier.machine_of_node(n) for n in tier.crashable_nodes(allow_swa=True)]
    machines = machines or [tier.cluster.machines[-1]]
    usage_before = tier.node_usage()
    attempted: list[BlockKey] = []
    outcomes = []
    for writer, die_at in enumerate(DIE_AT):
        actor = ChaosWriter.options(  # type: ignore[attr-defined]
            max_concurrency=2,  # two threads: ``progress`` answers while ``run`` puts
            **pin_to_machine(machines[writer % len(machines)]),
        ).remote(tier.blockstore_config, die_at, config.block_bytes)
        ray.get(actor.ping.remote(), timeout=120)
        run = actor.run.remote(writer, config.seed)
        if die_at is None:
            _kill_once_progressed(actor, run, rng.randint(*KILL_AFTER_BLOCKS))
        try:
            stored = ray.get(run, timeout=config.repair_timeout_s)
            outcomes.append(f"finished ({stored} blocks)")
        except RayError as error:
            outcomes.append(f"died ({type(error).__name__})")
        result.faults += 1
        attempted.extend(writer_key(writer, config.seed, i) for i in range(WRITER_BLOCKS))
    result.details["writers"] = outcomes
    result.require(
        sum(o.startswith("died") for o in outcomes) >= len(DIE_AT) - 1,
        f"the writers were not killed mid-put: {outcomes}",
    )
    usage_killed = tier.node_usage()
    result.details["pending_after_kills"] = usage_killed["pending"]

    # Nothing partial: each attempted block is whole and exact, or a miss.
    reads = []
    for start in range(0, len(attempted), 64):
        reads.extend(tier.client.get_blocks(attempted[start : start + 64]))
    result.operations += len(attempted)
    visible = [key for key, data in zip(attempted, reads, strict=True) if data is not None]
    for key, data in zip(attempted, reads, strict=True):
        if data is not None and data.tobytes() != payload_for(key, config.block_bytes).tobytes():
            result.wrong_bytes += 1
    result.reads_ok += len(visible) - result.wrong_bytes
    placements = tier.placements()
    partial = [key for key in visible if sum(1 for n in placements.get(key, ()) if n >= 0) != 12]
    result.require(not partial, f"{len(partial)} visible blocks are not whole stripes")
    lookup_hits = sum(
        tier.client.lookup([key]).hit_blocks for key in attempted if key not in set(visible)
    )
    result.require(lookup_hits == 0, f"{lookup_hits} unreadable blocks are visible to lookup")
    tier.ledger.add(visible, config.block_bytes)
    result.details["attempted"] = len(attempted)
    result.details["visible"] = len(visible)

    # Space reclaimed: after the reservations lapse, the orphan scrub removes every leftover.
    time.sleep(config.put_reservation_s + 0.5)
    reclaim_started = time.monotonic()
    reclaimed = ray.get(
        [h.reclaim_orphans.remote(0.0) for h in tier.handles.nodes.values()],
        timeout=config.call_timeout_s * 10,
    )
    result.detect_s = None  # nothing to detect: the scrub is run on purpose, once
    result.repair_s = time.monotonic() - reclaim_started
    usage_after = tier.node_usage()
    census = tier.shard_census()
    own = tier.shard_census(attempted)
    expected_shards = sum(sum(1 for n in p if n >= 0) for p in tier.placements().values())
    # Reclaimed shards are dead bytes in the nodes' logs at once (``live_bytes`` drops), and
    # compaction hands the disk space back as their segments empty.
    result.details["space"] = {
        "bytes_before": usage_before["live_bytes"],
        "bytes_after_kills": usage_killed["live_bytes"],
        "bytes_after_reclaim": usage_after["live_bytes"],
        "pending_reclaimed": sum(r["pending_reclaimed"] for r in reclaimed),
        "unindexed_reclaimed": sum(r["committed_reclaimed"] for r in reclaimed),
        "skipped": sum(r.get("skipped", 0) for r in reclaimed),
    }
    result.require(usage_after["pending"] == 0, f"{usage_after['pending']} pending files left")
    result.require(census["stray"] == 0, f"{census['stray']} unindexed shard files left")
    result.details["census"] = {"all": census, "writers": own, "expected_shards": expected_shards}
    result.require(own["missing"] == 0, f"{own['missing']} shards of visible blocks missing")
    result.require(
        result.details["space"]["unindexed_reclaimed"] > 0,
        "the killed writers left nothing to reclaim (the kills missed the put)",
    )
    final = tier.read(reader=tier.fresh_reader())
    result.operations += len(tier.ledger)
    result.wrong_bytes += final.wrong
    result.blocks_lost = final.misses
    return result
