"""Repair: health tracking on a manual clock, re-encoding lost shards onto healthy nodes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from blockstore_tier import Tier

from kvstore.blockstore.fanout import META, NODE
from kvstore.blockstore.repair import HealthTracker, Repairer
from kvstore.blockstore.repairloop import RepairLoop
from kvstore.clock import ManualClock
from kvstore.ec import Codec
from kvstore.errors import InvalidArgument


def _key(i: int) -> bytes:
    return hashlib.blake2b(b"repair" + i.to_bytes(8, "little"), digest_size=32).digest()


def test_health_tracker_declares_death_after_the_deadline_and_forgets_on_success() -> None:
    clock = ManualClock(100.0)
    health = HealthTracker(dead_after_s=10, clock=clock)
    health.observe(1, ok=False)
    clock.advance(9)
    health.observe(1, ok=False)
    assert health.dead == set()
    clock.advance(1)
    health.observe(1, ok=False)
    assert health.dead == {1}
    health.observe(1, ok=True)
    assert health.dead == set() and health.failing() == {}
    health.observe(2, ok=False, definitely_dead=True)  # Ray says so: no waiting
    assert health.dead == {2}


def _placements(tier: Tier, keys: list[bytes]) -> np.ndarray:
    rows = []
    for key in keys:
        shard = next(iter(tier.client._by_meta([key])))
        rows.append(tier.metas[shard].locate([key]).placements[0])
    return np.stack(rows)


def test_repair_restores_twelve_healthy_shards_on_distinct_nodes(tmp_path: Path) -> None:
    tier = Tier(tmp_path, nodes=14, repair_stripes_per_round=8)
    keys = [_key(i) for i in range(30)]
    payloads = [np.random.default_rng(i).integers(0, 256, 5000, dtype=np.uint8) for i in range(30)]
    assert tier.client.put_blocks(keys, payloads, "agent").ok
    before = _placements(tier, keys)
    affected = np.isin(before, [4, 9])
    tier.fanout.dead |= {(NODE, 4), (NODE, 9)}
    health = HealthTracker(dead_after_s=5, clock=tier.clock)
    loop = RepairLoop(Repairer(tier.config, tier.fanout, clock=tier.clock), health, tier.clock)
    loop.tick()  # first failures observed, not dead yet
    assert health.dead == set() and loop.stats().get("stripes", 0) == 0
    tier.clock.advance(6)
    steps = 0
    while loop.tick().get("stripes"):
        steps += 1
        assert steps < 20
    assert health.dead == {4, 9}
    assert all(m.mark_nodes() == [4, 9] for m in tier.metas.values())  # published
    placements = _placements(tier, keys)
    assert not np.isin(placements, [4, 9]).any()
    assert all(len(set(row)) == 12 for row in placements.tolist())
    assert (placements >= 0).all()
    stats = loop.stats()
    assert stats["stripes"] == affected.any(axis=1).sum()
    assert stats["shards"] == affected.sum()
    assert np.array_equal(placements[~affected], before[~affected])  # nothing else moved
    assert stats["bytes"] > 0 and stats["throughput_bytes_per_s"] > 0
    # the repaired blocks read bit-exact from healthy nodes only, even with 2 more nodes gone
    tier.fanout.dead |= {(NODE, 0), (NODE, 1)}
    got = tier.client.get_blocks(keys)
    for g, p in zip(got, payloads, strict=True):
        assert g is not None and g.tobytes() == p.tobytes()


def test_unrecoverable_stripes_are_counted_and_skipped(tmp_path: Path) -> None:
    tier = Tier(tmp_path, nodes=14)
    keys = [_key(i) for i in range(20)]
    tier.client.put_blocks(keys, [bytes([i]) * 3000 for i in range(20)])
    dead = {1, 2, 3}
    tier.fanout.dead |= {(NODE, n) for n in dead}
    repairer = Repairer(tier.config, tier.fanout)
    total = {"stripes": 0.0, "unrecoverable": 0.0}
    for _ in range(10):
        step = repairer.round(dead, set())
        for name in total:
            total[name] += step.get(name, 0.0)
    placements = _placements(tier, keys)
    hit = np.isin(placements, list(dead))
    assert total["unrecoverable"] >= 1
    assert (hit.sum(axis=1) <= 2).sum() >= 1


def test_a_failing_tick_is_survived(tmp_path: Path) -> None:
    tier = Tier(tmp_path, nodes=12)

    class Broken(Repairer):
        def round(
            self, dead: set[int], draining: set[int], refresh: bool = False
        ) -> dict[str, float]:
            raise RuntimeError("boom")

    health = HealthTracker(dead_after_s=0.0, clock=tier.clock)
    tier.fanout.dead.add((NODE, 0))
    loop = RepairLoop(Broken(tier.config, tier.fanout), health)
    assert loop.tick() == {}
    assert loop.errors == 1 and loop.ticks == 1
    tier.fanout.dead.add((META, 0))
    assert loop.tick() == {}


def _rot(node_dir: Path, shard: np.ndarray) -> None:
    """Flip a bit of ``shard`` where its node stored it, in place (bit rot): wherever in the
    node's files its bytes are, whatever the layout."""
    needle = shard.tobytes()
    for path in sorted(p for p in node_dir.rglob("*") if p.is_file()):
        at = path.read_bytes().find(needle)
        if at >= 0:
            with open(path, "r+b") as handle:
                handle.seek(at + 200)
                byte = handle.read(1)[0]
                handle.seek(at + 200)
                handle.write(bytes([byte ^ 0x01]))
            return
    raise AssertionError(f"no file under {node_dir} holds the shard")


def test_a_scrubbed_corrupt_shard_is_recreated(tmp_path: Path) -> None:
    tier = Tier(tmp_path, nodes=12)
    keys = [_key(i) for i in range(6)]
    payloads = [bytes([i]) * 7000 for i in range(6)]
    assert tier.client.put_blocks(keys, payloads).ok
    placement = _placements(tier, [keys[0]])[0]
    victim = int(placement[0])
    _rot(tmp_path / f"node-{victim}", Codec().encode(payloads[0], keys[0])[0])
    health = HealthTracker(dead_after_s=5, clock=tier.clock)
    loop = RepairLoop(Repairer(tier.config, tier.fanout), health, tier.clock)
    loop.tick()  # the scrub's clock starts
    tier.clock.advance(tier.config.health_interval_s)
    step = loop.tick()
    assert loop.stats()["corrupt_shards"] == 1
    assert loop.stats()["scrub"]["corrupt"] == 1
    assert step["shards"] == 1  # re-created on the only node outside the stripe: the same one
    assert _placements(tier, [keys[0]])[0].tolist() == placement.tolist()
    assert tier.nodes[victim].scrub(100)["corrupt"] == []
    tier.fanout.dead |= {(NODE, int(placement[1])), (NODE, int(placement[2]))}
    assert [
        g.tobytes() if g is not None else None for g in tier.client.get_blocks(keys)
    ] == payloads


def test_a_drain_moves_every_shard_off_the_node_and_never_drops_one(tmp_path: Path) -> None:
    tier = Tier(tmp_path, nodes=14, repair_stripes_per_round=5)
    keys = [_key(100 + i) for i in range(24)]
    payloads = [np.random.default_rng(i).integers(0, 256, 4000, dtype=np.uint8) for i in range(24)]
    assert tier.client.put_blocks(keys, payloads, "chatbot").ok
    victim = int(np.bincount(_placements(tier, keys).ravel()).argmax())
    loop = RepairLoop(
        Repairer(tier.config, tier.fanout, clock=tier.clock),
        HealthTracker(dead_after_s=5, clock=tier.clock),
        tier.clock,
    )
    status = loop.drain(victim)
    assert status["draining"] and not status["done"]
    assert tier.nodes[victim].draining  # kept on the node: a restart still drains
    for _ in range(40):
        loop.tick()
        placements = _placements(tier, keys)
        # every stripe has 12 shards on 12 distinct nodes after every round
        assert (placements >= 0).all() and all(len(set(r)) == 12 for r in placements.tolist())
        for key, row in zip(keys, placements.tolist(), strict=True):
            assert all(tier.nodes[n].holds([key]) == [True] for n in row)
        tier.clock.advance(0.2)
        if loop.drain_status(victim)["done"]:
            break
    assert loop.drain_status(victim)["done"]
    assert not np.isin(_placements(tier, keys), [victim]).any()
    assert tier.nodes[victim].holds(keys) == [False] * len(keys)  # moved shards deleted
    assert loop.stats()["draining"][str(victim)] == {
        "stripes_left": 0,
        "bytes_left": 0,
        "done": True,
    }
    # a put now skips the draining node; undrain puts it back in service
    fresh = [_key(500 + i) for i in range(10)]
    assert tier.client.put_blocks(fresh, [b"x" * 3000] * 10).ok
    assert not np.isin(_placements(tier, fresh), [victim]).any()
    loop.drain(victim, False)
    assert not tier.nodes[victim].draining and str(victim) not in loop.stats()["draining"]
    assert [g.tobytes() if g is not None else None for g in tier.client.get_blocks(keys)] == [
        p.tobytes() for p in payloads
    ]


def test_rounds_are_paced_to_the_byte_cap(tmp_path: Path) -> None:
    tier = Tier(tmp_path, nodes=14, repair_stripes_per_round=4, repair_bytes_per_s=10_000)
    keys = [_key(200 + i) for i in range(20)]
    assert tier.client.put_blocks(keys, [bytes([i]) * 20_000 for i in range(20)]).ok
    tier.fanout.dead.add((NODE, 3))
    health = HealthTracker(dead_after_s=0.0, clock=tier.clock)
    health.declare_dead(3)
    loop = RepairLoop(Repairer(tier.config, tier.fanout, clock=tier.clock), health, tier.clock)
    step = loop.tick()
    assert step["stripes"] == 4 and loop.backlog()
    # ~4 shards of 2,000 bytes at 10,000 B/s: the next round waits ~0.8 s less the burst
    assert 0.4 < loop.pace_s() < 0.7
    tier.clock.advance(loop.pace_s() + 0.3)
    assert loop.pace_s() == 0.0
    progress = loop.stats()["progress"]
    assert progress["lost_1"] == progress["stripes_left"] > 0
    assert progress["bytes_left"] > 0 and progress["rate_bytes_per_s"] > 0


def test_set_rates_refuses_bad_values(tmp_path: Path) -> None:
    tier = Tier(tmp_path, nodes=12)
    loop = RepairLoop(Repairer(tier.config, tier.fanout), HealthTracker(5.0), tier.clock)
    assert loop.set_rates(repair_bytes_per_s=5, scrub_bytes_per_s=0) == {
        "repair_bytes_per_s": 5,
        "scrub_bytes_per_s": 0,
    }
    with pytest.raises(InvalidArgument, match="repair_bytes_per_s"):
        loop.set_rates(repair_bytes_per_s=0)
    with pytest.raises(InvalidArgument, match="node_id"):
        loop.drain(99)
