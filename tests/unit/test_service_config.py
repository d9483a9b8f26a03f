"""The config root: ``ServiceConfig`` embeds each part's own config, the one environment loader
fills them, the shared values (traffic classes, lease length) come from the GC policy only."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.blockstore.config import BlockStoreConfig
from kvstore.config import ServiceConfig
from kvstore.envconfig import from_env
from kvstore.errors import ConfigError
from kvstore.gc.config import GCConfig
from kvstore.geometry import GeometryConfig
from kvstore.swa.config import SWAConfig
from kvstore.traffic import DEFAULT_CLASSES, DEFAULT_LEASE_S, DEFAULT_TTL


def test_the_block_tier_defaults_agree_with_the_built_in_policy() -> None:
    assert BlockStoreConfig().traffic_classes == GCConfig().class_names == DEFAULT_CLASSES
    assert BlockStoreConfig().lease_seconds == GCConfig().lease_default_s == DEFAULT_LEASE_S
    ttl = dict(DEFAULT_TTL)
    by_ttl = tuple(sorted(ttl, key=lambda name: -ttl[name]))
    assert (
        BlockStoreConfig().repair_rank()
        == BlockStoreConfig(repair_class_order=by_ttl).repair_rank()
    )
    assert BlockStoreConfig(traffic_classes=("chatbot", "batch", "default")).repair_rank() == [
        0,
        2,
        1,
    ]
    config = ServiceConfig.from_env({}, data_root="/tmp/kv")
    assert config.blockstore.traffic_classes == config.gc.class_names
    assert config.data_root == Path("/tmp/kv") and config.blockstore.deployment == "kvstore"


def test_the_environment_fills_every_part_and_given_values_win(tmp_path: Path) -> None:
    policy = tmp_path / "gc.toml"
    policy.write_text(
        "[gc]\nlease_default_s = 12\n[gc.ttl]\ndefault = '1d'\nagent = '3d'\nbatch = '2h'\n"
    )
    env = {
        "KVSTORE_BLOCKSTORE_CALL_TIMEOUT_S": "4.5",
        "KVSTORE_BLOCKSTORE_STORAGE_NODES": "14",
        "KVSTORE_BLOCKSTORE_NODE_FSYNC": "always",
        "KVSTORE_SWA_TTL_S": "120",
        "KVSTORE_SWA_NUM_ENTRYPOINTS": "auto",
        "KVSTORE_PRESET": "V4-Pro",
        "KVSTORE_GC_FILE": str(policy),
    }
    config = ServiceConfig.from_env(env, data_root=tmp_path, storage_nodes=16, deployment=None)
    block = config.blockstore
    assert block.call_timeout_s == 4.5 and block.node.fsync == "always"
    assert block.storage_nodes == 16  # given: wins over the environment's 14
    assert block.deployment == "kvstore"  # None means "not given"
    assert config.swa.ttl_s == 120 and config.swa.num_entrypoints is None
    assert config.geometry.preset == "v4-pro"
    # The GC policy is the one source of the classes and the lease length.
    assert block.traffic_classes == ("default", "agent", "batch")
    assert block.lease_seconds == 12 and config.gc.lease_default_s == 12
    fast = ServiceConfig.from_env(env, data_root=tmp_path, fsync="never", preset="v4-flash")
    assert fast.blockstore.node.fsync == "never" and fast.geometry.preset == "v4-flash"


def test_bad_values_are_named() -> None:
    with pytest.raises(ConfigError) as bad:
        ServiceConfig.from_env({"KVSTORE_BLOCKSTORE_CALL_TIMEOUT_S": "soon"}, data_root="/x")
    assert bad.value.field == "KVSTORE_BLOCKSTORE_CALL_TIMEOUT_S"
    assert "call_timeout_s" in str(bad.value)
    with pytest.raises(ConfigError) as literal:
        ServiceConfig.from_env({"KVSTORE_BLOCKSTORE_NODE_FSYNC": "sometimes"}, data_root="/x")
    assert literal.value.field == "KVSTORE_BLOCKSTORE_NODE_FSYNC"
    with pytest.raises(ConfigError) as unknown:
        ServiceConfig.from_env({}, data_root="/x", colour="blue")
    assert unknown.value.field == "colour"
    with pytest.raises(ConfigError, match="storage_nodes"):
        ServiceConfig.from_env({}, data_root="/x", storage_nodes=5)


def test_every_config_reads_the_environment_through_the_one_loader() -> None:
    assert from_env(GeometryConfig, "KVSTORE_", {"KVSTORE_NUM_STATE_SEQS": "3"}).num_state_seqs == 3
    swa = from_env(SWAConfig, "KVSTORE_SWA_", {"KVSTORE_SWA_NAME": ""})
    assert swa == SWAConfig()  # empty = unset
    with pytest.raises(ConfigError) as bad:
        from_env(GeometryConfig, "KVSTORE_", {"KVSTORE_WINDOW": "long"})
    assert bad.value.field == "KVSTORE_WINDOW"


def test_the_block_size_the_tier_accepts_can_be_set_for_an_engine_of_its_own(tmp_path) -> None:
    config = ServiceConfig.from_env({"KVSTORE_BLOCK_BYTES": "131072"}, data_root=tmp_path)
    assert config.block_bytes == 131072
    assert ServiceConfig.from_env({}, data_root=tmp_path, block_bytes=4096).block_bytes == 4096
    assert ServiceConfig.from_env({}, data_root=tmp_path).block_bytes is None  # the preset's
    with pytest.raises(ConfigError) as bad:
        ServiceConfig.from_env({"KVSTORE_BLOCK_BYTES": "big"}, data_root=tmp_path)
    assert bad.value.field == "KVSTORE_BLOCK_BYTES"
    with pytest.raises(ConfigError) as bad:
        ServiceConfig.from_env({}, data_root=tmp_path, block_bytes=0)
    assert bad.value.field == "block_bytes"


def test_each_deployments_swa_actors_carry_its_name(tmp_path: Path) -> None:
    """Two deployments on one Ray cluster (tests, benchmarks, tenants of a fleet) must not
    answer to each other's SWA actor names: the prefix follows the deployment unless set."""
    names = {
        deployment: ServiceConfig.from_env({}, data_root=tmp_path, deployment=deployment).swa.name
        for deployment in ("kvstore", "bench-a", "bench-b")
    }
    assert names == {"kvstore": "kvstore-swa", "bench-a": "bench-a-swa", "bench-b": "bench-b-swa"}
    chosen = ServiceConfig.from_env({"KVSTORE_SWA_NAME": "mine"}, data_root=tmp_path)
    assert chosen.swa.name == "mine"
    numbered = ServiceConfig.from_env({}, data_root=tmp_path, deployment="2nd-fleet")
    assert numbered.swa.name == "2nd-fleet-swa"
    with pytest.raises(ConfigError, match="name"):
        SWAConfig(name="two words")
