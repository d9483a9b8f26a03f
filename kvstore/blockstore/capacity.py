"""How many bytes a storage node holds and may hold, and what a set of nodes holds together.

Why (issue 15): capacity defaulted to 64 GiB per node whatever the disk, while 12 nodes shared
one filesystem here (the GC believed in 12 x 64 GiB with 77 GB free, and the disk hit ENOSPC long
before the high watermark), and usage counted apparent sizes (200 one-byte blocks, 2,400 shard
files of ~176 B, counted 0.4 MB and took 9.8 MB of disk blocks). The rules:

- **Bytes held** are what a node's segment files take on disk, ``st_blocks * 512``, not their
  sizes; **live bytes** are the records its index points at (the rest is dead: replaced,
  evicted, deleted, until compaction gives it back). The GC counts live bytes against its
  watermarks (evicting for dead bytes would evict blocks compaction is about to make room
  for).
- **Capacity set** (``StorageNodeConfig.capacity_bytes``): the operator's figure for what the
  blocks may take (live bytes), summed as given; the log's overhead (commit and delete marks,
  dead bytes until compaction, at most ``1 / compact_live_fraction`` of it in segments that
  compaction has not reached) comes on top, so leave the disk that margin.
- **Capacity from the disk** (``capacity_bytes=None``, the default): the node's filesystem has
  ``headroom`` = what it has free for unprivileged writers (``f_bavail``) less a reserve left
  for everything else, ``max(disk_reserve_fraction * its size, disk_reserve_bytes)`` (10 % or
  1 GiB); a node may hold its own bytes + that headroom, and a put is refused once it is spent.
- **One filesystem counted once.** Every node reports with its usage the identity of its
  filesystem (the host's boot id with the ``st_dev`` of its data dir: ``st_dev`` alone repeats
  across machines, and every machine's root disk is often 8:1) and its headroom; a sum over
  nodes (``tier_usage``) adds each filesystem's headroom once, to the bytes all its nodes hold.
  So the sum never exceeds what the disks have free plus what the nodes already hold.

Not covered: btrfs subvolumes have their own ``st_dev`` on one pool of space (counted apart,
i.e. high).
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: Where Linux names this boot of the kernel: the scope in which ``st_dev`` numbers are unique.
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def allocated_bytes(status: os.stat_result) -> int:
    """Bytes a file takes on disk (its blocks), not its size."""
    return int(status.st_blocks) * 512


def headroom_bytes(disk: os.statvfs_result, reserve_fraction: float, reserve_bytes: int) -> int:
    """Bytes that may still be written to the filesystem ``disk`` describes, keeping the
    reserve free: ``f_bavail`` (what unprivileged writers get: reserved blocks excluded) less
    ``max(reserve_fraction * size, reserve_bytes)``, never below 0."""
    size = disk.f_blocks * disk.f_frsize
    free = disk.f_bavail * disk.f_frsize
    reserve = max(int(reserve_fraction * size), reserve_bytes)
    return max(0, free - reserve)


def filesystem_id(st_dev: int, host: str | None = None) -> int:
    """An integer naming the filesystem with device number ``st_dev`` on this host (``host``:
    the host's identity, default this kernel's boot id), equal for every directory on it and
    distinct across machines. 63 bits, so it travels as a plain int."""
    digest = hashlib.blake2b(f"{host or host_identity()}/{st_dev}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def host_identity() -> str:
    """This kernel's boot id (every container on one kernel shares it, as they share its
    device numbers); the host name where there is none."""
    try:
        with open(_BOOT_ID) as handle:
            return handle.read().strip()
    except OSError:
        return socket.gethostname()


@dataclass(frozen=True, slots=True)
class NodeDisk:
    """The filesystem of one node's data dir: its identity and how to measure its headroom."""

    filesystem: int
    block_size: int
    reserve_fraction: float
    reserve_bytes: int

    @classmethod
    def of(cls, dir_fd: int, reserve_fraction: float, reserve_bytes: int) -> NodeDisk:
        block = os.fstatvfs(dir_fd).f_bsize or 4096
        return cls(filesystem_id(os.fstat(dir_fd).st_dev), block, reserve_fraction, reserve_bytes)

    def headroom(self, dir_fd: int) -> int:
        """Bytes the filesystem may still take now (a ``statvfs``: about a microsecond)."""
        return headroom_bytes(os.fstatvfs(dir_fd), self.reserve_fraction, self.reserve_bytes)

    def blocks_for(self, size: int) -> int:
        """Disk bytes a new file of ``size`` bytes is expected to take (before it exists)."""
        return -(-size // self.block_size) * self.block_size


def tier_usage(usages: Iterable[Mapping[str, int]]) -> tuple[int, int]:
    """(live bytes held, capacity) of the nodes whose ``StorageNode.usage()`` replies are
    ``usages``: explicit capacities summed, the headroom of each shared filesystem counted once
    (the smallest any of its nodes reported: they were measured moments apart)."""
    used = explicit = 0
    held_on: dict[int, int] = {}
    headroom_of: dict[int, int] = {}
    for usage in usages:
        held = int(usage["bytes_used"])
        # What the blocks take: the live records of the nodes' logs. Dead bytes (replaced,
        # evicted, deleted) are space compaction is giving back, not a reason to evict more.
        used += int(usage.get("live_bytes", held))
        if not usage.get("capacity_from_disk", 0):
            explicit += int(usage["capacity_bytes"])
            continue
        filesystem = int(usage["filesystem"])
        held_on[filesystem] = held_on.get(filesystem, 0) + held
        room = int(usage["headroom_bytes"])
        headroom_of[filesystem] = min(headroom_of.get(filesystem, room), room)
    shared = sum(held_on[fs] + headroom_of[fs] for fs in held_on)
    return used, explicit + shared
