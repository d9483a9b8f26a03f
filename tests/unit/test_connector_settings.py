"""What a vLLM user writes into ``kv_connector_extra_config`` is validated with errors naming
the key, and the key fingerprint changes with every fact that shapes a block's bytes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvstore.engine.settings import ConnectorSettings, EngineLayout, engine_fingerprint
from kvstore.errors import ConfigError


def settings(**extra: object) -> ConnectorSettings:
    return ConnectorSettings.from_extra_config({"address": "127.0.0.1:50051", **extra})


def test_only_the_address_is_needed_and_the_hit_mode_is_the_models() -> None:
    s = settings()
    # No hit mode: the connector takes the one the model's KV-cache groups need.
    assert s.hit_mode is None and s.load and s.save and s.token() is None


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        ({"adress": "x:1"}, "adress", "not a key"),
        ({"address": ""}, "address", "host:port"),
        ({"address": "localhost"}, "address", "host:port"),
        ({"address": "h:99999"}, "address", "host:port"),
        ({"hit_mode": "dense"}, "hit_mode", "full-attention"),
        ({"staging_bytes": 1000}, "staging_bytes", "1 MiB"),
        ({"lookup_timeout_s": 0}, "lookup_timeout_s", "> 0"),
        ({"save": "yes"}, "save", "true or false"),
        ({"loads_in_place": 1}, "loads_in_place", "true or false"),
        ({"token_file": "/nonexistent/token"}, "token_file", "not a file"),
        ({"tls_client_cert": __file__}, "tls_client_cert", "together"),
        ({"staging_dir": "/nonexistent"}, "staging_dir", "not a directory"),
    ],
)
def test_bad_settings_name_the_key(extra: dict, field: str, words: str) -> None:
    base = {} if "address" in extra else {"address": "127.0.0.1:50051"}
    with pytest.raises(ConfigError) as error:
        ConnectorSettings.from_extra_config({**base, **extra})
    assert error.value.field == field and words in str(error.value)


def test_the_token_file_must_be_private(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("secret-token\n")
    token.chmod(0o644)
    with pytest.raises(ConfigError, match="group or others"):
        settings(token_file=str(token)).token()
    token.chmod(0o600)
    assert settings(token_file=str(token)).token() == "secret-token"


LAYOUT = EngineLayout(
    model="/models/tiny",
    revision=None,
    dtype="torch.float32",
    block_tokens=128,
    layers=(("model.layers.0.self_attn.attn", 2, 32), ("model.layers.1.self_attn.attn", 2, 32)),
    backend="cpu:page=65536",
)


@pytest.mark.parametrize(
    "change",
    [
        {"model": "/models/other"},
        {"revision": "v2"},
        {"dtype": "torch.bfloat16"},
        {"layers": LAYOUT.layers[:1]},
        {"layers": (("model.layers.0.self_attn.attn", 4, 32),) * 2},
        {"backend": "cuda:page=65536"},
        {"tp_rank": 1, "tp_size": 2},
        {"extra": {"cache_dtype": "fp8"}},
    ],
)
def test_every_byte_shaping_fact_changes_the_fingerprint(change: dict) -> None:
    assert engine_fingerprint(LAYOUT) == engine_fingerprint(dataclasses.replace(LAYOUT))
    assert engine_fingerprint(dataclasses.replace(LAYOUT, **change)) != engine_fingerprint(LAYOUT)
    assert len(engine_fingerprint(LAYOUT)) == 32
