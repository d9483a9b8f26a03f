"""Failure domains: several storage nodes on one host, and a stripe holding at most ceil(12 /
hosts) shards on a host, in new placements, degraded writes and repairs alike; where the live
hosts cannot hold a whole stripe under that cap it rises as little as needed (a whole stripe
beats one left short)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from blockstore_tier import Tier, placements_of, reads_exact

from kvstore.blockstore.calls import node_target
from kvstore.blockstore.config import BlockStoreConfig
from kvstore.blockstore.placement import FailureDomains, place, replacements
from kvstore.blockstore.repair import HealthTracker, Repairer
from kvstore.blockstore.repairloop import RepairLoop
from kvstore.errors import ConfigError, InvalidArgument

WIDTH = 12
#: 21 nodes on 7 hosts, node i on host i mod 7 (as ``kvstore.runtime.deploy`` places them): 3 a
#: host, more than the cap of 2, so the cap decides (with 2 a host it would hold by itself).
NODES = 21
HOSTS = tuple(f"h{i % 7}" for i in range(NODES))


def _on_host(*hosts: int) -> list[int]:
    return [n for n in range(NODES) if n % 7 in hosts]


def _keys(count: int, salt: bytes = b"") -> list[bytes]:
    return [
        hashlib.blake2b(salt + i.to_bytes(8, "little"), digest_size=32).digest()
        for i in range(count)
    ]


def _most_on_one_host(placements: np.ndarray, labels: tuple[str, ...] = HOSTS) -> int:
    most = 0
    for row in placements.tolist():
        hosts = [labels[node] for node in row if node >= 0]
        most = max(most, max(hosts.count(host) for host in set(hosts)))
    return most


def test_the_cap_is_the_stripe_spread_evenly_over_every_host() -> None:
    domains = FailureDomains.of_config(HOSTS, WIDTH)
    assert domains is not None and (domains.count, domains.cap) == (7, 2)
    assert domains.room(range(NODES)) == 14
    assert domains.room([n for n in range(NODES) if n % 7 != 3]) == 12  # a host down: 6 x 2
    assert domains.room([0, 7, 14, 13]) == 3  # 3 nodes of h0 count 2
    assert domains.cap_for(range(NODES), WIDTH) == 2
    five_hosts = [n for n in range(NODES) if n % 7 not in (2, 5)]
    assert domains.room(five_hosts) == 10 and domains.cap_for(five_hosts, WIDTH) == 3
    four = FailureDomains.of_config(tuple(f"h{i % 4}" for i in range(12)), WIDTH)
    assert four is not None and four.cap == 3
    # Nothing to cap: no labels, every node its own domain, or one host for everything.
    assert FailureDomains.of_config((), WIDTH) is None
    assert FailureDomains.of_config(tuple(f"n{i}" for i in range(14)), WIDTH) is None
    assert FailureDomains.of_config(("one",) * 14, WIDTH) is None


def test_placement_caps_each_host_and_stays_deterministic() -> None:
    domains = FailureDomains.of_config(HOSTS, WIDTH)
    keys = _keys(3000)
    placements = place(keys, range(NODES), WIDTH, domains)
    assert _most_on_one_host(placements) == 2
    assert all(len(set(row)) == WIDTH for row in placements.tolist())
    assert np.array_equal(placements, place(keys, list(reversed(range(NODES))), WIDTH, domains))
    # Without the cap, rendezvous alone puts 3 shards of many stripes on one host.
    assert _most_on_one_host(place(keys, range(NODES), WIDTH)) == 3
    # Each node still takes its share of the stripes.
    counts = np.bincount(placements.ravel(), minlength=NODES)
    assert counts.min() > 0.8 * counts.mean() and counts.max() < 1.2 * counts.mean()


def test_placement_raises_the_cap_only_as_far_as_the_hosts_left_need() -> None:
    domains = FailureDomains.of_config(HOSTS, WIDTH)
    five_hosts = [n for n in range(NODES) if n % 7 not in (2, 5)]  # 15 nodes, 10 at 2 a host
    whole = place(_keys(200), five_hosts, WIDTH, domains)
    assert all(len(set(row)) == WIDTH for row in whole.tolist())
    assert _most_on_one_host(whole) == 3
    assert _most_on_one_host(place(_keys(200), five_hosts, 10, domains)) == 2
    with pytest.raises(InvalidArgument, match="11 live nodes"):
        place(_keys(3), list(range(11)), WIDTH, domains)


def test_replacements_keep_the_cap_and_leave_the_stripe_s_own_nodes_out() -> None:
    domains = FailureDomains.of_config(HOSTS, WIDTH)
    keys = _keys(500)
    placements = place(keys, range(NODES), WIDTH, domains).astype(np.int64)
    lost = _on_host(3)
    live = [n for n in range(NODES) if n not in lost]
    wanted = np.isin(placements, lost)
    targets = replacements(keys, live, placements, wanted, domains)
    assert (targets[wanted] >= 0).all() and (targets[~wanted] == -1).all()
    repaired = np.where(wanted, targets, placements)
    assert not np.isin(repaired, lost).any()
    assert all(len(set(row)) == WIDTH for row in repaired.tolist())
    assert _most_on_one_host(repaired) == 2
    # Without the cap the same repair crowds hosts.
    crowded = np.where(wanted, replacements(keys, live, placements, wanted), placements)
    assert _most_on_one_host(crowded) >= 3


def test_a_config_names_a_domain_for_every_node() -> None:
    assert BlockStoreConfig(storage_nodes=NODES, failure_domains=HOSTS).failure_domains == HOSTS
    with pytest.raises(ConfigError, match="each of the 21 storage nodes"):
        BlockStoreConfig(storage_nodes=NODES, failure_domains=HOSTS[:7])


def test_writes_stay_whole_and_capped_with_a_host_down_and_whole_with_three(
    tmp_path: Path,
) -> None:
    tier = Tier(tmp_path, nodes=NODES, failure_domains=HOSTS)
    keys, payloads = _keys(40, b"w"), [np.full(4000, i, np.uint8) for i in range(40)]
    assert tier.client.put_blocks(keys[:20], payloads[:20]).ok
    assert _most_on_one_host(placements_of(tier, keys[:20])) == 2
    tier.fanout.dead |= {node_target(n) for n in _on_host(3)}  # host h3 gone
    result = tier.client.put_blocks(keys[20:], payloads[20:])
    assert result.stored == keys[20:] and result.under_redundant == []
    placed = placements_of(tier, keys[20:])
    assert (placed >= 0).all() and not np.isin(placed, _on_host(3)).any()
    assert _most_on_one_host(placed) == 2
    assert reads_exact(tier, keys, payloads)
    # Two more hosts: 12 nodes on 4 hosts take 8 shards at 2 a host; the cap gives way to 3 so
    # every block is still stored whole, not short.
    tier.fanout.dead |= {node_target(n) for n in _on_host(1, 2)}
    more, data = _keys(5, b"x"), [np.full(700, 9, np.uint8)] * 5
    result = tier.client.put_blocks(more, data)
    assert result.stored == more and result.under_redundant == []
    assert _most_on_one_host(placements_of(tier, more)) == 3
    assert reads_exact(tier, more, data)


def test_repair_after_a_host_loss_keeps_two_shards_a_host(tmp_path: Path) -> None:
    # (With fewer hosts left than the cap allows for, the repair still restores every shard:
    # tests/ray/test_blockstore.py loses 2 of 13 nodes on 3 machines.)
    tier = Tier(tmp_path, nodes=NODES, failure_domains=HOSTS, repair_stripes_per_round=16)
    keys = _keys(60, b"r")
    payloads = [np.random.default_rng(i).integers(0, 256, 3000, np.uint8) for i in range(60)]
    assert tier.client.put_blocks(keys, payloads).ok
    tier.fanout.dead |= {node_target(n) for n in _on_host(5)}
    health = HealthTracker(dead_after_s=5, clock=tier.clock)
    loop = RepairLoop(Repairer(tier.config, tier.fanout, clock=tier.clock), health, tier.clock)
    loop.tick()
    tier.clock.advance(6)
    for _ in range(20):
        if not loop.tick().get("stripes"):
            break
    repaired = placements_of(tier, keys)
    assert (repaired >= 0).all() and not np.isin(repaired, _on_host(5)).any()
    assert _most_on_one_host(repaired) == 2
    assert reads_exact(tier, keys, payloads)


def test_repair_restores_every_shard_when_the_hosts_left_cannot_keep_the_cap(
    tmp_path: Path,
) -> None:
    # 14 nodes on 3 machines (5, 5, 4) hold a stripe at 4 a machine; 2 nodes of the 4-node one
    # die: 12 nodes are left but take only 4 + 4 + 2 at that cap, so the repair must go to 5.
    labels = tuple(f"m{i % 3}" for i in range(14))
    tier = Tier(tmp_path, nodes=14, failure_domains=labels, repair_stripes_per_round=16)
    keys = _keys(40, b"c")
    payloads = [np.random.default_rng(i).integers(0, 256, 2000, np.uint8) for i in range(40)]
    assert tier.client.put_blocks(keys, payloads).ok
    assert _most_on_one_host(placements_of(tier, keys), labels) == 4
    lost = [2, 5]  # both on m2
    tier.fanout.dead |= {node_target(n) for n in lost}
    health = HealthTracker(dead_after_s=5, clock=tier.clock)
    loop = RepairLoop(Repairer(tier.config, tier.fanout, clock=tier.clock), health, tier.clock)
    loop.tick()
    tier.clock.advance(6)
    for _ in range(20):
        if not loop.tick().get("stripes"):
            break
    repaired = placements_of(tier, keys)
    assert (repaired >= 0).all() and not np.isin(repaired, lost).any()
    assert all(len(set(row)) == WIDTH for row in repaired.tolist())
    assert _most_on_one_host(repaired, labels) == 5
    assert reads_exact(tier, keys, payloads)
