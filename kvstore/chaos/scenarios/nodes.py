"""Storage nodes lost and found: scenarios 1-4.

1. ``kill-two``: one node's process and then a second node's whole machine die under read/write
   load; every committed block stays readable, bit-exact, and puts go on: with 11 live failure
   domains a put commits its stripe under-redundant (11 shards), and at least 99% of the puts
   made while both were down (after both were detected) are stored; after the restart every
   stripe, those included, is back to 12 shards on 12 live nodes.
2. ``kill-three``: a third node of the stripes dies: blocks with fewer than k shards left become
   misses (QueryHit stops counting at the first), the rest still read, nothing is wrong.
3. ``restart``: a node restarted at once serves its own files again; a node back after its
   shards were repaired elsewhere brings stale copies, which the orphan scrub reclaims — no
   duplicates, no orphans.
4. ``repair``: a machine and its disk lost for good: the repair loop re-creates its shards on the
   spare machines; the row reports how long detection and repair took.
"""

from __future__ import annotations

import itertools
import random
import shutil
import time

import numpy as np
import ray

from kvstore.chaos.faults import crash_machine, kill_node, kill_nodes
from kvstore.chaos.load import LoadConfig, LoadGenerator
from kvstore.chaos.scenarios.base import absorb_load, seconds_or_violation
from kvstore.chaos.table import ScenarioResult
from kvstore.chaos.tier import ChaosTier, wait_until
from kvstore.keys import block_keys
from kvstore.tier.records import HitRequest

#: Blocks committed before each scenario's faults (more come from the load's writers).
SEED_BLOCKS = 48
#: kill-two keeps its load running with both nodes down until its writers attempted this many
#: blocks (and at least the shortest stretch), so the share stored is a figure, not noise ...
BOTH_DOWN_PUTS = 200
BOTH_DOWN_MIN_S = 2.0
#: ... but no longer than this.
BOTH_DOWN_MAX_S = 15.0
#: Share of the blocks put with both nodes down that must be stored (under-redundant counts).
BOTH_DOWN_STORED = 0.99


def _pick(rng: random.Random, pool: list[int], exclude: set[int]) -> int:
    choices = [n for n in pool if n not in exclude]
    if not choices:
        raise RuntimeError(f"no storage node to fault among {pool} (excluding {sorted(exclude)})")
    return rng.choice(choices)


def kill_two(tier: ChaosTier) -> ScenarioResult:
    result = ScenarioResult("kill-two", "kill 1, then 2 storage nodes of a stripe under load")
    config = tier.config
    rng = random.Random(config.seed + 1)
    tier.put_fresh(SEED_BLOCKS)
    crashed = _pick(rng, tier.crashable_nodes(), set())
    killed = _pick(rng, sorted(tier.handles.nodes), {crashed})
    placements = tier.placements()
    result.details["stripes_with_both"] = sum(
        1 for p in placements.values() if killed in p and crashed in p
    )
    result.details["killed_process"] = killed
    result.details["crashed_machine"] = tier.machine_of_node(crashed)
    with LoadGenerator(tier, LoadConfig(), seed=config.seed + 1) as load:
        time.sleep(1.0)
        kill_node(tier, killed, restart=False)
        detect_a = wait_until(lambda: killed in tier.dead_nodes(), config.detect_timeout_s)
        crash_machine(tier, tier.machine_of_node(crashed))
        result.faults = 2
        detect_b = wait_until(lambda: crashed in tier.dead_nodes(), config.detect_timeout_s)
        both_dead_at = time.monotonic()  # puts from here on see 11 live failure domains
        wait_until(
            lambda: (
                time.monotonic() - both_dead_at >= BOTH_DOWN_MIN_S
                and load.snapshot().puts_between(both_dead_at).attempted >= BOTH_DOWN_PUTS
            ),
            BOTH_DOWN_MAX_S,
            0.2,
        )
        both_down_s = time.monotonic() - both_dead_at
    absorb_load(result, load.stats)
    result.failed_reads += load.stats.read_misses
    seconds_or_violation(result, detect_a, "detecting the killed node", config.detect_timeout_s)
    seconds_or_violation(result, detect_b, "detecting the crashed machine", config.detect_timeout_s)
    result.detect_s = max(detect_a or 0.0, detect_b or 0.0)
    # The load stopped before the restart: every put counted here ran with both nodes down.
    puts = load.stats.puts_between(both_dead_at)
    result.details["puts_with_both_down"] = {**puts.as_dict(), "seconds": round(both_down_s, 2)}
    fraction = puts.stored_fraction
    result.require(
        puts.attempted >= BOTH_DOWN_PUTS // 4,
        f"only {puts.attempted} blocks were put with both nodes down "
        f"in {both_down_s:.1f} s (wanted {BOTH_DOWN_PUTS})",
    )
    result.require(
        fraction is not None and fraction >= BOTH_DOWN_STORED,
        f"{puts.ok + puts.under_redundant} of {puts.attempted} blocks put with 2 of "
        f"{len(tier.handles.nodes)} nodes down were stored (the promise: "
        f">= {BOTH_DOWN_STORED:.0%}, under-redundant ones count)",
    )
    # Every committed block, read with both nodes still down.
    both_down = tier.read()
    result.operations += len(tier.ledger)
    result.reads_ok += both_down.ok
    result.failed_reads += both_down.misses
    result.wrong_bytes += both_down.wrong
    result.details["degraded_read_of_all"] = {"blocks": len(tier.ledger), "ok": both_down.ok}

    restored = time.monotonic()
    tier.restart_node(killed)
    tier.restore_machine(tier.machine_of_node(crashed))
    healed = wait_until(
        lambda: not tier.dead_nodes() and tier.redundancy().full == len(tier.ledger),
        config.repair_timeout_s,
        0.3,
    )
    result.repair_s = seconds_or_violation(
        result, healed, "full redundancy after the restart", config.repair_timeout_s
    )
    if healed is not None:
        result.repair_s = time.monotonic() - restored
    final = tier.read(reader=tier.fresh_reader())
    result.operations += len(tier.ledger)
    result.wrong_bytes += final.wrong
    result.blocks_lost = final.misses
    result.require(
        load.stats.reads_ok > 0 and load.stats.puts_ok > 0, "the load did not read and write"
    )
    return result


def _lost_under(placement: tuple[int, ...], dead: set[int], k: int) -> bool:
    return sum(1 for n in placement if n >= 0 and n not in dead) < k


def kill_three(tier: ChaosTier) -> ScenarioResult:
    result = ScenarioResult("kill-three", "kill 3 nodes of a stripe: misses, never errors")
    config = tier.config
    k = tier.blockstore_config.data_shards
    geometry = tier.geometry
    blocks = 24
    prompt_len = blocks * geometry.block_tokens + 200
    tokens = np.random.default_rng(config.seed + 2).integers(0, 100_000, prompt_len)
    keys = block_keys(geometry.fingerprint(), tokens)[:blocks]
    put = tier.put(keys)
    result.require(put.committed == blocks, f"prompt put failed: {put}")
    tier.put_fresh(SEED_BLOCKS)
    query = tier.facade()
    before = query.query_hit(HitRequest(block_keys=keys, prompt_len=prompt_len, take_lease=False))
    result.require(
        before.plan.block_hit_tokens == blocks * geometry.block_tokens,
        f"healthy QueryHit counted {before.plan.block_hit_tokens} tokens of blocks",
    )
    # Three victims whose loss cuts the prompt's run somewhere in the middle, so QueryHit must
    # stop counting exactly at the first lost block (not trivially at 0).
    placements = tier.placements()
    victims: tuple[int, ...] = ()
    for triple in itertools.combinations(sorted(tier.handles.nodes), 3):
        lost = [i for i, key in enumerate(keys) if _lost_under(placements[key], set(triple), k)]
        if lost and 0 < lost[0] < blocks - 1:
            victims = triple
            break
    if not victims:
        raise RuntimeError("no 3 nodes cut this prompt's blocks in the middle")
    dead = set(victims)
    planned_lost = {key for key, p in placements.items() if _lost_under(p, dead, k)}
    planned_lost &= set(tier.ledger.keys())
    result.details["victims"] = list(victims)
    kill_nodes(tier, victims, restart=False)
    result.faults = 3
    detect = wait_until(lambda: dead <= tier.dead_nodes(), config.detect_timeout_s)
    result.detect_s = seconds_or_violation(
        result, detect, "detecting 3 dead nodes", config.detect_timeout_s
    )
    # What is lost is decided by the index once all three are dead, not by the plan: the kills
    # land a few ms apart, and a repair step that ran in between may have rebuilt a planned
    # victim's shard elsewhere (a stripe it could still decode). After the barrier no step that
    # read a victim's shard is under way, and a stripe with fewer than k live shards can never
    # be rebuilt, so this set is final for as long as the victims stay dead.
    tier.repair_barrier()
    now = tier.placements()
    expected_lost = {key for key in tier.ledger.keys() if _lost_under(now.get(key, ()), dead, k)}
    result.details["blocks_beyond_promise"] = len(expected_lost)
    result.details["rescued_by_repair_between_kills"] = len(planned_lost - expected_lost)
    lost_in_prompt = [i for i, key in enumerate(keys) if key in expected_lost]
    first_lost = lost_in_prompt[0] if lost_in_prompt else blocks

    # QueryHit stops counting at the first lost block; the service answers, bounded, no errors.
    started = time.monotonic()
    after = query.query_hit(HitRequest(block_keys=keys, prompt_len=prompt_len, take_lease=False))
    result.details["query_hit_blocks"] = {
        "before": blocks,
        "after": after.plan.block_hit_tokens // geometry.block_tokens,
        "expected": first_lost,
    }
    result.require(
        after.plan.block_hit_tokens == first_lost * geometry.block_tokens,
        f"QueryHit counted {after.plan.block_hit_tokens} block tokens with 3 nodes dead; "
        f"the first lost block is #{first_lost}",
    )
    check = tier.read()
    result.operations += 1 + len(tier.ledger)
    missed = set(check.missed_keys)
    result.reads_ok += check.ok
    result.wrong_bytes += check.wrong
    result.expected_misses += len(missed & expected_lost)
    result.failed_reads += len(missed - expected_lost)
    served = expected_lost - missed - set(check.wrong_keys)
    if served:  # what the index says, for whoever debugs it
        result.details["served_beyond_promise"] = [
            {"key": key.hex()[:16], "placed": placements[key], "now": now.get(key)}
            for key in sorted(served)[:5]
        ]
    result.require(not served, "a block with fewer than k shards left was served")
    attempt = tier.put(tier.new_keys(4))
    result.operations += 4
    result.details["put_with_10_nodes"] = {
        "stored": attempt.stored,
        "failed": len(attempt.failed_keys),
    }
    answered_in = time.monotonic() - started
    result.details["answered_in_s"] = round(answered_in, 3)
    result.require(
        answered_in < 4 * config.call_timeout_s + len(tier.ledger) * 0.05,
        f"the degraded service took {answered_in:.1f} s to answer",
    )

    restored = time.monotonic()
    for node in victims:
        tier.restart_node(node)

    def back() -> bool:
        again = query.query_hit(
            HitRequest(block_keys=keys, prompt_len=prompt_len, take_lease=False)
        )
        return again.plan.block_hit_tokens == blocks * geometry.block_tokens

    healed = wait_until(
        lambda: (
            not tier.dead_nodes()
            and back()
            and tier.read(reader=tier.fresh_reader()).ok == len(tier.ledger)
        ),
        config.repair_timeout_s,
        0.3,
    )
    seconds_or_violation(
        result, healed, "every block readable and counted again", config.repair_timeout_s
    )
    result.repair_s = time.monotonic() - restored if healed is not None else None
    final = tier.read(reader=tier.fresh_reader())
    result.operations += len(tier.ledger)
    result.wrong_bytes += final.wrong
    result.blocks_lost = final.misses
    return result


def restart(tier: ChaosTier) -> ScenarioResult:
    result = ScenarioResult("restart", "restart killed nodes on their data dirs")
    config = tier.config
    rng = random.Random(config.seed + 3)
    mine = tier.put_fresh(SEED_BLOCKS)
    quick = _pick(rng, sorted(tier.handles.nodes), set())
    late = _pick(rng, tier.crashable_nodes(), {quick})
    handle = tier.handles.nodes[quick]
    held_before = ray.get(handle.holds.remote(mine), timeout=config.call_timeout_s)
    incarnation = ray.get(handle.incarnation.remote(), timeout=config.call_timeout_s)
    result.details["quick_restart"] = quick
    result.details["late_restart"] = late
    with LoadGenerator(tier, LoadConfig(), seed=config.seed + 3) as load:
        time.sleep(0.5)
        # (a) a crash Ray restarts at once: the node must serve its own files again.
        kill_node(tier, quick, restart=True)
        back = wait_until(
            lambda: ray.get(handle.incarnation.remote(), timeout=2) != incarnation,
            config.detect_timeout_s,
        )
        seconds_or_violation(result, back, "the quick restart", config.detect_timeout_s)
        held_after = ray.get(handle.holds.remote(mine), timeout=config.call_timeout_s)
        result.require(held_after == held_before, "a restarted node lost shard files")
        # (b) a machine gone long enough for the repair to move its shards elsewhere.
        crash_machine(tier, tier.machine_of_node(late))
        result.faults = 2
        detect = wait_until(lambda: late in tier.dead_nodes(), config.detect_timeout_s)
        result.detect_s = seconds_or_violation(
            result, detect, "detecting the crashed machine", config.detect_timeout_s
        )
        moved = wait_until(
            lambda: not tier.placed_on(late),
            config.repair_timeout_s,
            0.3,
        )
        result.repair_s = seconds_or_violation(
            result, moved, "repair of the crashed node's shards", config.repair_timeout_s
        )
        tier.restore_machine(tier.machine_of_node(late))
        time.sleep(1.0)
    absorb_load(result, load.stats)
    result.failed_reads += load.stats.read_misses
    # Data back: everything readable; the late node holds stale copies until reclaimed.
    check = tier.read()
    result.operations += len(tier.ledger)
    result.reads_ok += check.ok
    result.failed_reads += check.misses
    result.wrong_bytes += check.wrong
    census = tier.shard_census()
    result.details["stray_before_reclaim"] = census["stray"]
    result.require(census["stray"] > 0, "the late node came back without its stale copies")
    # The puts in flight are over; a killed writer's reservation lapses after put_reservation_s.
    time.sleep(config.put_reservation_s + 0.5)
    reclaimed = ray.get(
        [h.reclaim_orphans.remote(0.0) for h in tier.handles.nodes.values()],
        timeout=config.call_timeout_s * 10,
    )
    result.details["reclaimed"] = {
        "pending": sum(r["pending_reclaimed"] for r in reclaimed),
        "committed": sum(r["committed_reclaimed"] for r in reclaimed),
    }
    census = tier.shard_census()
    usage = tier.node_usage()
    expected_shards = sum(sum(1 for n in p if n >= 0) for p in tier.placements().values())
    result.details["after_reclaim"] = {**census, **usage, "expected_shards": expected_shards}
    result.require(census["stray"] == 0, f"{census['stray']} orphan shard files left")
    result.require(usage["pending"] == 0, f"{usage['pending']} pending shard files left")
    result.require(
        usage["shards"] == expected_shards,
        f"nodes hold {usage['shards']} shard files, the index needs {expected_shards}",
    )
    final = tier.read(reader=tier.fresh_reader())
    result.wrong_bytes += final.wrong
    result.blocks_lost = final.misses
    result.operations += len(tier.ledger)
    return result


def permanent_loss(tier: ChaosTier) -> ScenarioResult:
    result = ScenarioResult("repair", "a machine and its disk lost for good: repair")
    config = tier.config
    rng = random.Random(config.seed + 4)
    tier.put_fresh(SEED_BLOCKS)
    victim = _pick(rng, tier.crashable_nodes(), set())
    machine = tier.machine_of_node(victim)
    on_victim = tier.placed_on(victim)
    before = tier.repair_stats()
    result.details.update(victim=victim, machine=machine, shards_on_victim=len(on_victim))
    crashed_at = crash_machine(tier, machine)
    shutil.rmtree(tier.data_dir(victim), ignore_errors=True)  # the disk goes with it
    result.faults = 1
    detect = wait_until(lambda: victim in tier.dead_nodes(), config.detect_timeout_s, 0.05)
    result.detect_s = seconds_or_violation(
        result, detect, "detecting the lost machine", config.detect_timeout_s
    )
    detected_at = time.monotonic()
    repaired = wait_until(
        lambda: tier.redundancy().full == len(tier.ledger), config.repair_timeout_s, 0.2
    )
    seconds_or_violation(result, repaired, "full redundancy", config.repair_timeout_s)
    if repaired is not None:
        result.repair_s = time.monotonic() - detected_at
    after = tier.repair_stats()
    result.details["repaired"] = {
        name: after.get(name, 0) - before.get(name, 0)
        for name in ("stripes", "shards", "bytes", "unrecoverable")
    }
    result.details["outage_s"] = round(time.monotonic() - crashed_at, 3)
    check = tier.read()
    result.operations += len(tier.ledger)
    result.reads_ok += check.ok
    result.wrong_bytes += check.wrong
    result.blocks_lost = check.misses
    result.require(not tier.placed_on(victim), "blocks still placed on the lost machine")
    # A replacement machine joins empty under the same id; nothing points at it yet.
    tier.restore_machine(machine)
    census = tier.shard_census(on_victim)
    result.details["census_after_replacement"] = census
    result.require(census["missing"] == 0, f"{census['missing']} repaired shards missing")
    return result
