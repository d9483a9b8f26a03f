"""Under-redundant writes (``min_write_shards``): with fewer nodes taking writes than a stripe is
wide, but at least ``min_write_shards``, a put stores each block with one shard per such node
(the parity shards past them left out, recorded -1) instead of failing; below it the put fails
cleanly. Real storage nodes on disk and meta shards in one process (``blockstore_tier``)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from blockstore_tier import Tier, placements_of, reads_exact

from kvstore.blockstore.calls import node_target
from kvstore.blockstore.node import StorageNode
from kvstore.blockstore.records import PutResult
from kvstore.errors import InvalidArgument
from kvstore.gc.config import GCConfig
from kvstore.gc.worker import GCWorker
from kvstore.keys import BlockKey
from kvstore.tier.cluster import put_answer

WIDTH = 12


def _key(i: int) -> bytes:
    return hashlib.blake2b(b"under" + i.to_bytes(8, "little"), digest_size=32).digest()


def _payload(i: int, size: int = 5000) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def _blocks(count: int, start: int = 0) -> tuple[list[bytes], list[np.ndarray]]:
    return [_key(i) for i in range(start, start + count)], [
        _payload(i) for i in range(start, start + count)
    ]


def _committed_shards(tier: Tier) -> int:
    return sum(int(node.usage()["shards"]) for node in tier.nodes.values())


def _meta_stat(tier: Tier, name: str) -> int:
    return sum(int(meta.stats()[name]) for meta in tier.metas.values())  # type: ignore[call-overload]


def _kill(tier: Tier, *nodes: int) -> None:
    tier.fanout.dead |= {node_target(node) for node in nodes}


def test_two_dead_of_13_store_every_block_with_11_shards_parity_index_11_left_out(
    tmp_path: Path,
) -> None:
    tier = Tier(tmp_path, nodes=13)
    _kill(tier, 0, 1)
    keys, payloads = _blocks(30)
    result = tier.client.put_blocks(keys, payloads)
    assert result.stored == keys and result.ok
    assert result.under_redundant == keys
    assert tier.client.counters["blocks_under_redundant"] == 30
    placements = placements_of(tier, keys)
    assert (placements[:, 11] == -1).all()  # the last parity shard is the one not written
    assert (placements[:, :11] >= 0).all()
    assert not np.isin(placements, [0, 1]).any()
    assert all(len(set(row[:11].tolist())) == 11 for row in placements)  # distinct domains
    assert _committed_shards(tier) == 30 * 11
    assert sum(int(node.usage()["pending"]) for node in tier.nodes.values()) == 0
    assert _meta_stat(tier, "under_redundant_stripes") == 30
    # every data shard exists: reads decode on the systematic path, bit-exact
    assert reads_exact(tier, keys, payloads)
    assert tier.client.counters["degraded_blocks"] == 0
    # an 11-shard stripe still survives one more loss...
    _kill(tier, int(placements[0, 0]))
    assert reads_exact(tier, keys, payloads)
    # ...but not two more in one stripe: it really holds only 11 shards
    _kill(tier, int(placements[0, 1]))
    assert tier.client.get_blocks(keys[:1]) == [None]


def test_gc_removes_every_shard_of_an_under_redundant_block(tmp_path: Path) -> None:
    tier = Tier(tmp_path, nodes=13)
    _kill(tier, 0, 1)
    keys, payloads = _blocks(10)
    assert tier.client.put_blocks(keys, payloads).under_redundant == keys
    tier.fanout.dead.clear()
    worker = GCWorker(
        GCConfig(ttl={"default": "1d"}),
        tier.fanout,
        meta_shards=list(tier.metas),
        nodes=list(tier.nodes),
        class_names=tier.config.traffic_classes,
        clock=tier.clock,
    )
    tier.clock.advance(2 * 86400)
    report = worker.run_once()
    assert not report.errors  # no delete sent to a -1 "node"
    assert report.expired.total_blocks == 10
    assert report.shards_deleted == 10 * 11
    assert _committed_shards(tier) == 0


def test_a_rebuilt_meta_shard_keeps_11_shard_stripes_readable_and_repairable(
    tmp_path: Path,
) -> None:
    tier = Tier(tmp_path, nodes=13)
    _kill(tier, 0, 1)
    keys, payloads = _blocks(20)
    assert tier.client.put_blocks(keys, payloads).under_redundant == keys
    before = placements_of(tier, keys)
    for shard in list(tier.metas):
        meta = tier.rebuild_meta(shard)
        if len(meta):
            assert meta._lost_shards  # the repair scans for the -1 shards
    after = placements_of(tier, keys)
    assert (after == before).all()  # index 11 still -1, the others where they were
    assert _meta_stat(tier, "under_redundant_stripes") == 20
    assert reads_exact(tier, keys, payloads)


def test_ten_live_nodes_are_fewer_than_min_write_shards_so_the_put_fails_cleanly(
    tmp_path: Path,
) -> None:
    tier = Tier(tmp_path, nodes=13)
    _kill(tier, 0, 1, 2)
    keys, payloads = _blocks(8)
    result = tier.client.put_blocks(keys, payloads)
    assert result.failed == keys and result.stored == [] and result.under_redundant == []
    assert tier.client.lookup(keys).hit_blocks == 0
    assert _meta_stat(tier, "blocks") == 0
    # The shards the live nodes took (committed as written) are orphans: no placement names
    # them, and the reservations were given back, so the scrub drops every one.
    written = _committed_shards(tier)
    assert written > 0 and tier.reclaim_orphans() == written
    assert _committed_shards(tier) == 0
    tier.fanout.dead.clear()
    tier.client._retry_at.clear()
    again = tier.client.put_blocks(keys, payloads)  # the reservations were given back
    assert again.stored == keys and again.under_redundant == []


def test_min_write_shards_12_makes_a_put_around_two_dead_nodes_fail(tmp_path: Path) -> None:
    tier = Tier(tmp_path, nodes=13, min_write_shards=12)
    _kill(tier, 0, 1)
    keys, payloads = _blocks(8)
    result = tier.client.put_blocks(keys, payloads)
    assert result.failed == keys and result.stored == []
    written = _committed_shards(tier)  # what the live nodes of the first placement took
    assert written > 0 and tier.reclaim_orphans() == written and _committed_shards(tier) == 0
    # one dead node leaves 12 live: full stripes
    tier.fanout.dead.discard(node_target(1))
    tier.client._retry_at.clear()
    again = tier.client.put_blocks(keys, payloads)
    assert again.stored == keys and again.under_redundant == []


class Faulty:
    """A storage node whose ``put`` fails: ``"raise"`` (the node went away before writing),
    ``"refuse"`` (it answers False for every shard) or ``"lose_reply"`` (it wrote the shards,
    committed, and its answer was lost)."""

    def __init__(self, node: StorageNode, put: str) -> None:
        self.node = node
        self.fault = put

    def __getattr__(self, name: str) -> object:
        return getattr(self.node, name)

    def put(self, token: int, keys: Sequence[bytes], *rest: object) -> list[bool]:
        if self.fault == "refuse":
            return [False] * len(keys)
        if self.fault == "lose_reply":
            self.node.put(token, keys, *rest)  # type: ignore[arg-type]
        raise OSError(f"node {self.node.node_id} went away during put")


def _faulty(tier: Tier, node: int, put: str) -> None:
    tier.fanout.targets[node_target(node)] = Faulty(tier.nodes[node], put)


def test_a_node_failing_mid_put_of_12_gives_11_shard_commits_without_it(tmp_path: Path) -> None:
    tier = Tier(tmp_path, nodes=12)
    _faulty(tier, 4, put="raise")
    keys, payloads = _blocks(20)
    result = tier.client.put_blocks(keys, payloads)
    assert result.stored == keys and result.under_redundant == keys
    placements = placements_of(tier, keys)
    assert (placements[:, 11] == -1).all() and (placements[:, :11] >= 0).all()
    assert not (placements == 4).any()
    assert tier.client.down_nodes() == [4]
    assert tier.nodes[4].usage()["shards"] == 0  # its put never ran
    # The second attempt's shards replaced the first's on every node: each holds one a block.
    assert _committed_shards(tier) == 20 * 11
    assert sum(int(n.usage()["pending"]) for n in tier.nodes.values()) == 0
    assert reads_exact(tier, keys, payloads)


def test_a_node_refusing_its_shards_leaves_its_index_lost_and_the_rest_committed(
    tmp_path: Path,
) -> None:
    tier = Tier(tmp_path, nodes=12)
    _faulty(tier, 4, put="refuse")
    keys, payloads = _blocks(20)
    result = tier.client.put_blocks(keys, payloads)
    assert result.stored == keys and result.under_redundant == keys
    placements = placements_of(tier, keys)
    assert ((placements == -1).sum(axis=1) == 1).all()
    assert not (placements == 4).any()  # whatever index node 4 had is -1 now
    assert tier.client.down_nodes() == []  # it answered: not failed
    assert reads_exact(tier, keys, payloads)  # decoded from parity where node 4 had a data shard
    assert tier.nodes[4].usage()["shards"] == 0


def test_a_put_whose_answer_was_lost_leaves_its_shards_out_until_the_scrub_drops_them(
    tmp_path: Path,
) -> None:
    tier = Tier(tmp_path, nodes=12)
    _faulty(tier, 7, put="lose_reply")
    keys, payloads = _blocks(20)
    result = tier.client.put_blocks(keys, payloads)
    assert result.stored == keys and result.under_redundant == keys
    placements = placements_of(tier, keys)
    assert ((placements == -1).sum(axis=1) == 1).all() and not (placements == 7).any()
    assert reads_exact(tier, keys, payloads)
    node = tier.nodes[7]
    assert node.usage()["shards"] == 20  # written and committed, but no placement names them
    assert tier.reclaim_orphans() == 20
    assert node.usage()["shards"] == 0 and _committed_shards(tier) == 20 * 11
    assert reads_exact(tier, keys, payloads)


def test_two_nodes_refusing_leave_10_acks_so_the_block_fails_and_its_shards_are_reclaimed(
    tmp_path: Path,
) -> None:
    tier = Tier(tmp_path, nodes=12)
    _faulty(tier, 3, put="refuse")
    _faulty(tier, 7, put="refuse")
    keys, payloads = _blocks(5)
    result = tier.client.put_blocks(keys, payloads)
    assert result.failed == keys and result.stored == []
    assert tier.client.lookup(keys).hit_blocks == 0
    assert _committed_shards(tier) == 5 * 10
    assert tier.reclaim_orphans() == 5 * 10 and _committed_shards(tier) == 0


def test_meta_commit_takes_rows_with_lost_shards_and_refuses_unreadable_or_doubled_ones(
    tmp_path: Path,
) -> None:
    tier = Tier(tmp_path, nodes=13)
    meta = tier.metas[0]
    keys = [BlockKey(_key(i)) for i in range(200)]
    keys = [key for key in keys if tier.client._by_meta([key]) == {0: [0]}]
    eleven = np.array([[*range(11), -1]], np.int32)
    assert meta.commit(keys[:1], 1, eleven, [10], 0) == [True]
    assert meta._lost_shards
    assert meta.stats()["under_redundant_stripes"] == 1
    nine = np.array([[*range(9), -1, -1, -1]], np.int32)
    with pytest.raises(InvalidArgument, match=r"placements\[0\].*9 shards.*at least 10"):
        meta.commit(keys[1:2], 1, nine, [10], 0)
    doubled = np.array([[0, *range(10), 0]], np.int32)
    with pytest.raises(InvalidArgument, match=r"placements\[1\].*names a node twice"):
        meta.commit(keys[1:3], 1, np.vstack([eleven, doubled]), [10, 10], 0)
    full = np.array([list(range(12))], np.int32)
    assert meta.commit(keys[3:4], 1, full, [10], 0) == [True]
    assert meta.stats()["under_redundant_stripes"] == 1
    meta.mark_nodes(down=[5])  # a full stripe with a shard on a dead node is short too
    assert meta.stats()["under_redundant_stripes"] == 2


def test_the_tier_put_answer_counts_the_under_redundant_blocks() -> None:
    keys = [BlockKey(_key(i)) for i in range(3)]
    answer = put_answer(PutResult(stored=keys, failed=[], under_redundant=keys[1:]))
    assert answer.stored == 3 and answer.under_redundant == 2
    assert put_answer(PutResult(stored=keys)).under_redundant == 0
