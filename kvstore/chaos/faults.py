"""The faults chaos scenarios inject, each done for real:

- ``kill_node``: the storage node's process is killed (``ray.kill``); Ray restarts it on its data
  dir when asked to (``restart=True``), or it stays dead.
- ``crash_machine``: a whole machine (Ray node: raylet, object store, every worker on it) is
  killed without notice; callers see it unavailable until the health checks declare it dead.
- ``corrupt_shard``: one shard's record in a node's segment file, damaged in place: bit flips in
  the shard, its second half zeroed (a torn write), the whole record zeroed, or its record header
  damaged — what a failing disk does. Its neighbours in the segment stay intact.
- ``make_slow``: a storage node whose every read reply is delayed (a sick disk, a noisy
  neighbour): the node is replaced, on its data dir, by ``DelayedStorageNodeActor``, the same
  actor class with a delay in front of ``get``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import RayError

from kvstore.blockstore.segments import RECORD_BYTES
from kvstore.chaos.tier import ChaosTier, wait_until
from kvstore.errors import InvalidArgument, StoreError
from kvstore.runtime.blockstore_actors import (
    StorageNodeActor,
    actor_options,
    find_actor,
    node_actor_name,
)
from kvstore.runtime.deploy import node_data_dir

CORRUPTIONS = ("flip", "torn", "erase", "header")
#: Where one shard's record is: (segment file, offset of the record, record bytes), as
#: ``StorageNode.locate`` answers.
ShardLocation = tuple[str, int, int]


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


def shard_location(tier: ChaosTier, node_id: int, key: bytes) -> ShardLocation:
    """Where storage node ``node_id`` keeps its shard of ``key`` (asked of the node)."""
    (found,) = ray.get(tier.handles.nodes[node_id].locate.remote([bytes(key)]), timeout=30)
    if found is None:
        raise StoreError(f"storage node {node_id} holds no shard of {bytes(key).hex()[:16]}")
    return found


def corrupt_held_shard(
    tier: ChaosTier, node_id: int, key: bytes, how: str, rng: random.Random
) -> ShardLocation:
    """``corrupt_shard`` on the record node ``node_id`` serves for ``key``, made sure of: the
    node's background compaction may move the record between asking where it is and damaging
    it (the damage would then hit a dead copy, and a scrub rightly find nothing), so ask again
    afterwards and damage the new place too until the record stayed put. Returns where."""
    where = shard_location(tier, node_id, key)
    for _attempt in range(10):
        corrupt_shard(where, how, rng)
        now = shard_location(tier, node_id, key)
        if now == where:
            return where
        where = now
    raise StoreError(f"storage node {node_id} kept moving its shard of {bytes(key).hex()[:16]}")


def corrupt_shard(location: ShardLocation, how: str, rng: random.Random) -> None:
    """Damage one shard's record in place, the way ``how`` says (one of ``CORRUPTIONS``)."""
    if how not in CORRUPTIONS:
        raise InvalidArgument("how", f"must be one of {CORRUPTIONS}, got {how!r}")
    path, offset, size = location
    with open(path, "r+b") as handle:  # in place (same inode): what bit rot leaves behind
        handle.seek(offset)
        data = bytearray(handle.read(size))
        body = len(data) - RECORD_BYTES
        if how == "erase":
            data[:] = bytes(len(data))
        elif how == "torn":
            data[RECORD_BYTES + body // 2 :] = bytes(len(data) - RECORD_BYTES - body // 2)
        elif how == "header":
            data[rng.randrange(0, RECORD_BYTES)] ^= 0xFF
        else:  # a few random bit flips in the shard (codec header + fragment)
            for _ in range(3):
                position = rng.randrange(RECORD_BYTES, len(data))
                data[position] ^= 1 << rng.randrange(8)
        handle.seek(offset)
        handle.write(bytes(data))


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

    def _served(self) -> Any:
        """Reads over the direct socket are delayed too."""
        return _DelayedReads(self._node, self)


class _DelayedReads:
    """The plain node as the direct socket sees it, with the actor's delay before ``get``."""

    def __init__(self, node: Any, actor: _DelayedStorageNode) -> None:
        self._node = node
        self._actor = actor

    def _sick_disk(self) -> None:
        delay = getattr(self._actor, "_delay_s", 0.0)  # a call may come before __init__ ends
        if delay > 0:
            # The socket thread calls this holding the node's lock; the delay is a sick disk
            # in front of the read, not a node that stops answering pings: sleep without it.
            self._actor._lock.release()
            try:
                time.sleep(delay)
            finally:
                self._actor._lock.acquire()

    def get(self, keys: Sequence[bytes]) -> Any:
        self._sick_disk()
        return self._node.get(keys)

    def shard_extents(self, keys: Sequence[bytes]) -> Any:
        """The engine read socket's way to the shards: as slow as ``get``."""
        self._sick_disk()
        return self._node.shard_extents(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._node, name)


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
        tier.handles.read_key(),
        delay_s=delay_s,
    )
    ray.get(handle.ping.remote(), timeout=120)
    tier.handles.nodes[node_id] = handle
    return handle


def make_normal(tier: ChaosTier, node_id: int) -> None:
    """Put the ordinary storage node actor back (on the same data dir)."""
    tier.restart_node(node_id)
