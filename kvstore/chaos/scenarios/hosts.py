"""Scenarios on real (namespaced) hosts: a storage host's link down, a storage host crashed.

They run in a driver on the testbed's client host (``kvstore.chaos.hostrun``), on a
``ChaosTier`` over a ``HostCluster`` (``kvstore.testbed``): 14 storage nodes, 2 on each of 7
storage hosts, so a stripe has at most 2 shards on a host; the control plane (meta shards,
repair, SWA entrypoints) on the head host; SWA stores on 3 storage hosts. Every byte between
hosts crosses a veth pair and a bridge.

18. ``partition``: under read and write load, a storage host's switch port goes down for 30 s,
    then up. Promised: reads keep working from the other hosts' shards (degraded, never
    wrong), writes stay whole (12 live nodes on 6 hosts: no put fails), the SWA directory
    stops naming the cut-off host's states within its owner timeout and never names them
    while the link is down, no committed block is lost, and when the host is back (its Ray
    restarted by the host's supervisor when the GCS declared it dead meanwhile) the repair
    goes idle: it repairs no stripe twice and nothing after the host returned. Each host's
    TCP sockets are checked mid-partition and at the end: test range and loopback only; every
    storage node's and meta shard's direct socket served the load, in TLS.
19. ``host-crash``: every process of a storage host killed at once under load (2 storage nodes
    and an SWA store go together): reads degrade, puts stay whole, the repair restores full
    redundancy on the other hosts (no stripe with 2 shards on one host), then the host comes
    back empty of processes (its data dirs kept) and serves again.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import ray

from kvstore.blockstore.repairqueue import REFRESH_S
from kvstore.chaos.load import LoadConfig, LoadGenerator, LoadStats
from kvstore.chaos.scenarios.base import absorb_load, seconds_or_violation
from kvstore.chaos.table import ScenarioResult
from kvstore.chaos.tier import ChaosTier, wait_until
from kvstore.keys import BlockKey, state_slot
from kvstore.swa.client import SWAClient

#: How long the link stays down (the issue's figure).
PARTITION_S = 30.0
#: Load before the fault, for a baseline.
BEFORE_S = 5.0
#: After the host is back and the tier healthy: the repair must stay idle this long.
SETTLE_S = 10.0
SEED_BLOCKS = 96
STATES_PER_HOST = 3
#: Share of puts during the fault that must commit (the rest: in flight when it hit).
MIN_PUT_SUCCESS = 0.99


def _host_cluster(tier: ChaosTier) -> Any:
    cluster = tier.cluster
    if not hasattr(cluster, "network"):
        raise RuntimeError("host scenarios need a testbed's HostCluster (kvstore.testbed)")
    return cluster


def _victim(tier: ChaosTier) -> str:
    """A storage host with an SWA store, no control-plane actor, and storage nodes."""
    control = tier.control_machines()
    for host in reversed(tier.swa_machines()):
        if host not in control and host in tier.owned and tier.nodes_on(host):
            return host
    raise RuntimeError("no storage host with an SWA store is free of control-plane actors")


def _seed_states(
    tier: ChaosTier, client: SWAClient, rng: np.random.Generator
) -> dict[BlockKey, str]:
    """A few SWA states on every SWA host; slot -> host."""
    state_bytes = int(tier.geometry.state_size_to_disk)
    block = tier.geometry.block_tokens
    where: dict[BlockKey, str] = {}
    for host in tier.swa_machines():
        for index in range(STATES_PER_HOST):
            slot = state_slot(BlockKey(rng.bytes(32)), block * (index + 1))
            client.put(host, slot, block * (index + 1), rng.integers(0, 256, state_bytes, np.uint8))
            where[slot] = host
    return where


def _holders(client: SWAClient, slots: list[BlockKey]) -> list[str | None]:
    """The machine the directory names for each state (None: a miss)."""
    return [None if ref is None else ref.machine_id for ref in client.lookup(slots).result()]


def _foreign_sockets(tier: ChaosTier) -> dict[str, list[str]]:
    network = _host_cluster(tier).network
    return {host: bad for host in network.hosts if (bad := network.foreign_sockets(host))}


def _affected(tier: ChaosTier, nodes: list[int]) -> int:
    """Committed blocks with a shard on one of ``nodes``."""
    return sum(1 for placement in tier.placements().values() if set(placement) & set(nodes))


def _queue_stays_empty(tier: ChaosTier) -> bool:
    """The repair queue reads empty for longer than a meta shard takes to rescan it: a stripe
    whose repair failed (its target restarting, say) is handed out again only on a rescan, so
    one empty reading alone does not mean the work is done."""
    since: float | None = None
    deadline = time.monotonic() + tier.config.repair_timeout_s
    while time.monotonic() < deadline:
        if tier.repair_stats()["progress"]["stripes_left"] == 0:
            since = time.monotonic() if since is None else since
            if time.monotonic() - since > REFRESH_S + 2.0:
                return True
        else:
            since = None
        time.sleep(0.5)
    return False


def _shards_on(tier: ChaosTier, nodes: list[int]) -> int:
    """Shards of committed blocks placed on one of ``nodes`` (a stripe may have two there)."""
    held = set(nodes)
    return sum(
        sum(1 for node in placement if node in held) for placement in tier.placements().values()
    )


def _committed_after(stats: LoadStats, cut: float, counted: float) -> int:
    """Blocks committed by put calls that began before the ``cut`` and ended after the host's
    shards were ``counted``: they may have placed shards there that the count missed."""
    return sum(len(r.keys) for r in stats.put_log if r.started < cut and r.ended > counted)


def _puts(result: ScenarioResult, stats: LoadStats, since: float, until: float) -> None:
    counts = stats.puts_between(since, until)
    seconds = [r.ended - r.started for r in stats.put_log if since <= r.started < until]
    result.details["puts_during_fault"] = {
        **counts.as_dict(),
        "call_s_max": round(max(seconds), 2) if seconds else None,
        "call_s_median": round(float(np.median(seconds)), 2) if seconds else None,
    }
    fraction = counts.stored_fraction
    result.require(
        fraction is not None and fraction >= MIN_PUT_SUCCESS,
        f"puts during the fault: {counts.as_dict()} (want >= {MIN_PUT_SUCCESS:.0%} stored)",
    )


def _reads(result: ScenarioResult, stats: LoadStats, since: float, until: float) -> None:
    """Read misses of the load count as failed reads (every stripe keeps >= 10 shards). For
    each call that missed (at most 10), when it started after the fault, how long it took and
    why its first missed block missed (the client's words: which nodes failed or were late)."""
    result.failed_reads += stats.read_misses
    before = stats.percentile_ms(99, until=since)
    during = stats.percentile_ms(99, since, until)
    result.details["get_p99_ms"] = {"before": before, "during_fault": during}
    why: dict[tuple[float, float], str | None] = {}
    for call, reason in zip(stats.missed_in, stats.missed_why, strict=True):
        why.setdefault(call, reason)
    result.details["missed_calls"] = [
        {
            "started_after_fault_s": round(started - since, 2),
            "took_s": round(took, 2),
            "why": why[started, took],
        }
        for started, took in sorted(why)[:10]
    ]


def _data_plane(result: ScenarioResult, tier: ChaosTier) -> None:
    """The data plane between the hosts is the one real machines run: every storage node's and
    meta shard's direct socket serves TLS (the testbed's setting: beyond loopback plaintext is
    refused) and the load's calls came over them, not through Ray."""
    handles = [*tier.handles.nodes.values(), *tier.handles.metas]
    sockets = [s["fastcall"] for s in ray.get([h.stats.remote() for h in handles], timeout=60)]
    served = sum(sum(fast["served"].values()) for fast in sockets)
    in_tls = sum(1 for fast in sockets if fast["tls"])
    result.details["data_plane"] = {"sockets": len(sockets), "tls": in_tls, "served": served}
    result.require(in_tls == len(sockets), "a data-plane socket serves plaintext between hosts")
    result.require(served > 0, "no call came over the data plane's sockets")


def _final(result: ScenarioResult, tier: ChaosTier) -> None:
    final = tier.read(reader=tier.fresh_reader())
    result.operations += len(tier.ledger)
    result.reads_ok += final.ok
    result.wrong_bytes += final.wrong
    result.blocks_lost = final.misses


@dataclass
class _RepairBudget:
    """What the repair may rightly do around a partition, in shards restored; more is thrash
    (a shard restored twice, or shards moved for a host that came back). Counted in shards,
    not stripes: a stripe with a shard on each of the host's two nodes is rightly repaired
    twice when the two are declared dead a round apart."""

    #: Shards on the host when it was cut off, and those the load's under-redundant puts did
    #: not write before the link came back (a put in flight at the cut included): the repair's
    #: work while the link is down.
    shards_on_host: int = 0
    under_redundant: int = 0
    #: What the count of ``shards_on_host`` could not see: the blocks of puts in flight at the
    #: cut that were committed only after it (a put that had its shard on the host before the
    #: cut waits out a call timeout for the host's other node, then commits; on a busy machine
    #: that can be later than the count), at most one shard a node of the host each.
    committed_after_count: int = 0
    #: When the link came back: shards still placed on the host (not yet repaired), and what
    #: the blocks the load stored afterwards may have put there (a put that reached the host's
    #: old processes before its Ray restart killed them leaves a stripe short again: a real
    #: repair, not thrash), at most one shard a node of the host each.
    unrepaired_at_return: int = 0
    stored_after_return: int = 0

    @property
    def while_down(self) -> int:
        """The most shards the repair may rightly restore while the link is down."""
        return self.shards_on_host + self.under_redundant + self.committed_after_count

    @property
    def after_up(self) -> int:
        """The most shards the repair may rightly restore once the link is back."""
        return self.unrepaired_at_return + self.stored_after_return


def _repair_settles(
    result: ScenarioResult, tier: ChaosTier, budget: _RepairBudget, first: float, at_up: float
) -> None:
    """The repair has no thrash: once its queue is empty (the host back, the load stopped) it
    stays idle, and it restored no more shards than ``budget`` allows, before the link came
    back and after. ``first`` and ``at_up`` are the repair's shard counts at the cut and at
    the link's return."""
    started = time.monotonic()
    drained = _queue_stays_empty(tier)
    seconds_or_violation(
        result,
        time.monotonic() - started if drained else None,
        "the repair queue emptying",
        tier.config.repair_timeout_s,
    )
    settled = float(tier.repair_stats()["shards"])
    time.sleep(SETTLE_S)
    stats = tier.repair_stats()
    idle = float(stats["shards"]) - settled
    while_down = at_up - first
    after_up = float(stats["shards"]) - at_up
    result.details["repair"] = {
        **asdict(budget),
        "shards_restored_while_down": int(while_down),
        "shards_restored_after_return": int(after_up),
        f"shards_restored_in_{SETTLE_S:.0f}_s_idle": int(idle),
        "stripes_repaired": int(stats["stripes"]),
        "left": stats["progress"],
    }
    result.require(idle == 0, f"the repair went on once its queue was empty ({idle:.0f})")
    result.require(
        while_down <= budget.while_down,
        f"{while_down:.0f} shards restored while the host was cut off: more than the "
        f"{budget.shards_on_host} there, the {budget.under_redundant} written short and the "
        f"{budget.committed_after_count} that puts in flight at the cut may have put there",
    )
    result.require(
        after_up <= budget.after_up,
        f"{after_up:.0f} shards restored after the host came back: more than the "
        f"{budget.unrepaired_at_return} still on it and the {budget.stored_after_return} "
        "the blocks written since may have put there",
    )


def partition(tier: ChaosTier) -> ScenarioResult:
    result = ScenarioResult("partition", "a storage host's link down for 30 s under load")
    cluster = _host_cluster(tier)
    network = cluster.network
    rng = np.random.default_rng(tier.config.seed + 18)
    victim = _victim(tier)
    nodes = tier.nodes_on(victim)
    client = tier.swa_client()
    tier.put_fresh(SEED_BLOCKS)
    states = _seed_states(tier, client, rng)
    cut_off = [slot for slot, host in states.items() if host == victim]
    registered = wait_until(
        lambda: _holders(client, list(states)) == list(states.values()),
        tier.config.detect_timeout_s,
    )
    result.require(registered is not None, "SWA states never registered in the directory")
    first_repairs = float(tier.repair_stats()["shards"])
    result.details.update(victim=victim, nodes=nodes, swa_states_on_victim=len(cut_off))
    named_while_down = 0
    with LoadGenerator(
        tier, LoadConfig(max_seconds=PARTITION_S + 600), tier.config.seed + 18
    ) as load:
        load_began = time.monotonic()
        time.sleep(BEFORE_S)
        shards_on_host: int | None = None
        counted_at = math.inf  # when the host's shards were counted (never: nothing allowed)
        named_before = _holders(client, cut_off).count(victim)
        down_at = time.monotonic()
        network.link_down(victim)
        result.faults += 1
        hidden_after: float | None = None
        detected_after: float | None = None
        dead_seen: set[int] = set()
        sockets_mid: dict[str, list[str]] | None = None
        while time.monotonic() - down_at < PARTITION_S:
            holders = _holders(client, cut_off)  # must answer, never raise
            result.operations += len(holders)
            named = holders.count(victim)
            elapsed = time.monotonic() - down_at
            if hidden_after is None and not named:
                hidden_after = elapsed
            elif hidden_after is not None:
                named_while_down += named  # once hidden, never named again while down
            dead = tier.dead_nodes()
            dead_seen |= dead
            if detected_after is None and set(nodes) <= dead:
                detected_after = elapsed
            if shards_on_host is None and elapsed > tier.config.call_timeout_s + 1.0:
                # Shards on the host: counted once the puts in flight when the link went
                # down have mostly ended (those that end later are allowed for in the
                # budget), before the repair moves any (it has not yet declared the host's
                # nodes dead: checked below).
                counted_at = time.monotonic()
                shards_on_host = _shards_on(tier, nodes)
                result.require(
                    detected_after is None, "the host was declared dead before it was counted"
                )
            if sockets_mid is None and elapsed > PARTITION_S / 2:
                sockets_mid = _foreign_sockets(tier)
            time.sleep(0.5)
        up_at = time.monotonic()
        repaired_at_up = float(tier.repair_stats()["shards"])
        # Since the load began: a block written short before the cut (a node slow past the
        # call timeout on a busy machine) may be repaired only after it.
        so_far = load.snapshot()
        short = so_far.puts_between(load_began, up_at, running=True).under_redundant
        config = tier.blockstore_config
        budget = _RepairBudget(
            shards_on_host=shards_on_host or 0,
            under_redundant=short * (config.stripe_width - config.write_quorum),
            committed_after_count=_committed_after(so_far, down_at, counted_at) * len(nodes),
            unrepaired_at_return=_shards_on(tier, nodes),
        )
        network.link_up(victim)
        ray_action = cluster.ensure_running(victim)
        back = wait_until(
            lambda: set(nodes) <= tier.nodes_answering() and not set(nodes) & tier.dead_nodes(),
            tier.config.repair_timeout_s,
            0.5,
        )
        seconds_or_violation(result, back, "the host's nodes serving again", 0)
        stats = load.stop()
    absorb_load(result, stats)
    _reads(result, stats, down_at, up_at)
    _puts(result, stats, down_at, up_at)
    result.detect_s = detected_after
    result.repair_s = None if back is None else (time.monotonic() - down_at)
    owner_timeout = tier.config.swa_owner_timeout_s
    result.details["swa"] = {
        "named_before": named_before,
        "hidden_after_s": hidden_after,
        "owner_timeout_s": owner_timeout,
        "named_after_hidden": named_while_down,
    }
    result.require(
        hidden_after is not None and hidden_after <= owner_timeout + 3.0,
        f"the directory named the cut-off host's states for {hidden_after} s "
        f"(owner timeout {owner_timeout} s)",
    )
    result.require(named_before == len(cut_off), "the cut-off host's states were not named before")
    result.require(named_while_down == 0, "the directory named a cut-off state again")
    result.details["host_ray_after_link_up"] = ray_action
    result.details["nodes_declared_dead_while_down"] = sorted(dead_seen)
    since_up = stats.puts_between(up_at, running=True)
    budget.stored_after_return = (since_up.ok + since_up.under_redundant) * len(nodes)
    result.details["back_after_link_up_s"] = back
    _repair_settles(result, tier, budget, first_repairs, repaired_at_up)
    sockets_end = _foreign_sockets(tier)
    result.details["foreign_sockets"] = {"mid_partition": sockets_mid, "end": sockets_end}
    result.require(sockets_mid == {} and sockets_end == {}, "a socket outside the test range")
    _data_plane(result, tier)
    _final(result, tier)
    return result


def host_crash(tier: ChaosTier) -> ScenarioResult:
    result = ScenarioResult("host-crash", "a storage host's processes all killed under load")
    cluster = _host_cluster(tier)
    victim = _victim(tier)
    nodes = tier.nodes_on(victim)
    tier.put_fresh(SEED_BLOCKS)
    affected = _affected(tier, nodes)
    result.details.update(victim=victim, nodes=nodes, affected_blocks=affected)
    with LoadGenerator(tier, LoadConfig(max_seconds=600), tier.config.seed + 19) as load:
        time.sleep(BEFORE_S)
        crashed_at = time.monotonic()
        cluster.remove_machine(victim, graceful=False)
        result.faults += 1
        detected = wait_until(
            lambda: set(nodes) <= tier.dead_nodes(), tier.config.detect_timeout_s, 0.2
        )
        result.detect_s = seconds_or_violation(
            result, detected, "the repair declaring the host's nodes dead", 0
        )
        tier.repair_barrier()
        repaired = wait_until(
            lambda: not tier.placed_on_any(nodes), tier.config.repair_timeout_s, 0.5
        )
        result.repair_s = seconds_or_violation(result, repaired, "the repair moving off", 0)
        until = time.monotonic()
        stats = load.stop()
    absorb_load(result, stats)
    _reads(result, stats, crashed_at, until)
    _puts(result, stats, crashed_at, until)
    spread = tier.host_spread()
    result.details["most_shards_of_a_stripe_on_one_host"] = spread
    result.require(spread <= 2, f"a stripe has {spread} shards on one host after the repair")
    tier.restore_machine(victim)
    _final(result, tier)
    return result
