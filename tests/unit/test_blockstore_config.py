"""Block tier configuration."""

from __future__ import annotations

import pytest

from kvstore.blockstore.config import BlockStoreConfig, StorageNodeConfig
from kvstore.errors import ConfigError


def test_defaults_follow_the_spec() -> None:
    config = BlockStoreConfig()
    assert (config.data_shards, config.parity_shards, config.stripe_width) == (10, 2, 12)
    assert config.storage_nodes >= 12
    assert config.traffic_classes == ("default", "agent", "chatbot")
    assert config.class_id("chatbot") == 2 and config.class_name(1) == "agent"
    assert config.lease_seconds == 30.0


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"storage_nodes": 11}, "storage_nodes"),
        ({"data_shards": 0}, "data_shards"),
        ({"traffic_classes": ("a", "a")}, "traffic_classes"),
        ({"lease_seconds": 0}, "lease_seconds"),
        ({"hedge_after_s": -1.0}, "hedge_after_s"),
        ({"hedge_percentile": 40.0}, "hedge_percentile"),
        ({"hedge_percentile": 101}, "hedge_percentile"),
        ({"release_batch_s": 1.5}, "release_batch_s"),
        ({"release_batch_s": True}, "release_batch_s"),
        ({"repair_stripes_per_round": 0}, "repair_stripes_per_round"),
        ({"repair_bytes_per_s": 0}, "repair_bytes_per_s"),
        ({"repair_round_bytes": -1}, "repair_round_bytes"),
        ({"scrub_bytes_per_s": -1}, "scrub_bytes_per_s"),
        ({"min_write_shards": 9}, "min_write_shards"),
        ({"min_write_shards": 13}, "min_write_shards"),
        ({"repair_class_order": ("nope",)}, "repair_class_order"),
        ({"repair_class_order": ("agent", "agent")}, "repair_class_order"),
        ({"data_root": ""}, "data_root"),
        ({"deployment": "a b"}, "deployment"),
    ],
)
def test_bad_values_name_their_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        BlockStoreConfig(**changes)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_node_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="fsync"):
        StorageNodeConfig(fsync="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="capacity_bytes"):
        StorageNodeConfig(capacity_bytes=0)
    with pytest.raises(ConfigError, match="cached_log_bytes"):
        StorageNodeConfig(cached_log_bytes=-1)
    assert StorageNodeConfig(cached_log_bytes=None).cached_log_bytes is None  # no bound
    with pytest.raises(ConfigError, match="traffic_class"):
        BlockStoreConfig().class_id("bulk")


def test_from_env_and_from_mapping() -> None:
    config = BlockStoreConfig.from_env(
        {
            "KVSTORE_BLOCKSTORE_STORAGE_NODES": "14",
            "KVSTORE_BLOCKSTORE_LEASE_SECONDS": "12.5",
            "KVSTORE_BLOCKSTORE_TRAFFIC_CLASSES": "default, agent",
            "KVSTORE_BLOCKSTORE_NODE_FSYNC": "never",
            "KVSTORE_BLOCKSTORE_DATA_ROOT": "/data/blocks",
            "KVSTORE_BLOCKSTORE_NODE_CACHED_LOG_BYTES": "67108864",
        }
    )
    assert config.node.cached_log_bytes == 64 << 20
    assert config.storage_nodes == 14 and config.lease_seconds == 12.5
    assert config.traffic_classes == ("default", "agent")
    assert config.node.fsync == "never" and config.data_root == "/data/blocks"
    with pytest.raises(ConfigError, match="storage_nodes"):
        BlockStoreConfig.from_env({"KVSTORE_BLOCKSTORE_STORAGE_NODES": "many"})
    mapped = BlockStoreConfig.from_mapping({"meta_shards": 2, "node": {"fsync": "always"}})
    assert mapped.meta_shards == 2 and mapped.node.fsync == "always"
    with pytest.raises(ConfigError, match="bogus"):
        BlockStoreConfig.from_mapping({"bogus": 1})
