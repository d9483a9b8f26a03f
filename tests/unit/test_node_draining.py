"""A draining storage node takes no new shards but serves what it holds: the flag on disk
(``<data_dir>/DRAINING``, kept across restarts), ``put`` refused with ``NodeDraining``, and a
client that places around such a node without counting it failed (its reads still use it)."""

from __future__ import annotations

import hashlib
import pickle
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from blockstore_tier import Tier, placements_of, reads_exact

from kvstore.blockstore.calls import node_target
from kvstore.blockstore.client import BlockStoreClient
from kvstore.blockstore.config import StorageNodeConfig
from kvstore.blockstore.fanout import LocalFanout, Ticket
from kvstore.blockstore.node import StorageNode
from kvstore.clock import ManualClock
from kvstore.ec import Codec
from kvstore.errors import ConfigError, NodeDraining, NodeUnavailable


def _key(i: int) -> bytes:
    return hashlib.blake2b(b"drain" + i.to_bytes(8, "little"), digest_size=32).digest()


def _payload(i: int, size: int = 5000) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def _node(path: Path, clock: ManualClock) -> StorageNode:
    return StorageNode(0, path, StorageNodeConfig(fsync="never"), clock)


def _put(node: StorageNode, token: int, keys: list[bytes], clock: ManualClock) -> list[bool]:
    shards = [Codec().encode(_payload(i), key)[3] for i, key in enumerate(keys)]
    return node.put(token, keys, shards, [0] * len(keys), [clock.now()] * len(keys))


def test_node_draining_is_a_node_unavailable_that_pickles_as_itself() -> None:
    error = pickle.loads(pickle.dumps(NodeDraining("storage node 3 is draining")))
    assert type(error) is NodeDraining and isinstance(error, NodeUnavailable)
    assert str(error) == "storage node 3 is draining"


def test_the_flag_refuses_puts_keeps_everything_else_and_survives_a_restart(
    tmp_path: Path,
) -> None:
    clock = ManualClock(1000.0)
    path = tmp_path / "node"
    node = _node(path, clock)
    keys = [_key(i) for i in range(3)]
    assert not node.draining and node.usage()["draining"] == 0
    assert _put(node, 7, keys, clock) == [True] * 3  # pending before the drain
    assert node.set_draining(True) is True
    assert (path / "DRAINING").is_file() and node.stats()["draining"] == 1
    with pytest.raises(NodeDraining, match="storage node 0 is draining"):
        _put(node, 8, [_key(9)], clock)
    assert node.commit(7, keys[:2]) == [True, True]  # commits, reads, aborts, deletes go on
    assert node.holds(keys) == [True, True, False]
    assert all(shard is not None for shard in node.read_shards(keys[:2]))
    assert node.abort(7, keys[2:]) == 1
    assert node.delete(keys[1:2]) == 1
    node.close()

    node = _node(path, clock)  # a restarted node is still draining
    assert node.draining and node.usage()["draining"] == 1
    with pytest.raises(NodeDraining):
        _put(node, 9, [_key(9)], clock)
    assert node.holds(keys) == [True, False, False]
    assert node.set_draining(True) is True  # again: no change
    assert node.set_draining(False) is False
    assert not (path / "DRAINING").exists()
    assert _put(node, 9, [_key(9)], clock) == [True]
    node.close()

    node = _node(path, clock)
    assert not node.draining
    node.close()


def test_a_drain_flag_that_is_not_a_file_stops_the_node_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "node"
    _node(path, ManualClock(0.0)).close()
    (path / "DRAINING").mkdir()
    with pytest.raises(ConfigError, match="DRAINING is not a regular file"):
        _node(path, ManualClock(0.0))


class PassThroughFanout(LocalFanout):
    """``LocalFanout`` that hands a target's own ``NodeDraining`` back as itself, as
    ``RayFanout`` does (``LocalFanout`` wraps every error a target raises in a plain
    ``NodeUnavailable`` naming it)."""

    def result(self, ticket: Ticket[Any]) -> Any:
        try:
            return super().result(ticket)
        except NodeUnavailable as error:
            if f"{NodeDraining.__name__}(" in str(error):
                raise NodeDraining(str(error)) from None
            raise


def _tier(tmp_path: Path, nodes: int = 13, **config: object) -> Tier:
    tier = Tier(tmp_path, nodes=nodes, **config)
    tier.fanout = PassThroughFanout(tier.fanout.targets)
    tier.client = BlockStoreClient(tier.config, tier.fanout, clock=tier.clock)
    return tier


def test_puts_go_around_a_draining_node_with_full_stripes_and_reads_still_use_it(
    tmp_path: Path,
) -> None:
    tier = _tier(tmp_path)
    old = [_key(i) for i in range(20)]
    old_payloads = [_payload(i) for i in range(20)]
    assert tier.client.put_blocks(old, old_payloads).ok
    tier.nodes[5].set_draining(True)
    held = tier.nodes[5].usage()["shards"]
    keys = [_key(i) for i in range(100, 140)]
    payloads = [_payload(i) for i in range(100, 140)]
    result = tier.client.put_blocks(keys, payloads)
    assert result.stored == keys and result.under_redundant == []  # 12 others: full stripes
    placements = placements_of(tier, keys)
    assert not (placements == 5).any() and (placements >= 0).all()
    assert tier.nodes[5].usage()["shards"] == held and tier.nodes[5].usage()["pending"] == 0
    assert tier.client.stats()["draining_nodes"] == [5]
    assert tier.client.down_nodes() == []  # draining is not failed
    assert reads_exact(tier, keys, payloads)
    # Two other nodes of a stripe that has a shard on node 5 die: that stripe now needs node
    # 5's shard, so a client that had counted node 5 failed would miss it.
    stripe = placements_of(tier, old)
    row = int(np.flatnonzero((stripe == 5).any(axis=1))[0])
    others = [int(n) for n in stripe[row] if n != 5][:2]
    tier.fanout.dead |= {node_target(n) for n in others}
    assert reads_exact(tier, old, old_payloads)


def test_a_drain_called_off_takes_writes_again_after_node_retry_s(tmp_path: Path) -> None:
    tier = _tier(tmp_path, node_retry_s=0.2)
    tier.nodes[5].set_draining(True)
    first = [_key(i) for i in range(30)]
    assert tier.client.put_blocks(first, [_payload(i) for i in range(30)]).ok
    assert not (placements_of(tier, first) == 5).any()
    tier.nodes[5].set_draining(False)
    time.sleep(0.25)
    later = [_key(i) for i in range(200, 230)]
    assert tier.client.put_blocks(later, [_payload(i) for i in range(200, 230)]).ok
    assert (placements_of(tier, later) == 5).any()
    assert tier.client.stats()["draining_nodes"] == []


def test_a_draining_node_and_a_dead_one_of_13_leave_11_shard_stripes(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    tier.nodes[5].set_draining(True)
    tier.fanout.dead.add(node_target(9))
    keys = [_key(i) for i in range(20)]
    payloads = [_payload(i) for i in range(20)]
    result = tier.client.put_blocks(keys, payloads)
    assert result.stored == keys and result.under_redundant == keys
    placements = placements_of(tier, keys)
    assert (placements[:, 11] == -1).all() and not np.isin(placements, [5, 9]).any()
    assert reads_exact(tier, keys, payloads)
