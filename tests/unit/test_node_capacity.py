"""Storage node capacity: the disk's headroom with its reserve, a shared filesystem counted once
in a sum over nodes, the operator's figure kept, and the config paths that set it."""

from __future__ import annotations

import os

import pytest

from kvstore.blockstore.capacity import filesystem_id, headroom_bytes, tier_usage
from kvstore.blockstore.config import BlockStoreConfig, StorageNodeConfig
from kvstore.config import ServiceConfig
from kvstore.errors import ConfigError

GIB = 2**30


def _disk(size: int, free: int, unit: int = 4096) -> os.statvfs_result:
    """A statvfs reply: ``size`` bytes, ``free`` of them available to unprivileged writers."""
    blocks = size // unit
    return os.statvfs_result((unit, unit, blocks, blocks, free // unit, 0, 0, 0, 0, 255))


def _usage(used: int, fs: int, headroom: int) -> dict[str, int]:
    """A node's usage reply with its capacity from the disk."""
    return {
        "bytes_used": used,
        "capacity_bytes": used + headroom,
        "capacity_from_disk": 1,
        "filesystem": fs,
        "headroom_bytes": headroom,
    }


def test_headroom_keeps_ten_percent_or_one_gib_free_whichever_is_larger() -> None:
    assert headroom_bytes(_disk(100 * GIB, 30 * GIB), 0.10, GIB) == 20 * GIB
    assert headroom_bytes(_disk(4 * GIB, 3 * GIB), 0.10, GIB) == 2 * GIB  # 1 GiB > 10 %
    assert headroom_bytes(_disk(100 * GIB, 5 * GIB), 0.10, GIB) == 0  # below the reserve
    assert headroom_bytes(_disk(100 * GIB, 30 * GIB), 0.0, 0) == 30 * GIB
    # This machine's figures: 252 GiB disk, 78 GiB available, reserve 25.2 GiB.
    assert headroom_bytes(_disk(270_553_174_016, 83_502_567_424), 0.10, GIB) == (
        83_502_567_424 - 27_055_317_401
    )


def test_nodes_sharing_a_filesystem_count_its_headroom_once() -> None:
    twelve = [_usage(10 * GIB, fs=7, headroom=50 * GIB) for _ in range(12)]
    assert tier_usage(twelve) == (120 * GIB, 120 * GIB + 50 * GIB)
    naive = sum(u["capacity_bytes"] for u in twelve)
    assert naive == 120 * GIB + 12 * 50 * GIB  # what summing each node's own figure says
    # Two filesystems: each counted once; its smallest report wins (measured moments apart).
    mixed = [_usage(GIB, 1, 40 * GIB), _usage(GIB, 1, 39 * GIB), _usage(2 * GIB, 2, 5 * GIB)]
    assert tier_usage(mixed) == (4 * GIB, 2 * GIB + 39 * GIB + 2 * GIB + 5 * GIB)


def test_explicit_capacities_are_summed_as_the_operator_set_them() -> None:
    explicit = {"bytes_used": GIB, "capacity_bytes": 64 * GIB, "capacity_from_disk": 0}
    assert tier_usage([explicit, explicit]) == (2 * GIB, 128 * GIB)
    assert tier_usage([explicit, _usage(GIB, 3, 10 * GIB)]) == (2 * GIB, 64 * GIB + 11 * GIB)
    older = {"bytes_used": 5, "capacity_bytes": 100}  # a node of an earlier version
    assert tier_usage([older]) == (5, 100)
    assert tier_usage([]) == (0, 0)


def test_a_filesystem_is_named_by_its_host_and_device() -> None:
    assert filesystem_id(2049, "host-a") == filesystem_id(2049, "host-a")
    assert filesystem_id(2049, "host-a") != filesystem_id(2049, "host-b")  # same 8:1 elsewhere
    assert filesystem_id(2049, "host-a") != filesystem_id(2050, "host-a")
    assert 0 <= filesystem_id(2049) < 2**63


def test_capacity_config_defaults_to_the_disk_and_checks_explicit_values() -> None:
    config = StorageNodeConfig()
    assert config.capacity_bytes is None
    assert (config.disk_reserve_fraction, config.disk_reserve_bytes) == (0.10, GIB)
    assert StorageNodeConfig(capacity_bytes=5).capacity_bytes == 5
    for field, value in [
        ("capacity_bytes", 0),
        ("capacity_bytes", -1),
        ("capacity_bytes", True),
        ("capacity_bytes", 1.5),
        ("disk_reserve_fraction", 1.0),
        ("disk_reserve_fraction", -0.1),
        ("disk_reserve_fraction", True),
        ("disk_reserve_bytes", -1),
    ]:
        with pytest.raises(ConfigError, match=field):
            StorageNodeConfig(**{field: value})


def test_node_capacity_from_the_environment_and_from_service_config() -> None:
    env = {"KVSTORE_BLOCKSTORE_NODE_CAPACITY_BYTES": "123456789"}
    assert BlockStoreConfig.from_env(env).node.capacity_bytes == 123456789
    for auto in ("auto", "none"):
        node = BlockStoreConfig.from_env({"KVSTORE_BLOCKSTORE_NODE_CAPACITY_BYTES": auto}).node
        assert node.capacity_bytes is None
    reserve = {"KVSTORE_BLOCKSTORE_NODE_DISK_RESERVE_FRACTION": "0.25"}
    assert BlockStoreConfig.from_env(reserve).node.disk_reserve_fraction == 0.25
    with pytest.raises(ConfigError, match="KVSTORE_BLOCKSTORE_NODE_CAPACITY_BYTES"):
        BlockStoreConfig.from_env({"KVSTORE_BLOCKSTORE_NODE_CAPACITY_BYTES": "0"})
    # What `kvstore up --capacity-bytes` passes; the keyword wins over the environment.
    service = ServiceConfig.from_env(env, data_root="/x", node_capacity_bytes=5 * GIB)
    assert service.blockstore.node.capacity_bytes == 5 * GIB
    assert ServiceConfig.from_env(env, data_root="/x").blockstore.node.capacity_bytes == 123456789
    unset = ServiceConfig.from_env({}, data_root="/x", node_capacity_bytes=None)
    assert unset.blockstore.node.capacity_bytes is None  # None: not given, from the disk
    with pytest.raises(ConfigError, match="capacity_bytes"):
        ServiceConfig.from_env({}, data_root="/x", node_capacity_bytes=0)
