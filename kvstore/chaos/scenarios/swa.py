"""Scenario 6, ``swa``: an SWA entrypoint is killed, then a machine holding SWA states is lost.

- Killed entrypoint: its directory shard comes back empty; lookups of its keys answer miss in
  bounded time (never an error) until the stores' heartbeats re-register their states.
- Lost machine: its states answer miss within the owner timeout, QueryHit plans around the
  missing state (no SWA hit, no error), every other state is still fetched bit-exact, and the
  block tier (which lost that machine's storage node too) still reads every block. The machine
  comes back empty; the directory takes its new states again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import ray
from ray.exceptions import RayError

from kvstore.chaos.faults import crash_machine
from kvstore.chaos.scenarios.base import seconds_or_violation
from kvstore.chaos.table import ScenarioResult
from kvstore.chaos.tier import ChaosTier, wait_until
from kvstore.keys import BlockKey, block_keys, state_slot
from kvstore.swa.client import SWAClient
from kvstore.swa.directory import ShardMap
from kvstore.tier.records import HitAnswer, HitRequest

STATES_PER_MACHINE = 3


@dataclass
class _State:
    machine: str
    position: int
    blob: np.ndarray


def _fetch_all(
    client: SWAClient, states: dict[BlockKey, _State], result: ScenarioResult
) -> tuple[int, int]:
    """Fetch every state; returns (bit-exact, misses); wrong bytes go into ``result``."""
    ok = misses = 0
    for key, state in states.items():
        fetched = client.get(key)
        result.operations += 1
        if fetched is None:
            misses += 1
        elif np.array_equal(fetched.blob, state.blob):
            ok += 1
        else:
            result.wrong_bytes += 1
    return ok, misses


def swa_loss(tier: ChaosTier) -> ScenarioResult:
    result = ScenarioResult("swa", "kill an SWA entrypoint; lose a machine holding SWA states")
    config = tier.config
    geometry = tier.geometry
    state_bytes = int(geometry.state_size_to_disk)
    rng = np.random.default_rng(config.seed + 6)
    client = tier.swa_client()
    control = tier.control_machines()
    candidates = [m for m in tier.swa_machines() if m not in control and m in tier.owned]
    if not candidates:
        raise RuntimeError("every SWA store machine also hosts a control-plane actor")
    victim = candidates[-1]
    result.details["victim_machine"] = victim

    # A prompt whose blocks are cached and whose state at L1 lives on the victim.
    blocks = 10
    prompt_len = blocks * geometry.block_tokens + 200
    tokens = rng.integers(0, 100_000, prompt_len)
    prompt = block_keys(geometry.fingerprint(), tokens)[:blocks]
    tier.put(prompt)
    states: dict[BlockKey, _State] = {}

    def put_state(machine: str, key: BlockKey, position: int) -> None:
        # Where the tier keeps a state: under its block key bound to its position.
        slot = state_slot(key, position)
        blob = rng.integers(0, 256, state_bytes, dtype=np.uint8)
        client.put(machine, slot, position, blob)
        result.operations += 1
        states[slot] = _State(machine, position, blob)

    put_state(victim, prompt[-1], blocks * geometry.block_tokens)
    for machine in tier.swa_machines():
        for index in range(STATES_PER_MACHINE):
            put_state(machine, BlockKey(rng.bytes(32)), geometry.block_tokens * (index + 1))
    registered = wait_until(
        lambda: all(owner is not None for owner in client.lookup(list(states)).result()),
        config.detect_timeout_s,
    )
    result.require(registered is not None, "states never registered in the directory")
    query = tier.facade()

    def plan(mode: str) -> HitAnswer:
        return query.query_hit(
            HitRequest(block_keys=prompt, prompt_len=prompt_len, mode=mode, take_lease=False)
        )

    before = plan("standard")
    result.require(
        before.plan.swa_hit and before.swa_owner == victim,
        f"healthy QueryHit did not find the state on {victim}",
    )

    # --- a killed entrypoint ----------------------------------------------------------------
    shard = tier.swa.shards[0]
    on_shard = [key for key in states if ShardMap(tier.swa.shards).shard_of(key) == shard]
    entry = tier.swa.entrypoint(shard)
    incarnation = ray.get(entry.ping.remote(), timeout=config.call_timeout_s)
    ray.kill(entry, no_restart=False)
    killed_at = time.monotonic()
    result.faults += 1
    replaced_after: float | None = None
    outage_misses = 0
    slowest = 0.0
    recovered: float | None = None
    while time.monotonic() - killed_at < config.repair_timeout_s:
        started = time.monotonic()
        owners = client.lookup(list(states)).result()  # must answer, never raise
        slowest = max(slowest, time.monotonic() - started)
        result.operations += len(owners)
        outage_misses += sum(owner is None for owner in owners)
        if replaced_after is None:
            try:
                if ray.get(entry.ping.remote(), timeout=1) != incarnation:
                    replaced_after = time.monotonic() - killed_at
            except RayError:
                pass
        elif all(owner is not None for owner in owners):
            recovered = time.monotonic() - killed_at
            break
        time.sleep(0.1)
    result.expected_misses += outage_misses
    result.details["entrypoint"] = {
        "shard": shard,
        "keys_on_shard": len(on_shard),
        "replaced_after_s": replaced_after,
        "directory_recovered_after_s": recovered,
        "lookup_misses_meanwhile": outage_misses,
        "slowest_lookup_s": round(slowest, 3),
    }
    result.require(replaced_after is not None, "the killed entrypoint was never replaced")
    result.require(recovered is not None, "the directory never recovered its states")
    result.require(
        slowest <= config.swa_call_timeout_s + 1.5,
        f"a lookup took {slowest:.1f} s during the entrypoint outage",
    )
    ok, misses = _fetch_all(client, states, result)
    if misses:
        # A store may still be re-registering everything with the replacement (its fetches
        # can then time out): "recovered" means every state is fetchable again once it is done.
        time.sleep(2 * config.swa_call_timeout_s)
        result.details["entrypoint"]["fetch_misses_right_after_recovery"] = misses
        ok, misses = _fetch_all(client, states, result)  # bytes checked again, every state
    result.reads_ok += ok
    result.failed_reads += misses

    # --- a lost machine ---------------------------------------------------------------------
    lost = {key for key, state in states.items() if state.machine == victim}
    crash_machine(tier, victim)
    crashed_at = time.monotonic()
    result.faults += 1
    gone = wait_until(
        lambda: all(owner is None for owner in client.lookup(list(lost)).result()),
        config.swa_owner_timeout_s + config.detect_timeout_s,
    )
    result.detect_s = seconds_or_violation(
        result, gone, "the lost machine's states leaving the directory", config.detect_timeout_s
    )
    started = time.monotonic()
    during = plan("standard")
    bounded = plan("bounded-replay")
    result.operations += 2
    result.details["query_hit_after_loss"] = {
        "standard": during.plan.to_dict(),
        "bounded_replay": bounded.plan.to_dict(),
        "seconds": round(time.monotonic() - started, 3),
    }
    result.require(
        not during.plan.swa_hit and during.swa_owner is None,
        "QueryHit still counts a state held by the lost machine",
    )
    result.require(
        during.plan.block_hit_tokens == blocks * geometry.block_tokens
        and during.plan.hit_tokens == (blocks - 1) * geometry.block_tokens,
        f"standard plan after the loss: {during.plan.to_dict()}",
    )
    result.require(
        bounded.plan.hit_tokens == blocks * geometry.block_tokens
        and bounded.plan.replay_tokens == geometry.window,
        f"bounded-replay plan after the loss: {bounded.plan.to_dict()}",
    )
    survivors = {key: state for key, state in states.items() if key not in lost}
    ok, misses = _fetch_all(client, survivors, result)
    result.reads_ok += ok
    result.failed_reads += misses
    lost_reads = [client.get(key) for key in lost]
    result.operations += len(lost)
    result.expected_misses += sum(read is None for read in lost_reads)
    result.wrong_bytes += sum(read is not None for read in lost_reads)
    blocks_check = tier.read()  # the machine's storage node went with it: 1 node down
    result.operations += len(tier.ledger)
    result.reads_ok += blocks_check.ok
    result.failed_reads += blocks_check.misses
    result.wrong_bytes += blocks_check.wrong

    tier.restore_machine(victim)
    fresh = BlockKey(rng.bytes(32))

    def taken_back() -> bool:
        # The first put to a store that was replaced fails (StoreError: the client still held
        # the old actor); an engine tries again, and the retry finds the new store by name.
        slot = state_slot(fresh, geometry.block_tokens)
        if slot not in states:
            put_state(victim, fresh, geometry.block_tokens)
        return all(client.lookup([slot, *survivors]).result())

    healed = wait_until(taken_back, config.repair_timeout_s)
    seconds_or_violation(
        result, healed, "the directory taking the machine back", config.repair_timeout_s
    )
    result.repair_s = time.monotonic() - crashed_at if healed is not None else None
    final = tier.read(reader=tier.fresh_reader())
    result.operations += len(tier.ledger)
    result.wrong_bytes += final.wrong
    result.blocks_lost = final.misses
    return result
