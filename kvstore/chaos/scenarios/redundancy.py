"""Scenarios 15-16: redundancy at fleet scale — how fast a lost node is restored, and a node
taken out of service without a stripe ever short of shards (17, the background scrub, is in
``scrub.py``).

15. ``repair-rate``: a storage node holding >= 500 MB of shards is lost for good (its machine
    crashes, its data dir is erased) while a read load runs. The row reports the restore rate
    (shard bytes restored / wall time from detection to full redundancy), the detection time,
    and the foreground get p50/p99 over ~10 s before the loss against the same load during the
    repair. Promised: every block reads back bit-exact, none lost. The issue's targets
    (restored >= 50 MB/s, p99 during <= 2x p99 before) are reported in ``details["targets"]``,
    met or not; they are the repair's tuning goals, not broken promises.
16. ``drain``: under read and write load a node is drained. Every ~0.2 s the scenario reads every
    ledger block's placement from the meta index and the live nodes, and counts stripes with
    fewer than 12 placed shards on live nodes (there must be none: a moved shard is committed
    before its placement moves); a few samples also ask the nodes whether they hold the shards
    the index names. At the end the drain is done, nothing is placed on the node, puts made
    during the drain never placed a shard there, and once undrained a new put uses it again.
"""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayError

from kvstore.blockstore.segments import RECORD_BYTES
from kvstore.chaos.faults import crash_machine
from kvstore.chaos.load import LoadConfig, LoadGenerator, LoadStats
from kvstore.chaos.scenarios.base import absorb_load, seconds_or_violation
from kvstore.chaos.scenarios.log import _evict
from kvstore.chaos.table import ScenarioResult
from kvstore.chaos.tier import ChaosTier, wait_until
from kvstore.ec import Codec
from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey

log = logging.getLogger(__name__)

_MB = 1_000_000
_MIB = 1 << 20

# --- repair-rate ---------------------------------------------------------------------------------

#: The lost node holds at least this many bytes of shards.
LOSS_NODE_BYTES = 500 * _MB
#: Fill blocks: an engine block of a bigger model than the chaos default (fewer, larger puts
#: fill the disks faster; each 10+2 shard is ~128 KiB).
FILL_BLOCK_BYTES = 1280 * 1024
FILL_WRITERS = 2
FILL_BATCH = 4
#: Blocks a put did not store are put again, up to this share of the count asked for.
FILL_RETRIES = 0.5
FILL_TIMEOUT_S = 1200.0
#: Top-ups when the fullest crashable node is still short of ``LOSS_NODE_BYTES``.
FILL_TOP_UPS = 4
#: Free disk wanted before filling, as a multiple of what the fill writes.
DISK_HEADROOM = 2.0
WARMUP_S = 2.0
BASELINE_S = 10.0
#: The repair may take at most its bytes at this rate (or the config's repair timeout) ...
REPAIR_FLOOR_BYTES_PER_S = 2 * _MIB
#: ... and never longer than this.
REPAIR_RATE_TIMEOUT_S = 900.0
#: The issue's targets (reported, not promised).
TARGET_RESTORED_MB_S = 50.0
TARGET_P99_RATIO = 2.0

# --- drain ---------------------------------------------------------------------------------------

DRAIN_SEED_BLOCKS = 96
#: The drained node holds at least this many repair rounds of shards (``repair_stripes_per_round``
#: each), so the samples see shards move in several steps, not one.
DRAIN_ROUNDS = 4
#: The repair's byte cap during the drain is set so the drain lasts about this long: long
#: enough for a few dozen samples of the placements while shards move.
DRAIN_TARGET_S = 6.0
DRAIN_MIN_RATE = 64 * 1024
DRAIN_TIMEOUT_S = 120.0
SAMPLE_EVERY_S = 0.2
MAX_SAMPLES = 600
#: Every this many samples, a physical check (the nodes asked what they hold) ...
PHYSICAL_EVERY = 5
#: ... at most this many times, of this many ledger blocks each.
PHYSICAL_CHECKS = 6
PHYSICAL_KEYS = 32
UNDRAIN_TIMEOUT_S = 30.0


def _delta(after: dict[str, Any], before: dict[str, Any], name: str) -> float:
    return float(after.get(name, 0) or 0) - float(before.get(name, 0) or 0)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _absorb(result: ScenarioResult, tier: ChaosTier, stats: LoadStats) -> None:
    """``absorb_load``, every miss a failed read (one node down at most: the promise covers
    them all), and the first missed blocks' placements now, for whoever debugs a miss."""
    absorb_load(result, stats)
    result.failed_reads += stats.read_misses
    if stats.missed_keys:
        placements = tier.placements()
        result.details["load_missed"] = [
            {"key": key.hex()[:16], "placement": placements.get(key)}
            for key in stats.missed_keys[:5]
        ]


# --- filling the disks fast ----------------------------------------------------------------------


@dataclass
class _Fill:
    keys: list[BlockKey] = field(default_factory=list)
    #: Blocks a put did not store (tried again with fresh keys, up to ``FILL_RETRIES``).
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _fill(tier: ChaosTier, blocks: int, size: int, deadline: float) -> _Fill:
    """Commit ``blocks`` fresh blocks of ``size`` bytes with ``FILL_WRITERS`` parallel writers
    (each its own tier facade), bounded by ``deadline``; committed ones enter the ledger.

    Blocks a put did not store are put again under fresh keys, up to ``FILL_RETRIES`` times
    the count asked for: the fill loads a small host to its limit, where a node call may time
    out (the tier then fails the block, as it should); the failures are counted, not hidden.
    """
    outcome = _Fill()
    lock = threading.Lock()
    left = [blocks]  # still to be committed, not yet handed to a writer
    budget = [int(blocks * (1 + FILL_RETRIES))]  # blocks that may be attempted in all
    started = time.monotonic()

    def take() -> int:
        with lock:
            count = min(FILL_BATCH, left[0], budget[0])
            left[0] -= count
            budget[0] -= count
            return count

    def writer(index: int) -> None:
        facade = tier.facade()
        while time.monotonic() < deadline:
            count = take()
            if count <= 0:
                return
            keys = [BlockKey(os.urandom(32)) for _ in range(count)]
            try:
                answer = tier.put(keys, writer=facade, size=size)
                committed = answer.committed_keys(keys)
            except Exception as error:  # counted: a healthy tier must not raise
                committed = []
                with lock:
                    outcome.errors.append(f"writer {index}: {type(error).__name__}: {error}")
            with lock:
                outcome.keys.extend(committed)
                outcome.failed += count - len(committed)
                left[0] += count - len(committed)

    threads = [
        threading.Thread(target=writer, args=(i,), name=f"chaos-fill-{i}", daemon=True)
        for i in range(FILL_WRITERS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max(1.0, deadline - time.monotonic()) + tier.config.call_timeout_s * 4)
    if any(thread.is_alive() for thread in threads):
        outcome.errors.append("fill writers still running after the deadline")
    outcome.seconds = time.monotonic() - started
    return outcome


def _fullest(tier: ChaosTier, candidates: list[int]) -> tuple[int, int]:
    """The candidate node holding the most live shard bytes, and how many."""
    usage = tier.usage_by_node()
    node = max(candidates, key=lambda n: usage.get(n, {}).get("live_bytes", 0))
    return node, int(usage.get(node, {}).get("live_bytes", 0))


def repair_rate(tier: ChaosTier) -> ScenarioResult:
    result = ScenarioResult("repair-rate", "lose a node holding 500 MB: restore rate, get p99")
    config = tier.config
    bconfig = tier.blockstore_config
    nodes = len(tier.handles.nodes)
    width = bconfig.stripe_width
    shard_bytes = Codec(bconfig.data_shards, bconfig.parity_shards).shard_length(FILL_BLOCK_BYTES)
    on_disk = shard_bytes + RECORD_BYTES
    # A node holds width/nodes of every stripe's shards; aim a little above the mean so the
    # fullest crashable node is past the mark after one fill.
    planned = math.ceil(LOSS_NODE_BYTES * nodes / (width * on_disk) * 1.05)
    needed = planned * width * on_disk
    free = shutil.disk_usage(config.data_root).free
    result.details.update(
        block_bytes=FILL_BLOCK_BYTES,
        shard_bytes=shard_bytes,
        planned_blocks=planned,
        fill_bytes_on_disk=needed,
        disk_free_bytes=free,
    )
    if not result.require(
        free >= DISK_HEADROOM * needed,
        f"refused: filling {planned} blocks of {FILL_BLOCK_BYTES} B writes "
        f"{needed / 1e9:.1f} GB of shards under {config.data_root}; it has "
        f"{free / 1e9:.1f} GB free, {DISK_HEADROOM:.0f}x that is wanted",
    ):
        return result
    candidates = tier.crashable_nodes()
    if not result.require(bool(candidates), "no storage node whose machine may be crashed"):
        return result

    deadline = time.monotonic() + FILL_TIMEOUT_S
    fill = _fill(tier, planned, FILL_BLOCK_BYTES, deadline)
    victim, victim_bytes = _fullest(tier, candidates)
    top_ups = 0
    while victim_bytes < LOSS_NODE_BYTES and top_ups < FILL_TOP_UPS:
        top_ups += 1
        more = _fill(tier, max(FILL_BATCH, planned // 20), FILL_BLOCK_BYTES, deadline)
        fill.keys += more.keys
        fill.failed += more.failed
        fill.errors += more.errors
        fill.seconds += more.seconds
        victim, victim_bytes = _fullest(tier, candidates)
    filled = list(fill.keys)
    result.operations += len(filled) + fill.failed
    result.details["fill"] = {
        "blocks": len(filled),
        "failed": fill.failed,
        "top_ups": top_ups,
        "seconds": round(fill.seconds, 1),
        "payload_mb_per_s": round(len(filled) * FILL_BLOCK_BYTES / _MB / fill.seconds, 1)
        if fill.seconds
        else None,
        "errors": fill.errors[:3],
    }
    try:
        return _lose_for_good(tier, result, victim, victim_bytes, filled)
    finally:
        _drop(tier, result, filled)


def _lose_for_good(
    tier: ChaosTier,
    result: ScenarioResult,
    victim: int,
    victim_bytes: int,
    filled: list[BlockKey],
) -> ScenarioResult:
    config = tier.config
    fill = result.details["fill"]
    result.require(not fill["errors"], f"the fill's puts raised: {fill['errors']}")
    machine = tier.machine_of_node(victim)
    on_victim = tier.placed_on(victim)
    codec = Codec(tier.blockstore_config.data_shards, tier.blockstore_config.parity_shards)
    lost_bytes = sum(codec.shard_length(tier.ledger.size_of(key)) for key in on_victim)
    result.details.update(
        victim=victim,
        machine=machine,
        victim_live_bytes=victim_bytes,
        shards_on_victim=len(on_victim),
        shard_bytes_on_victim=lost_bytes,
    )
    if not result.require(
        victim_bytes >= LOSS_NODE_BYTES,
        f"the fullest crashable node holds {victim_bytes / _MB:.0f} MB of shards "
        f"(wanted >= {LOSS_NODE_BYTES / _MB:.0f} MB)",
    ):
        return result
    repair_timeout = min(
        REPAIR_RATE_TIMEOUT_S,
        max(config.repair_timeout_s, victim_bytes / REPAIR_FLOOR_BYTES_PER_S),
    )
    load_config = LoadConfig(
        writers=0,
        readers=2,
        get_batch=1,  # one sample per block read
        max_seconds=WARMUP_S + BASELINE_S + config.detect_timeout_s + repair_timeout + 60,
    )
    progress: list[dict[str, Any]] = []
    with LoadGenerator(tier, load_config, seed=config.seed + 15) as load:
        time.sleep(WARMUP_S)
        baseline_at = time.monotonic()
        time.sleep(BASELINE_S)
        before = tier.repair_stats()
        crashed_at = crash_machine(tier, machine)
        shutil.rmtree(tier.data_dir(victim), ignore_errors=True)  # the disk goes with it
        result.faults = 1
        detect = wait_until(lambda: victim in tier.dead_nodes(), config.detect_timeout_s, 0.05)
        detected_at = time.monotonic()
        result.detect_s = seconds_or_violation(
            result, detect, "detecting the lost machine", config.detect_timeout_s
        )
        repaired = None
        if detect is not None:
            repaired = wait_until(_full_and_logged(tier, progress), repair_timeout, 0.5)
            seconds_or_violation(result, repaired, "full redundancy", repair_timeout)
        repaired_at = time.monotonic()
    after = tier.repair_stats()
    stats = load.stats
    _absorb(result, tier, stats)
    repair_s = repaired_at - detected_at
    if repaired is not None:
        result.repair_s = repair_s
    restored = _delta(after, before, "bytes")
    rate = restored / _MB / repair_s if repaired is not None and repair_s > 0 else None
    p99_before = stats.percentile_ms(99, baseline_at, crashed_at)
    p99_during = stats.percentile_ms(99, detected_at, repaired_at)
    ratio = p99_during / p99_before if p99_before and p99_during is not None else None
    result.details.update(
        restored={
            "stripes": _delta(after, before, "stripes"),
            "shards": _delta(after, before, "shards"),
            "bytes": restored,
            "unrecoverable": _delta(after, before, "unrecoverable"),
        },
        restored_mb_per_s=None if rate is None else round(rate, 1),
        # Where the repair's rounds spent this repair (queue, plan, read_rebuild, write, move).
        repair_phase_s={
            phase: round(float(seconds) - float(before.get("phase_s", {}).get(phase, 0.0)), 2)
            for phase, seconds in after.get("phase_s", {}).items()
        },
        repair_timeout_s=round(repair_timeout, 1),
        get_ms={
            "before": _window(stats, baseline_at, crashed_at),
            "undetected": _window(stats, crashed_at, detected_at),
            "during_repair": _window(stats, detected_at, repaired_at),
        },
        p99_ratio=None if ratio is None else round(ratio, 2),
        progress=progress[:3] + progress[-3:] if len(progress) > 6 else progress,
        targets={
            "restored_mb_per_s": {
                "value": None if rate is None else round(rate, 1),
                "target": f">= {TARGET_RESTORED_MB_S:.0f}",
                "met": rate is not None and rate >= TARGET_RESTORED_MB_S,
            },
            "p99_during_over_before": {
                "value": None if ratio is None else round(ratio, 2),
                "target": f"<= {TARGET_P99_RATIO:.0f}",
                "met": ratio is not None and ratio <= TARGET_P99_RATIO,
            },
        },
    )
    result.require(
        repaired is None or restored >= lost_bytes,
        f"the repair counts {restored / _MB:.1f} MB restored; the lost node held "
        f"{lost_bytes / _MB:.1f} MB of the ledger's shards",
    )
    final = tier.read(reader=tier.fresh_reader())
    result.operations += len(tier.ledger)
    result.reads_ok += final.ok
    result.wrong_bytes += final.wrong
    result.blocks_lost = final.misses
    result.require(not tier.placed_on(victim), "blocks still placed on the lost machine")
    tier.restore_machine(machine)  # a replacement joins empty under the same id
    return result


def _full_and_logged(tier: ChaosTier, progress: list[dict[str, Any]]) -> Callable[[], bool]:
    """The repair-rate wait: full redundancy of the ledger; on the way, the repair's progress
    figures every couple of seconds (for the row; ``t``: seconds since the wait began)."""
    began = time.monotonic()
    last = [began - 2.0]

    def condition() -> bool:
        now = time.monotonic()
        if now - last[0] >= 2.0:
            last[0] = now
            figures = tier.repair_stats().get("progress")
            if isinstance(figures, dict):
                progress.append({"t": round(now - began, 1), **figures})
        return tier.redundancy().full == len(tier.ledger)

    return condition


def _window(stats: LoadStats, since: float, until: float) -> dict[str, Any]:
    return {
        "reads": len(stats.latencies(since, until)),
        "p50": _ms(stats.percentile_ms(50, since, until)),
        "p99": _ms(stats.percentile_ms(99, since, until)),
    }


def _drop(tier: ChaosTier, result: ScenarioResult, keys: list[BlockKey]) -> None:
    """Take the fill out of the tier again (index, shards, ledger; compaction reclaims the
    space), so the scenarios after this one start from a tier of the usual size."""
    if not keys:
        return
    try:
        removed: list[bytes] = []
        for start in range(0, len(keys), 1000):
            removed += _evict(tier, keys[start : start + 1000])
        tier.ledger.forget(keys)
        ray.get(
            [handle.compact.remote(1 << 40) for handle in tier.handles.nodes.values()],
            timeout=300,
        )
        result.details["fill_dropped"] = len(removed)
    except (RayError, KVStoreError) as error:
        log.warning("dropping the repair-rate fill: %s", error)
        result.details["fill_dropped"] = f"failed: {error}"


# --- drain ---------------------------------------------------------------------------------------


@dataclass
class _DrainWatch:
    """What the samples taken during a drain saw."""

    samples: int = 0
    samples_while_moving: int = 0
    stripes_checked: int = 0
    short_stripes: int = 0  # fewer than the width of shards placed on live nodes
    missing_from_index: int = 0
    new_puts_on_node: int = 0
    physical_checks: int = 0
    physical_shards: int = 0
    physical_missing: int = 0
    #: Samples where the repair said the drain was done while the index (read after it)
    #: still placed shards on the node.
    done_while_placed: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)
    #: Per sample: the repair's ``stripes_left`` for the node, and the blocks the index still
    #: places on it.
    stripes_left: list[int] = field(default_factory=list)
    placed_left: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        def ends(series: list[int]) -> list[int]:
            return series[:3] + series[-3:] if len(series) > 6 else series

        return {
            "samples": self.samples,
            "samples_while_moving": self.samples_while_moving,
            "stripes_checked": self.stripes_checked,
            "short_stripes": self.short_stripes,
            "missing_from_index": self.missing_from_index,
            "new_puts_on_node": self.new_puts_on_node,
            "physical": {
                "checks": self.physical_checks,
                "shards": self.physical_shards,
                "missing": self.physical_missing,
            },
            "done_while_placed": self.done_while_placed,
            "stripes_left": ends(self.stripes_left),
            "placed_left": ends(self.placed_left),
            "stripes_left_zero_while_placed": sum(
                1
                for said, placed in zip(self.stripes_left, self.placed_left, strict=False)
                if said == 0 and placed > 0
            ),
            "examples": self.examples[:5],
        }


def _physical(tier: ChaosTier, keys: list[BlockKey], watch: _DrainWatch) -> None:
    """Ask every node whether it holds the shards the index places on it, between two reads of
    the index: a shard placed on the same node in both must be there."""
    nodes = sorted(tier.handles.nodes)
    try:
        first = tier.placements()
        held = ray.get(
            [tier.handles.nodes[n].holds.remote(keys) for n in nodes],
            timeout=tier.config.call_timeout_s * 5,
        )
        second = tier.placements()
    except (RayError, KVStoreError) as error:
        log.warning("physical check skipped: %s", error)
        return
    watch.physical_checks += 1
    row = {node: position for position, node in enumerate(nodes)}
    for position, key in enumerate(keys):
        a, b = first.get(key), second.get(key)
        if a is None or b is None:
            continue
        for index, (was, now) in enumerate(zip(a, b, strict=True)):
            if was < 0 or was != now or was not in row:
                continue
            watch.physical_shards += 1
            if not held[row[was]][position]:
                watch.physical_missing += 1
                watch.examples.append(
                    {"physical": True, "key": key.hex()[:16], "index": index, "node": was}
                )


def _sample(
    tier: ChaosTier,
    node: int,
    load: LoadGenerator,
    drain_at: float,
    watch: _DrainWatch,
    rng: random.Random,
) -> bool:
    """One sample of every ledger block's placement against the live nodes; True when the drain
    is over (the repair says done and no placement names the node)."""
    width = tier.blockstore_config.stripe_width
    keys = tier.ledger.keys()  # committed before the index is read: each must be in it
    placements = tier.placements()
    live = tier.nodes_answering() - tier.dead_nodes()
    watch.samples += 1
    for key in keys:
        placement = placements.get(key)
        watch.stripes_checked += 1
        if placement is None:
            watch.missing_from_index += 1
            continue
        if len({n for n in placement if n >= 0 and n in live}) < width:
            watch.short_stripes += 1
            watch.examples.append({"key": key.hex()[:16], "placement": placement})
    for key in load.snapshot().keys_put_between(drain_at):
        if node in placements.get(key, ()):
            watch.new_puts_on_node += 1
            watch.examples.append({"new_put": key.hex()[:16], "placement": placements[key]})
    placed = sum(1 for placement in placements.values() if node in placement)
    watch.samples_while_moving += placed > 0
    if watch.samples % PHYSICAL_EVERY == 1 and watch.physical_checks < PHYSICAL_CHECKS:
        _physical(tier, rng.sample(keys, min(PHYSICAL_KEYS, len(keys))), watch)
    state = _drain_state(tier, node)
    said = state.get("stripes_left")
    watch.stripes_left.append(int(said) if isinstance(said, int | float) else -1)
    watch.placed_left.append(placed)
    if not state.get("done"):
        return False
    # Done by the repair's word: the index, read after that word, must agree.
    if any(node in placement for placement in tier.placements().values()):
        watch.done_while_placed += 1
        return False
    return True


def _drain_state(tier: ChaosTier, node: int) -> dict[str, Any]:
    draining = tier.repair_stats().get("draining") or {}
    state = draining.get(str(node)) if isinstance(draining, dict) else None
    return dict(state) if isinstance(state, dict) else {}


def drain(tier: ChaosTier) -> ScenarioResult:
    result = ScenarioResult("drain", "drain a node under load: 12 shards throughout")
    config = tier.config
    rng = random.Random(config.seed + 16)
    tier.put_fresh(DRAIN_SEED_BLOCKS)
    node = rng.choice(sorted(tier.handles.nodes))
    bconfig = tier.blockstore_config
    on_node = sum(1 for placement in tier.placements().values() if node in placement)
    wanted = DRAIN_ROUNDS * bconfig.repair_stripes_per_round
    if on_node < wanted:
        more = math.ceil((wanted - on_node) * len(tier.handles.nodes) / bconfig.stripe_width)
        fill = _fill(tier, more, config.block_bytes, time.monotonic() + FILL_TIMEOUT_S)
        result.operations += len(fill.keys) + fill.failed
        result.details["seeded"] = {
            "blocks": len(fill.keys),
            "failed": fill.failed,
            "errors": fill.errors[:3],
        }
        result.require(not fill.errors, f"seeding raised: {fill.errors[:3]}")
    full = wait_until(
        lambda: tier.redundancy().full == len(tier.ledger), config.repair_timeout_s, 0.3
    )
    if not result.require(full is not None, "the ledger's stripes were not full before the drain"):
        return result
    node_bytes = tier.usage_by_node().get(node, {}).get("live_bytes", 0)
    rate = max(DRAIN_MIN_RATE, int(node_bytes / DRAIN_TARGET_S))
    result.details.update(node=node, node_live_bytes=node_bytes, repair_bytes_per_s=rate)
    result.details["set_rates"] = tier.set_repair_rates(repair_bytes_per_s=rate)
    drained = False
    try:
        drained = _drain_under_load(tier, result, node, rng)
    finally:
        tier.set_repair_rates(repair_bytes_per_s=tier.blockstore_config.repair_bytes_per_s)
        if not drained:  # whatever happened, the node goes back into service
            tier.drain(node, False)
    return result


def _drain_under_load(
    tier: ChaosTier, result: ScenarioResult, node: int, rng: random.Random
) -> bool:
    """Drain, watch, undrain; True once the node was given back to service."""
    config = tier.config
    watch = _DrainWatch()
    started = time.monotonic()
    load_config = LoadConfig(writers=1, readers=2, max_seconds=DRAIN_TIMEOUT_S + 60)
    with LoadGenerator(tier, load_config, seed=config.seed + 16) as load:
        time.sleep(0.5)
        result.details["drain_reply"] = tier.drain(node)
        drain_at = time.monotonic()  # puts that start from here on must avoid the node
        result.faults = 1
        done_after = None
        while watch.samples < MAX_SAMPLES and time.monotonic() - drain_at < DRAIN_TIMEOUT_S:
            tick = time.monotonic()
            try:
                if _sample(tier, node, load, drain_at, watch, rng):
                    done_after = time.monotonic() - drain_at
                    break
            except (RayError, KVStoreError) as error:
                log.warning("drain sample failed: %s", error)
            time.sleep(max(0.0, SAMPLE_EVERY_S - (time.monotonic() - tick)))
        drain_s = time.monotonic() - drain_at
        time.sleep(0.5)  # the load goes on a moment on the drained node
    undrain_at = time.monotonic()
    _absorb(result, tier, load.stats)
    result.repair_s = done_after
    seconds_or_violation(result, done_after, "the drain finishing", DRAIN_TIMEOUT_S)

    # After the drain: nothing placed on the node, none of the drain's puts ever was.
    placements = tier.placements()
    still = [key for key, placement in placements.items() if node in placement]
    ledgered = sum(1 for key in still if key in tier.ledger)
    put_during = load.stats.keys_put_between(drain_at, undrain_at)
    on_node = [key for key in put_during if node in placements.get(key, ())]
    watch.new_puts_on_node += len(on_node)
    state = _drain_state(tier, node)
    result.details.update(
        watch=watch.as_dict(),
        drain_s=round(drain_s, 2),
        drain_state=state,
        placed_on_node_after=len(still),
        puts_during_drain=len(put_during),
        usage_after=tier.usage_by_node().get(node, {}),
    )
    result.require(bool(state.get("done")), f"the repair does not report the drain done: {state}")
    result.require(
        not still,
        f"{len(still)} blocks still placed on drained node {node} ({ledgered} of the ledger, "
        f"{len(still) - ledgered} other indexed blocks)",
    )
    result.require(
        watch.short_stripes == 0,
        f"{watch.short_stripes} samples of a stripe with fewer than "
        f"{tier.blockstore_config.stripe_width} shards on live nodes during the drain",
    )
    result.require(watch.missing_from_index == 0, "committed blocks missing from the index")
    result.require(
        watch.done_while_placed == 0,
        f"{watch.done_while_placed} times the repair said the drain was done while the index "
        f"still placed shards on node {node}",
    )
    result.require(
        watch.new_puts_on_node == 0,
        f"{watch.new_puts_on_node} shards of puts made during the drain placed on node {node}",
    )
    result.require(
        watch.physical_missing == 0,
        f"{watch.physical_missing} shards the index places were not on their node",
    )
    result.require(watch.physical_checks > 0, "no physical check of the shards was made")
    result.require(
        watch.samples_while_moving > 0,
        "no sample saw the drain under way (it was over before the first): nothing was checked",
    )
    result.require(len(put_during) > 0, "no put was made during the drain")

    # Back into service: a later put uses the node again.
    result.details["undrain_reply"] = tier.drain(node, False)
    used: list[BlockKey] = []

    def uses_node() -> bool:
        keys = tier.put_fresh(12)
        used.extend(keys)
        return bool(tier.placed_on(node, keys))

    back = wait_until(uses_node, UNDRAIN_TIMEOUT_S, 0.5)
    result.details["undrain"] = {
        "back_after_s": None if back is None else round(back, 2),
        "puts": len(used),
    }
    seconds_or_violation(result, back, "a put using the undrained node", UNDRAIN_TIMEOUT_S)
    final = tier.read(reader=tier.fresh_reader())
    result.operations += len(tier.ledger)
    result.reads_ok += final.ok
    result.wrong_bytes += final.wrong
    result.blocks_lost = final.misses
    result.details["seconds_total"] = round(time.monotonic() - started, 1)
    return True
