"""Scenario 9, ``gc-lease``: the GC worker expires blocks while readers hold leases on them.

The blocks get a 2-second TTL (traffic class ``chatbot`` in this run's GC policy; the other
classes keep a year) and a GC loop passes every 0.2 s. Leased readers look a block up (taking a
lease), hold it past the TTL, then read it: the read must be bit-exact every time — GC never
frees a leased block. Unleased readers race the GC: a miss is fine, other bytes never are.
Once the readers let go, the GC expires every block and deletes its shard files.
"""

from __future__ import annotations

import random
import threading
import time

import ray
from ray.exceptions import RayError

from kvstore.chaos.ledger import Ledger
from kvstore.chaos.scenarios.base import seconds_or_violation
from kvstore.chaos.table import ScenarioResult
from kvstore.chaos.tier import ChaosTier, wait_until
from kvstore.gc.config import GCConfig
from kvstore.keys import BlockKey
from kvstore.runtime.gc_actors import deploy_gc

TTL_S = 2.0
RACE_SECONDS = 8.0
CLASS = "chatbot"


class _Race:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.leased_reads = 0
        self.leased_ok = 0
        self.leased_freed = 0  # a leased block that was gone: the bug this scenario hunts
        self.unleased_ok = 0
        self.unleased_misses = 0
        self.wrong = 0
        self.errors: list[str] = []
        self.lookups = 0


def _leased_reader(
    tier: ChaosTier, keys: list[BlockKey], ledger: Ledger, race: _Race, seed: int, stop: float
) -> None:
    client = tier.handles.client()
    rng = random.Random(seed)
    while time.monotonic() < stop:
        key = rng.choice(keys)
        try:
            found = client.lookup([key], CLASS)
            with race.lock:
                race.lookups += 1
            if found.hit_blocks == 0 or found.lease is None:
                continue  # already expired: a miss, fine
            time.sleep(rng.uniform(TTL_S + 0.2, TTL_S + 1.2))  # idle past the TTL, leased
            data = client.get_blocks([key], found.lease)[0]
            client.release(found.lease)
        except Exception as error:  # clients never raise for races or node trouble
            with race.lock:
                race.errors.append(f"{type(error).__name__}: {error}")
            continue
        verdict = ledger.classify(key, data)
        with race.lock:
            race.leased_reads += 1
            race.leased_ok += verdict == "ok"
            race.leased_freed += verdict == "miss"
            race.wrong += verdict == "wrong"


def _unleased_reader(
    tier: ChaosTier, keys: list[BlockKey], ledger: Ledger, race: _Race, seed: int, stop: float
) -> None:
    client = tier.handles.client()
    rng = random.Random(seed)
    while time.monotonic() < stop:
        chosen = rng.sample(keys, min(4, len(keys)))
        try:
            reads = client.get_blocks(chosen)
        except Exception as error:
            with race.lock:
                race.errors.append(f"{type(error).__name__}: {error}")
            continue
        check = ledger.check(chosen, reads)
        with race.lock:
            race.unleased_ok += check.ok
            race.unleased_misses += check.misses
            race.wrong += check.wrong
        time.sleep(0.05)


def gc_lease(tier: ChaosTier) -> ScenarioResult:
    result = ScenarioResult("gc-lease", "GC expiring blocks while leased reads run")
    config = tier.config
    keys = tier.put_fresh(40, CLASS)
    ledger = tier.ledger
    policy = GCConfig(
        ttl={"default": "365d", "agent": "365d", CLASS: TTL_S},
        scan_interval_s=0.2,
        delete_batch=8,
    )
    gc = deploy_gc(policy, tier.blockstore_config, run=True)
    race = _Race()
    try:
        stop = time.monotonic() + RACE_SECONDS
        threads = [
            threading.Thread(
                target=_leased_reader, args=(tier, keys, ledger, race, config.seed + i, stop)
            )
            for i in range(3)
        ]
        threads.append(
            threading.Thread(
                target=_unleased_reader, args=(tier, keys, ledger, race, config.seed + 9, stop)
            )
        )
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=RACE_SECONDS + 4 * config.call_timeout_s + 10)
        result.faults = int(ray.get(gc.status.remote(), timeout=config.call_timeout_s)["passes"])
        released_at = time.monotonic()
        # Nobody holds a lease now: every block expires within the TTL plus a pass or two.
        # Watched in the index itself: a lookup would touch the blocks and lease them.
        gone = wait_until(
            lambda: not set(keys) & set(tier.placements()),
            TTL_S + config.detect_timeout_s,
            0.3,
        )
        result.detect_s = seconds_or_violation(
            result, gone, "expiry of the released blocks", config.detect_timeout_s
        )
        swept = wait_until(
            lambda: tier.shard_census(keys)["stray"] == 0, config.repair_timeout_s, 0.3
        )
        seconds_or_violation(result, swept, "deleting the expired shards", config.repair_timeout_s)
        result.repair_s = time.monotonic() - released_at if swept is not None else None
        status = ray.get(gc.status.remote(), timeout=config.call_timeout_s)
    finally:
        try:
            ray.kill(gc, no_restart=True)
        except RayError:
            pass
    after = tier.client.get_blocks(keys)
    result.wrong_bytes += sum(
        ledger.classify(key, data) == "wrong" for key, data in zip(keys, after, strict=True)
    )
    result.expected_misses += sum(data is None for data in after)
    result.require(all(data is None for data in after), "expired blocks still readable")
    ledger.forget(keys)  # expired by policy: gone legitimately
    result.operations += race.lookups + race.leased_reads + race.unleased_ok
    result.operations += race.unleased_misses + len(keys)
    result.reads_ok += race.leased_ok + race.unleased_ok
    result.wrong_bytes += race.wrong
    result.failed_reads += race.leased_freed
    result.expected_misses += race.unleased_misses
    result.details.update(
        leased_reads=race.leased_reads,
        leased_ok=race.leased_ok,
        leased_freed=race.leased_freed,
        unleased_ok=race.unleased_ok,
        unleased_misses=race.unleased_misses,
        gc_passes=status["passes"],
        gc_failures=status["failures"],
    )
    result.require(race.leased_reads > 0, "no leased read raced the GC")
    result.require(not race.errors, f"clients raised: {race.errors[:3]}")
    final = tier.read(reader=tier.fresh_reader())
    result.operations += len(ledger)
    result.wrong_bytes += final.wrong
    result.blocks_lost = final.misses
    return result
