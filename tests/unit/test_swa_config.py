"""SWA tier configuration: defaults, validation, environment."""

from __future__ import annotations

import pytest

from kvstore.errors import ConfigError
from kvstore.swa.config import SWAConfig


def test_defaults_follow_the_spec() -> None:
    config = SWAConfig()
    assert config.capacity_bytes is None and config.capacity_fraction == 0.10
    assert config.resolved_capacity_bytes(host_bytes=1000) == 100
    assert SWAConfig(capacity_bytes=5).resolved_capacity_bytes(host_bytes=1000) == 5
    assert 60 <= config.ttl_s <= 3600  # minutes
    assert config.resolved_capacity_bytes() > 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("capacity_bytes", 0),
        ("capacity_bytes", True),
        ("capacity_fraction", 0),
        ("capacity_fraction", 1.5),
        ("ttl_s", -1),
        ("ttl_s", float("nan")),
        ("num_entrypoints", 0),
        ("call_timeout_s", 0),
        ("name", "has space"),
        ("name", ""),
    ],
)
def test_bad_values_name_their_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as caught:
        SWAConfig(**{field: value})  # type: ignore[arg-type]
    assert caught.value.field == field


def test_owner_timeout_must_cover_two_heartbeats() -> None:
    with pytest.raises(ConfigError, match="owner_timeout_s"):
        SWAConfig(heartbeat_interval_s=1.0, owner_timeout_s=1.5)
    assert SWAConfig(heartbeat_interval_s=0.5, owner_timeout_s=1.0).owner_timeout_s == 1.0


def test_from_env_reads_only_prefixed_variables() -> None:
    env = {
        "KVSTORE_SWA_TTL_S": "120",
        "KVSTORE_SWA_CAPACITY_BYTES": "auto",
        "KVSTORE_SWA_NUM_ENTRYPOINTS": "4",
        "KVSTORE_SWA_NAME": "swa2",
        "TTL_S": "1",
    }
    config = SWAConfig.from_env(env)
    assert (config.ttl_s, config.capacity_bytes, config.num_entrypoints, config.name) == (
        120.0,
        None,
        4,
        "swa2",
    )
    assert SWAConfig.from_env({}) == SWAConfig()
    with pytest.raises(ConfigError, match="ttl_s"):
        SWAConfig.from_env({"KVSTORE_SWA_TTL_S": "soon"})
    with pytest.raises(ConfigError, match="num_entrypoints"):
        SWAConfig.from_env({"KVSTORE_SWA_NUM_ENTRYPOINTS": "x"})
