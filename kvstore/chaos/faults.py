"""The faults chaos scenarios inject, each done for real:

- ``kill_node``: the storage node's process is killed (``ray.kill``); Ray restarts it on its data
  dir when asked to (``restart=True``), or it stays dead.
- ``crash_machine``: a whole machine (Ray node: raylet, object store, every worker on it) is
  killed without notice; callers see it unavailable until the health checks declare it dead.
- ``corrupt_shard``: a shard file on disk gets bit flips, is truncated, is deleted, or has its
  header damaged — what a failing disk or an operator's mistake does.
- ``make_slow``: a storage node whose every read reply is delayed (a sick disk, a noisy
  neighbour): the node is replaced, on its data dir, by ``DelayedStorageNodeActor``, the same
  actor class with a delay in front of ``get``.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayError

from kvstore.blockstore.shardfile import NODE_HEADER_BYTES
from kvstore.chaos.tier import ChaosTier, wait_until
from kvstore.errors import InvalidArgument, StoreError
from kvstore.runtime.blockstore_actors import (
    StorageNodeActor,
    actor_options,
    find_actor,
    node_actor_name,
)
from kvstore.runtime.deploy import node_data_dir

CORRUPTIONS = ("flip", "truncate", "delete", "header")


def kill_node(tier: ChaosTier, node_id: int, *, restart: bool) -> float:
    """Kill storage node ``node_id``'s process; returns the time of the kill (monotonic)."""
    tier.handles.kill_node(node_id, restart=restart)
    return time.monotonic()


def kill_nodes(tier: ChaosTier, node_ids: Sequence[int], *, restart: bool) -> float:
    """Kill storage nodes' processes at once; returns the time the last was gone (monotonic)."""
    tier.handles.kill_nodes(node_ids, restart=restart)
    return time.monotonic()


def crash_machine(tier: ChaosTier, machine: str) -> float:
    """Kill every process of ``machine`` at once (no graceful shutdown)."""
    if machine not in tier.owned:
        raise InvalidArgument("machine", f"{machine!r} is not a machine this chaos run owns")
    tier.cluster.remove_machine(machine, graceful=False)
    return time.monotonic()


def shard_file(tier: ChaosTier, node_id: int, key: bytes) -> Path:
    return Path(node_data_dir(tier.blockstore_config, node_id)) / "shards" / bytes(key).hex()


def corrupt_shard(path: Path, how: str, rng: random.Random) -> None:
    """Damage one shard file in place, the way ``how`` says (one of ``CORRUPTIONS``)."""
    if how not in CORRUPTIONS:
        raise InvalidArgument("how", f"must be one of {CORRUPTIONS}, got {how!r}")
    if how == "delete":
        os.unlink(path)
        return
    data = bytearray(path.read_bytes())
    if how == "truncate":
        data = data[: len(data) // 2]
    elif how == "header":
        data[rng.randrange(0, 40)] ^= 0xFF  # inside the checksummed node header
    else:  # a few random bit flips in the shard body (codec header + fragment)
        for _ in range(3):
            position = rng.randrange(NODE_HEADER_BYTES, len(data))
            data[position] ^= 1 << rng.randrange(8)
    # Written in place (same inode, no rename): what bit rot or a torn write leaves behind.
    with open(path, "r+b") as handle:
        handle.write(bytes(data))
        handle.truncate(len(data))


# --- a slow node -------------------------------------------------------------------------------

_StorageNodeLogic: Any = StorageNodeActor.__ray_actor_class__  # type: ignore[attr-defined]


class _DelayedStorageNode(_StorageNodeLogic):
    """The real storage node actor with a configurable delay in front of every read."""

    def __init__(self, *args: Any, delay_s: float = 0.0) -> None:
        super().__init__(*args)
        self._delay_s = float(delay_s)

    @ray.method(concurrency_group="control")
    def set_delay(self, seconds: float) -> float:
        """Runs beside the reads (its own thread), not queued behind delayed ones."""
        self._delay_s = float(seconds)
        return self._delay_s

    def get(self, keys: Sequence[bytes]) -> Any:
        if self._delay_s > 0:
            time.sleep(self._delay_s)
        return super().get(keys)


#: Reads stay one at a time (the node logic is single-threaded); ``set_delay`` has its own
#: thread so a test can change the delay while reads queue up.
DelayedStorageNodeActor = ray.remote(concurrency_groups={"control": 1})(  # type: ignore[call-overload]
    _DelayedStorageNode
)


def make_slow(tier: ChaosTier, node_id: int, delay_s: float) -> Any:
    """Replace node ``node_id`` (same name, data dir and machine) by a delayed one; returns its
    handle (``set_delay`` changes the delay). Pause the repair loop around this: the swap is a
    restart it would otherwise see."""
    config = tier.blockstore_config
    name = node_actor_name(config.deployment, node_id)
    old = tier.handles.nodes[node_id]
    try:
        ray.kill(old, no_restart=True)
    except RayError:
        pass
    if wait_until(lambda: find_actor(name) is None, 30, 0.05) is None:
        raise StoreError(f"storage node {node_id} did not go away")
    options = actor_options(name, **tier.handles.node_options.get(node_id, {}))
    handle = DelayedStorageNodeActor.options(**options).remote(
        node_id,
        node_data_dir(config, node_id),
        config.node,
        config.deployment,
        config.meta_shards,
        config.call_timeout_s,
        delay_s=delay_s,
    )
    ray.get(handle.ping.remote(), timeout=120)
    tier.handles.nodes[node_id] = handle
    return handle


def make_normal(tier: ChaosTier, node_id: int) -> None:
    """Put the ordinary storage node actor back (on the same data dir)."""
    tier.restart_node(node_id)
