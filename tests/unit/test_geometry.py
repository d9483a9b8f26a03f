"""Model presets and every size derived from GeometryConfig (docs/rules.md §2, §3), with the
article's figures: 134, 396, 1,415,040, compression rings 14/134, V4-Flash 43 / V4-Pro 61 layers."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from kvstore.errors import ConfigError, InvalidArgument
from kvstore.geometry import (
    LAYER_KINDS,
    PRESET_NAMES,
    PRESETS,
    GeometryConfig,
    ModelPreset,
)
from kvstore.keys import block_keys

PE_COMPACT = {
    "preset": "v4.1-flash",
    "role": "prefill",
    "truncation": "compact",
    "yoco_keep": 134,
    "extra_state": True,
}


def pe_compact(**changes: object) -> GeometryConfig:
    return GeometryConfig.from_dict({**PE_COMPACT, **changes})


# --- presets ----------------------------------------------------------------------------------


def test_preset_names_are_the_three_models() -> None:
    assert set(PRESET_NAMES) == {"v4-flash", "v4-pro", "v4.1-flash"}
    assert set(PRESETS) == set(PRESET_NAMES)


def test_v4_flash_43_layers_first_two_swa_then_csa_hca_alternate() -> None:
    kinds = PRESETS["v4-flash"].layer_kinds
    assert len(kinds) == 43
    assert kinds[:2] == ("swa", "swa")
    assert all(kinds[i] != kinds[i + 1] for i in range(2, 42))
    assert set(kinds[2:]) == {"csa", "hca"}
    assert PRESETS["v4-flash"].kind_counts() == {"swa": 2, "csa": 21, "hca": 20}


def test_v4_pro_61_layers_first_two_hca_then_alternate() -> None:
    kinds = PRESETS["v4-pro"].layer_kinds
    assert len(kinds) == 61
    assert kinds[:2] == ("hca", "hca")
    assert "swa" not in kinds
    assert all(kinds[i] != kinds[i + 1] for i in range(2, 60))
    assert kinds[2] == "csa"


def test_v41_flash_stores_first_20_swa_layers_and_drops_the_consumers() -> None:
    geometry = GeometryConfig(preset="v4.1-flash")
    assert geometry.stored_swa_layers == tuple(range(20))
    assert geometry.consumer_swa_layers == tuple(range(20, geometry.num_layers))
    assert geometry.swa_bytes_per_token == 528
    assert geometry.model.index_dim > 0 and geometry.model.compressed_state_dim > 0


def test_every_preset_places_each_swa_layer_in_exactly_one_region() -> None:
    for preset in PRESETS.values():
        stored, consumers = set(preset.stored_swa_layers), set(preset.consumer_swa_layers)
        assert not stored & consumers
        assert stored | consumers == set(range(preset.num_layers))


def test_v41_flash_block_is_about_890_bytes_per_token() -> None:
    geometry = GeometryConfig.default()
    assert geometry.block_bytes == 114_048
    assert abs(geometry.block_bytes_per_token - 890) / 890 < 0.01
    assert round(geometry.block_bytes / 1024) == 111
    # A 10+2 data shard is about 11 KiB.
    assert round(geometry.block_bytes / 10 / 1024) == 11


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_block_bytes_are_32_csa_entries_plus_indexer_keys_and_1_hca_entry(name: str) -> None:
    geometry = GeometryConfig(preset=name)
    model = geometry.model
    consumers = set(model.consumer_swa_layers)
    csa = sum(1 for i, k in enumerate(model.layer_kinds) if k == "csa" and i not in consumers)
    hca = sum(1 for i, k in enumerate(model.layer_kinds) if k == "hca" and i not in consumers)
    expected = csa * 32 * (model.csa_entry_bytes + model.indexer_key_bytes)
    expected += hca * 1 * model.hca_entry_bytes
    assert geometry.block_bytes == expected
    for layer, kind in enumerate(model.layer_kinds):
        if kind == "swa" or layer in consumers:
            assert geometry.block_bytes_of_layer(layer) == 0


def test_v4_flash_block_bytes_with_our_entry_sizes() -> None:
    # 21 CSA x 32 x (528 + 132) + 20 HCA x 528
    assert GeometryConfig(preset="v4-flash").block_bytes == 21 * 32 * 660 + 20 * 528


def test_model_preset_rejects_inconsistent_rows() -> None:
    base = dataclasses.asdict(PRESETS["v4.1-flash"])
    with pytest.raises(ConfigError) as overlap:
        ModelPreset(**{**base, "consumer_swa_layers": tuple(range(19, 40))})
    assert overlap.value.field == "consumer_swa_layers"
    with pytest.raises(ConfigError) as uncovered:
        ModelPreset(**{**base, "consumer_swa_layers": tuple(range(21, 40))})
    assert uncovered.value.field == "stored_swa_layers"
    with pytest.raises(ConfigError) as kind:
        ModelPreset(**{**base, "layer_kinds": ("mla",) * 40})
    assert kind.value.field == "layer_kinds"
    with pytest.raises(ConfigError) as size:
        ModelPreset(**{**base, "swa_bytes_per_token": 0})
    assert size.value.field == "swa_bytes_per_token"


# --- rings ------------------------------------------------------------------------------------


def test_inference_ring_is_window_plus_backtracking_134() -> None:
    geometry = GeometryConfig.default()
    assert (geometry.window, geometry.max_backtracking, geometry.block_tokens) == (128, 6, 128)
    assert geometry.inference_ring == 134


def test_store_ring_pe_extra_state_with_yoco_is_396() -> None:
    assert pe_compact().store_ring == 134 + 128 + 134 == 396
    assert pe_compact(truncation="mask").store_ring == 396
    assert pe_compact(yoco_keep=200).store_ring == 134 + 128 + 200


def test_store_ring_without_extra_state_is_134() -> None:
    assert pe_compact(extra_state=False).store_ring == 134
    assert GeometryConfig(role="decode", truncation="compact", yoco_keep=134).store_ring == 134


def test_yoco_term_is_zero_when_truncation_off() -> None:
    geometry = pe_compact(truncation="off")
    assert geometry.yoco_store_extra == 0
    assert geometry.store_ring == 134 + 128
    # A keep given while truncation is off is allowed and ignored.
    assert pe_compact(truncation="off", yoco_keep=500).store_ring == 262


def test_state_size_to_disk_is_1415040_whatever_the_engine() -> None:
    assert GeometryConfig.default().state_size_to_disk == 20 * 134 * 528 == 1_415_040
    assert pe_compact().state_size_to_disk == 1_415_040
    assert GeometryConfig(preset="v4-flash").state_size_to_disk == 43 * 134 * 528


def test_compression_rings_csa_14_hca_134() -> None:
    geometry = GeometryConfig.default()
    assert geometry.compression_ring("csa") == 2 * 4 + 6 == 14
    assert geometry.compression_ring("hca") == 128 + 6 == 134
    assert geometry.compression_rings == {"csa": 14, "hca": 134}
    with pytest.raises(InvalidArgument):
        geometry.compression_ring("swa")


def test_a_change_of_backtracking_changes_every_ring() -> None:
    before = pe_compact()
    after = pe_compact(max_backtracking=8, yoco_keep=136)
    assert after.inference_ring == 136
    assert after.store_ring == 136 + 128 + 136
    assert after.compression_rings == {"csa": 16, "hca": 136}
    assert after.state_size_to_disk == 20 * 136 * 528
    # The old config is untouched: sizes are pure functions of the frozen value.
    assert before.inference_ring == 134 and before.compression_rings == {"csa": 14, "hca": 134}
    # The YoCo minimum follows the backtracking too.
    with pytest.raises(ConfigError, match="136"):
        pe_compact(max_backtracking=8, yoco_keep=134)


def test_state_table_shapes() -> None:
    geometry = pe_compact(num_state_seqs=32)
    index_dim = geometry.model.index_dim
    dim = geometry.model.compressed_state_dim
    assert geometry.index_state_shape() == (32, 14, 2, index_dim)
    assert geometry.compressed_state_shape("csa") == (32, 14, 2, dim)
    assert geometry.compressed_state_shape("hca") == (32, 134, 2, dim)
    assert geometry.swa_cache_shape() == (32, 396, 1, 528)
    assert geometry.for_decode().swa_cache_shape() == (32, 134, 1, 528)
    tables = geometry.state_table_shapes()
    assert tables["swa_cache"] == {"shape": [32, 396, 1, 528], "dtype": "uint8", "layers": 40}
    assert tables["csa_index_state"]["dtype"] == "float32"
    assert tables["csa_index_state"]["layers"] == 19


def test_state_block_bytes_formula() -> None:
    geometry = GeometryConfig.default()
    dim, index_dim = geometry.model.compressed_state_dim, geometry.model.index_dim
    csa = 14 * 2 * (index_dim + dim) * 4
    hca = 134 * 2 * dim * 4
    assert geometry.state_block_bytes == 40 * 134 * 528 + 19 * csa + 19 * hca


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["mask", "compact"])
def test_truncation_without_yoco_keep_is_a_config_error_naming_the_minimum(mode: str) -> None:
    with pytest.raises(ConfigError) as error:
        GeometryConfig(truncation=mode)
    assert error.value.field == "yoco_keep"
    assert "134" in str(error.value)
    assert str(error.value).startswith("yoco_keep: ")


def test_yoco_keep_below_window_plus_backtracking_is_rejected() -> None:
    with pytest.raises(ConfigError) as error:
        GeometryConfig(truncation="mask", yoco_keep=133)
    assert error.value.field == "yoco_keep"
    assert "133" in str(error.value) and "134" in str(error.value)
    assert GeometryConfig(truncation="mask", yoco_keep=134).yoco_keep == 134


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("preset", "v5-ultra"),
        ("role", "router"),
        ("truncation", "aggressive"),
        ("window", 0),
        ("window", -128),
        ("max_backtracking", -1),
        ("decode_snapshot_overrun", -1),
        ("prefill_store_extra", 0),
        ("num_state_seqs", 0),
        ("block_tokens", 0),
        ("block_tokens", 256),
        ("yoco_keep", -1),
        ("window", True),
        ("num_state_seqs", "64"),
        ("extra_state", "yes"),
    ],
)
def test_bad_values_name_their_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as error:
        GeometryConfig(**{field: value})  # type: ignore[arg-type]
    assert error.value.field == field
    assert str(error.value).startswith(f"{field}: ")


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="v4.1-flash"):
        GeometryConfig(preset="nope")


def test_backtracking_slots_must_absorb_the_decode_snapshot_overrun() -> None:
    with pytest.raises(ConfigError) as error:
        GeometryConfig(max_backtracking=4)
    assert error.value.field == "max_backtracking" and "5" in str(error.value)
    assert GeometryConfig(max_backtracking=5).inference_ring == 133
    assert GeometryConfig(max_backtracking=2, decode_snapshot_overrun=2).inference_ring == 130


def test_extra_state_on_a_decode_engine_is_rejected() -> None:
    with pytest.raises(ConfigError) as error:
        GeometryConfig(role="decode", extra_state=True)
    assert error.value.field == "extra_state"


def test_role_aliases() -> None:
    assert GeometryConfig(role="PE").role == "prefill"
    assert GeometryConfig(role="ce").role == "decode"


# --- immutability, loaders --------------------------------------------------------------------


def test_config_is_frozen_and_hashable() -> None:
    geometry = GeometryConfig.default()
    with pytest.raises(dataclasses.FrozenInstanceError):
        geometry.max_backtracking = 8  # type: ignore[misc]
    assert geometry.max_backtracking == 6
    assert hash(geometry) == hash(GeometryConfig.default())
    assert geometry == GeometryConfig.default()


def test_replace_validates() -> None:
    geometry = GeometryConfig.default()
    with pytest.raises(ConfigError):
        geometry.replace(truncation="mask")
    assert geometry.replace(truncation="mask", yoco_keep=140).yoco_keep == 140


def test_default_is_v41_flash_decode_truncation_off() -> None:
    geometry = GeometryConfig.default()
    assert (geometry.preset, geometry.role, geometry.truncation) == ("v4.1-flash", "decode", "off")
    assert geometry.extra_state is False and geometry.yoco_keep is None


def test_from_dict_round_trips_through_json() -> None:
    geometry = pe_compact(num_state_seqs=16)
    data = json.loads(json.dumps(geometry.to_dict()))
    assert GeometryConfig.from_dict(data) == geometry


def test_from_dict_rejects_unknown_keys_and_non_mappings() -> None:
    with pytest.raises(ConfigError) as error:
        GeometryConfig.from_dict({"preset": "v4-pro", "ring": 7})
    assert error.value.field == "ring"
    with pytest.raises(ConfigError):
        GeometryConfig.from_dict(["preset"])  # type: ignore[arg-type]


def test_from_env_parses_every_field() -> None:
    env = {
        "KVSTORE_PRESET": "V4-Pro",
        "KVSTORE_ROLE": "pe",
        "KVSTORE_TRUNCATION": "compact",
        "KVSTORE_YOCO_KEEP": "150",
        "KVSTORE_EXTRA_STATE": "true",
        "KVSTORE_WINDOW": "128",
        "KVSTORE_MAX_BACKTRACKING": "6",
        "KVSTORE_PREFILL_STORE_EXTRA": "128",
        "KVSTORE_BLOCK_TOKENS": "128",
        "KVSTORE_NUM_STATE_SEQS": "8",
        "KVSTORE_DECODE_SNAPSHOT_OVERRUN": "5",
        "UNRELATED": "x",
    }
    geometry = GeometryConfig.from_env(env)
    assert geometry == GeometryConfig(
        preset="v4-pro",
        role="prefill",
        truncation="compact",
        yoco_keep=150,
        extra_state=True,
        num_state_seqs=8,
    )
    assert geometry.store_ring == 134 + 128 + 150


def test_from_env_defaults_prefix_and_errors() -> None:
    assert GeometryConfig.from_env({}) == GeometryConfig.default()
    assert GeometryConfig.from_env({"KVSTORE_ROLE": ""}) == GeometryConfig.default()
    custom = GeometryConfig.from_env({"ENGINE_PRESET": "v4-flash"}, prefix="ENGINE_")
    assert custom.preset == "v4-flash"
    with pytest.raises(ConfigError) as bad_int:
        GeometryConfig.from_env({"KVSTORE_YOCO_KEEP": "lots"})
    assert bad_int.value.field == "KVSTORE_YOCO_KEEP"
    with pytest.raises(ConfigError) as bad_bool:
        GeometryConfig.from_env({"KVSTORE_EXTRA_STATE": "maybe"})
    assert bad_bool.value.field == "KVSTORE_EXTRA_STATE"
    with pytest.raises(ConfigError) as missing_keep:
        GeometryConfig.from_env({"KVSTORE_TRUNCATION": "mask"})
    assert missing_keep.value.field == "yoco_keep"


def test_from_env_reads_the_process_environment_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVSTORE_PRESET", "v4-flash")
    monkeypatch.setenv("KVSTORE_MAX_BACKTRACKING", "8")
    geometry = GeometryConfig.from_env()
    assert geometry.preset == "v4-flash" and geometry.inference_ring == 136
    # Read at call time, never cached at import: a changed environment gives a new answer.
    monkeypatch.setenv("KVSTORE_MAX_BACKTRACKING", "6")
    assert GeometryConfig.from_env().inference_ring == 134


# --- identity ---------------------------------------------------------------------------------


def test_fingerprint_names_the_model_not_the_engine() -> None:
    decode = GeometryConfig.default()
    assert isinstance(decode.fingerprint(), bytes)
    assert b"v4.1-flash" in decode.fingerprint()
    # PE and CE of one model must share block keys.
    assert pe_compact().fingerprint() == decode.fingerprint()
    assert decode.replace(num_state_seqs=3).fingerprint() == decode.fingerprint()
    # Anything that shapes stored bytes changes it.
    others = {GeometryConfig(preset=name).fingerprint() for name in PRESET_NAMES}
    assert len(others) == len(PRESET_NAMES)
    assert decode.replace(max_backtracking=7).fingerprint() != decode.fingerprint()


def test_fingerprint_separates_block_keys_of_two_models() -> None:
    tokens = list(range(256))
    flash = block_keys(GeometryConfig(preset="v4-flash").fingerprint(), tokens)
    v41 = block_keys(GeometryConfig(preset="v4.1-flash").fingerprint(), tokens)
    assert len(flash) == len(v41) == 2
    assert set(flash).isdisjoint(v41)


def test_fingerprint_is_stable_across_processes() -> None:
    code = (
        "import sys; from kvstore.geometry import GeometryConfig; "
        "sys.stdout.write(GeometryConfig(preset='v4-pro').fingerprint().hex())"
    )
    outputs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
        )
        outputs.add(result.stdout)
    assert outputs == {GeometryConfig(preset="v4-pro").fingerprint().hex()}


def test_summary_is_json_and_carries_the_derived_numbers() -> None:
    summary = json.loads(json.dumps(pe_compact().summary()))
    assert summary["inference_ring"] == 134
    assert summary["store_ring"] == 396
    assert summary["state_size_to_disk"] == 1_415_040
    assert summary["block_bytes"] == 114_048
    assert summary["stored_swa_layers"] == list(range(20))
    assert summary["compression_rings"] == {"csa": 14, "hca": 134}


def test_layer_kind_table_has_the_compression_ratios() -> None:
    assert LAYER_KINDS["csa"].compress_ratio == 4 and LAYER_KINDS["csa"].has_indexer
    assert LAYER_KINDS["hca"].compress_ratio == 128 and not LAYER_KINDS["hca"].has_indexer
    assert LAYER_KINDS["swa"].compress_ratio == 0
