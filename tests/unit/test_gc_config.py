"""GCConfig: the shipped gc/gc.toml, defaults, and one named error per bad value."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import ConfigError
from kvstore.gc.config import DAY, DEFAULT_PATH, GCConfig, parse_duration

REPO = Path(__file__).resolve().parents[2]


def test_shipped_policy_file_loads_with_the_spec_numbers() -> None:
    assert DEFAULT_PATH == REPO / "gc" / "gc.toml"
    config = GCConfig.from_file(REPO / "gc" / "gc.toml")
    assert config.ttl_seconds == {"default": 1 * DAY, "agent": 3 * DAY, "chatbot": 7 * DAY}
    assert config.ttl_basis == "last_access"
    assert (config.high_watermark, config.low_watermark) == (0.90, 0.80)
    assert config.scan_interval_s == 60.0
    assert config.delete_batch == 1000
    assert config.lease_default_s == 30.0
    assert config == GCConfig()  # the file and the defaults say the same thing
    assert pickle.loads(pickle.dumps(config)) == config  # crosses actor boundaries


def test_ttl_by_class_ids_falls_back_to_the_default_class() -> None:
    config = GCConfig()
    ttl = config.ttl_seconds_by_class(("default", "agent", "chatbot", "batch"))
    assert ttl.dtype == np.float64
    assert ttl.tolist() == [1 * DAY, 3 * DAY, 7 * DAY, 1 * DAY]


def test_bytes_to_free_uses_both_watermarks() -> None:
    config = GCConfig(high_watermark=0.9, low_watermark=0.8)
    assert config.bytes_to_free(900, 1000) == 0  # at the high mark: nothing
    assert config.bytes_to_free(901, 1000) == 101  # above: down to the low mark
    assert config.bytes_to_free(1200, 1000) == 400
    assert config.bytes_to_free(5, 0) == 0


@pytest.mark.parametrize(
    ("text", "value"),
    [("90s", 90.0), ("30m", 1800.0), ("12h", 43200.0), ("3d", 3 * DAY), ("1.5d", 1.5 * DAY)],
)
def test_durations(text: str, value: float) -> None:
    assert parse_duration(text, "k") == value
    assert parse_duration(7, "k") == 7.0


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "gc.toml"
    path.write_text(body)
    return path


BASE = """
[gc]
ttl_basis = "last_access"
scan_interval_s = 60
delete_batch = 1000
lease_default_s = 30
[gc.ttl]
default = "1d"
agent = "3d"
chatbot = "7d"
[gc.watermarks]
high = 0.9
low = 0.8
"""


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        ("high = 0.9", "high = 1.5", "gc.watermarks.high"),
        ("high = 0.9", "high = 0", "gc.watermarks.high"),
        ("low = 0.8", "low = 0.95", "gc.watermarks.low"),
        ("low = 0.8", 'low = "lots"', "gc.watermarks.low"),
        ("low = 0.8", "low = 0.8\nmedium = 0.85", "gc.watermarks.medium"),
        ('agent = "3d"', 'agent = "3 days"', "gc.ttl.agent"),
        ('agent = "3d"', "agent = -1", "gc.ttl.agent"),
        ('agent = "3d"', "agent = true", "gc.ttl.agent"),
        ('ttl_basis = "last_access"', 'ttl_basis = "mtime"', "gc.ttl_basis"),
        ("scan_interval_s = 60", "scan_interval_s = 0", "gc.scan_interval_s"),
        ("delete_batch = 1000", "delete_batch = 0", "gc.delete_batch"),
        ("delete_batch = 1000", "delete_batch = 2.5", "gc.delete_batch"),
        ("lease_default_s = 30", 'lease_default_s = "forever"', "gc.lease_default_s"),
        ("lease_default_s = 30", "lease_default_s = 30\nbatch = 3", "gc.batch"),
        ('default = "1d"', 'fallback = "1d"', "gc.default_class"),
    ],
)
def test_bad_value_is_a_startup_error_naming_the_key(
    tmp_path: Path, old: str, new: str, key: str
) -> None:
    assert old in BASE
    path = write(tmp_path, BASE.replace(old, new))
    with pytest.raises(ConfigError) as caught:
        GCConfig.from_file(path)
    assert caught.value.field == key
    assert str(caught.value).startswith(key + ":")


def test_base_document_is_valid(tmp_path: Path) -> None:
    assert GCConfig.from_file(write(tmp_path, BASE)) == GCConfig()


def test_unreadable_files_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        GCConfig.from_file(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        GCConfig.from_file(write(tmp_path, "[gc\nhigh ="))
    with pytest.raises(ConfigError) as caught:
        GCConfig.from_dict({"garbage": {}})
    assert caught.value.field == "garbage"


def test_config_is_frozen() -> None:
    config = GCConfig()
    with pytest.raises(AttributeError):
        config.high_watermark = 0.5  # type: ignore[misc]
    source = {"default": 10, "agent": 20}
    made = GCConfig(ttl=source)
    source["agent"] = 99
    assert made.ttl_seconds["agent"] == 20.0
    made.ttl_seconds["agent"] = 1.0  # a copy: the config does not change
    assert made.ttl_for("agent") == 20.0
