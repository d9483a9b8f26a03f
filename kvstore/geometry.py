"""Model presets as data, and every size derived from one frozen geometry config
(docs/rules.md §2, §3).

Two things live here:

- ``PRESETS``: one ``ModelPreset`` row per model, pure data (layer kinds, byte sizes, which SWA
  layers are stored and which are YoCo consumers). Adding a model adds a row, never a code path.
- ``GeometryConfig``: a frozen, validated dataclass of preset + engine role + YoCo truncation
  settings + the ring knobs. Every size the engine or the store needs (inference ring 134, store
  ring 396, ``state_size_to_disk`` 1,415,040, compression rings, block bytes, state-table shapes)
  is a pure property of it. Nothing is cached: the article's trap (change the backtracking, forget
  to clear a size cache, write out of bounds) cannot happen when sizes are recomputed from the one
  frozen value each time.

Environment variables are read in exactly one place, ``GeometryConfig.from_env``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore import envconfig  # the one environment loader
from kvstore.errors import ConfigError, InvalidArgument
from kvstore.keys import BLOCK_TOKENS

# --- layer kinds --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerKind:
    """What one kind of attention layer caches besides its SWA window.

    Every layer (whatever its kind) also has a ``window``-token sliding-window KV ring.
    """

    name: str
    #: Tokens folded into one compressed entry; 0 for a pure sliding-window layer.
    compress_ratio: int
    #: CSA compression windows overlap (each entry mixes two consecutive windows), so its state
    #: ring must hold two windows; HCA windows do not overlap.
    overlapping_windows: bool
    #: CSA is sparse: an indexer scores compressed entries, so the layer also caches one indexer
    #: key per compressed entry and keeps an index-attn accumulator.
    has_indexer: bool


LAYER_KINDS: Mapping[str, LayerKind] = {
    "swa": LayerKind("swa", compress_ratio=0, overlapping_windows=False, has_indexer=False),
    "csa": LayerKind("csa", compress_ratio=4, overlapping_windows=True, has_indexer=True),
    "hca": LayerKind("hca", compress_ratio=128, overlapping_windows=False, has_indexer=False),
}
COMPRESSED_KINDS = tuple(name for name, kind in LAYER_KINDS.items() if kind.compress_ratio)


# --- model presets (data) -----------------------------------------------------------------------


@dataclass(frozen=True)
class ModelPreset:
    """One model's shapes. Pure data; ``GeometryConfig`` derives every size from it."""

    name: str
    description: str
    #: Attention kind of every layer, layer 0 first (values are keys of ``LAYER_KINDS``).
    layer_kinds: tuple[str, ...]
    #: Bytes of one compressed CSA entry / HCA entry / CSA indexer key, as stored in a block.
    csa_entry_bytes: int
    hca_entry_bytes: int
    indexer_key_bytes: int
    #: Sliding-window KV bytes per token per layer (MXFP8, held in uint8 tensors).
    swa_bytes_per_token: int
    #: Width of the indexer head (index-attn state) and of the compressed-attn state (fp32).
    index_dim: int
    compressed_state_dim: int
    #: Layers whose SWA window is persisted (the stored region of the state block).
    stored_swa_layers: tuple[int, ...]
    #: YoCo consumer layers: their SWA is rebuilt by prefill recompute, so it sits in the dropped
    #: region, and they cache no block KV of their own (their compressed KV is projected from the
    #: encoder's last hidden state, docs/rules.md §9). Fixed by the model, never by the truncation
    #: mode.
    consumer_swa_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        where = f"preset {self.name!r}"
        if not self.layer_kinds:
            raise ConfigError("layer_kinds", f"{where} has no layers")
        unknown = sorted(set(self.layer_kinds) - set(LAYER_KINDS))
        if unknown:
            raise ConfigError("layer_kinds", f"{where}: unknown layer kinds {unknown}")
        for name in (
            "csa_entry_bytes",
            "hca_entry_bytes",
            "indexer_key_bytes",
            "swa_bytes_per_token",
            "index_dim",
            "compressed_state_dim",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"{where}: must be > 0, got {getattr(self, name)}")
        stored, consumers = set(self.stored_swa_layers), set(self.consumer_swa_layers)
        if stored & consumers:
            raise ConfigError(
                "consumer_swa_layers",
                f"{where}: layers {sorted(stored & consumers)} are both stored and consumers",
            )
        # Every layer has a SWA ring, and it must live in exactly one region of the state block.
        if stored | consumers != set(range(len(self.layer_kinds))):
            raise ConfigError(
                "stored_swa_layers",
                f"{where}: stored + consumer SWA layers must cover layers "
                f"0..{len(self.layer_kinds) - 1} exactly once",
            )
        for name in ("stored_swa_layers", "consumer_swa_layers"):
            layers = getattr(self, name)
            if list(layers) != sorted(set(layers)):
                raise ConfigError(name, f"{where}: must be strictly increasing")

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def kind_counts(self, layers: tuple[int, ...] | None = None) -> dict[str, int]:
        """How many of ``layers`` (default: all) are of each kind."""
        chosen = range(self.num_layers) if layers is None else layers
        counts = {name: 0 for name in LAYER_KINDS}
        for layer in chosen:
            counts[self.layer_kinds[layer]] += 1
        return counts

    @property
    def block_kv_layers(self) -> tuple[int, ...]:
        """Layers that cache their own compressed entries in the block store."""
        consumers = set(self.consumer_swa_layers)
        return tuple(
            layer
            for layer, kind in enumerate(self.layer_kinds)
            if LAYER_KINDS[kind].compress_ratio and layer not in consumers
        )


def _pattern(head: tuple[str, ...], repeat: tuple[str, ...], num_layers: int) -> tuple[str, ...]:
    """``head`` then ``repeat`` cycled to ``num_layers`` layers: how the papers describe stacks."""
    tail = num_layers - len(head)
    return head + tuple(repeat[i % len(repeat)] for i in range(tail))


# Byte sizes shared by the V4 presets. The article gives only the SWA size; the rest is ours:
# - 528 B = 512 MXFP8 values + 16 one-byte E8M0 scales (one per 32 values): the article's SWA
#   figure, which implies a 512-wide KV latent. We store V4 compressed CSA/HCA entries in the same
#   format (a compressed entry is the same latent, pooled), so 528 B each.
# - Indexer key 132 B = 128 FP8 values + one fp32 scale, DeepSeek-V3.2's lightning-indexer format,
#   with index_dim 128.
# - Compressed-state dim = the latent width (512): the fp32 accumulators pool unquantised latents.
_MXFP8_512 = 528
_INDEXER_KEY = 132
_INDEX_DIM = 128

PRESETS: Mapping[str, ModelPreset] = {
    preset.name: preset
    for preset in (
        ModelPreset(
            name="v4-flash",
            description="DeepSeek-V4-Flash: 43 layers, first 2 pure SWA, then CSA/HCA alternate",
            # Article: "first 2 pure SWA, then CSA and HCA alternate"; we start the alternation
            # with CSA (21 CSA, 20 HCA).
            layer_kinds=_pattern(("swa", "swa"), ("csa", "hca"), 43),
            csa_entry_bytes=_MXFP8_512,
            hca_entry_bytes=_MXFP8_512,
            indexer_key_bytes=_INDEXER_KEY,
            swa_bytes_per_token=528,
            index_dim=_INDEX_DIM,
            compressed_state_dim=512,
            # No YoCo in V4: every layer's window is state worth keeping.
            stored_swa_layers=tuple(range(43)),
        ),
        ModelPreset(
            name="v4-pro",
            description="DeepSeek-V4-Pro: 61 layers, first 2 pure HCA, then CSA/HCA alternate",
            # Article: "first 2 pure HCA, then CSA and HCA alternate"; alternation starts with CSA
            # (30 CSA, 31 HCA).
            layer_kinds=_pattern(("hca", "hca"), ("csa", "hca"), 61),
            csa_entry_bytes=_MXFP8_512,
            hca_entry_bytes=_MXFP8_512,
            indexer_key_bytes=_INDEXER_KEY,
            swa_bytes_per_token=528,
            index_dim=_INDEX_DIM,
            compressed_state_dim=512,
            stored_swa_layers=tuple(range(61)),
        ),
        ModelPreset(
            name="v4.1-flash",
            description="DeepSeek-V4.1-Flash (YoCo/CED): 20 encoder + 20 YoCo-consumer layers",
            # The article gives: SWA stored for the first 20 layers ("V41 store 的层是前 20 层"),
            # and 20 decoder layers rebuilt by decoder-side replay ("20 个 decoder 层"). Our
            # choice: 40 layers = 20 encoder + 20 decoder, each half laid out like V4-Flash
            # (2 pure SWA, then CSA/HCA alternate), i.e. 2 SWA + 19 CSA + 19 HCA in all. (The
            # article contrasts the 20 stored layers with V4-Flash's 43; it never gives V4.1's
            # total, and 20 + 20 is the count both of its "20"s agree with.)
            layer_kinds=_pattern(("swa", "swa"), ("csa", "hca"), 40),
            # Our choice, fixed by the article's "global KV ~890 B/token": only the 9 CSA + 9 HCA
            # encoder layers cache block KV (consumers project theirs), so per 128-token block
            # 9·32·(256 + 132) + 9·256 = 114,048 B = 891 B/token ≈ 111.4 KiB. 256 B = a
            # 256-wide latent in FP8 with a per-layer scale (V4.1 halves V4's latent).
            csa_entry_bytes=256,
            hca_entry_bytes=256,
            indexer_key_bytes=_INDEXER_KEY,
            swa_bytes_per_token=528,  # article: 528 B/token/layer, MXFP8 stored as uint8
            index_dim=_INDEX_DIM,
            compressed_state_dim=256,
            stored_swa_layers=tuple(range(20)),
            consumer_swa_layers=tuple(range(20, 40)),
        ),
    )
}
PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)

# --- the config -----------------------------------------------------------------------------------

ROLES = ("prefill", "decode")
_ROLE_ALIASES = {"prefill": "prefill", "pe": "prefill", "decode": "decode", "ce": "decode"}
TRUNCATION_MODES = ("off", "mask", "compact")
#: Data shards of the block store's 10+2 erasure code (only for the printed shard size).
EC_DATA_SHARDS = 10


#: Fields whose values are names, read from the environment case-folded.
_NAME_FIELDS = ("preset", "role", "truncation")


@dataclass(frozen=True)
class GeometryConfig:
    """Model preset + engine role + YoCo truncation + ring knobs; all sizes derive from it."""

    preset: str = "v4.1-flash"
    #: ``prefill`` (PE, may keep the extra store ring) or ``decode`` (CE); ``pe``/``ce`` accepted.
    role: str = "decode"
    #: YoCo prefill truncation: ``off``, ``mask`` or ``compact``.
    truncation: str = "off"
    #: YOCO_PREFILL_KEEP tokens; required (>= window + backtracking) unless truncation is ``off``.
    yoco_keep: int | None = None
    #: Prefill extra-state: the PE keeps a longer SWA ring so it can re-order an aligned window.
    extra_state: bool = False
    window: int = 128
    max_backtracking: int = 6
    prefill_store_extra: int = 128
    block_tokens: int = BLOCK_TOKENS
    #: State slots (sequences holding state at once): first dimension of every state table.
    num_state_seqs: int = 64
    #: How far past a 128 boundary the decode snapshot copy may land (docs/rules.md §6: <= 5
    #: tokens). The ring's backtracking slots must absorb it too, so max_backtracking >= this.
    decode_snapshot_overrun: int = 5

    def __post_init__(self) -> None:
        if not isinstance(self.preset, str) or self.preset not in PRESETS:
            raise ConfigError(
                "preset", f"unknown preset {self.preset!r}; known: {', '.join(PRESET_NAMES)}"
            )
        role = _ROLE_ALIASES.get(self.role.lower()) if isinstance(self.role, str) else None
        if role is None:
            raise ConfigError(
                "role", f"unknown role {self.role!r}; expected prefill (pe) or decode (ce)"
            )
        object.__setattr__(self, "role", role)
        if self.truncation not in TRUNCATION_MODES:
            raise ConfigError(
                "truncation",
                f"unknown truncation mode {self.truncation!r}; expected one of "
                f"{', '.join(TRUNCATION_MODES)}",
            )
        if not isinstance(self.extra_state, bool):
            raise ConfigError("extra_state", f"must be a bool, got {self.extra_state!r}")
        for name in ("window", "max_backtracking", "prefill_store_extra", "block_tokens"):
            _check_int(name, getattr(self, name), minimum=0 if name == "max_backtracking" else 1)
        _check_int("num_state_seqs", self.num_state_seqs, minimum=1)
        _check_int("decode_snapshot_overrun", self.decode_snapshot_overrun, minimum=0)
        if self.max_backtracking < self.decode_snapshot_overrun:
            # The spare slots serve two needs at once (article: rollback needs 6, the decode
            # snapshot overruns by <= 5); fewer would let a snapshot overwrite its own window.
            raise ConfigError(
                "max_backtracking",
                f"{self.max_backtracking} spare ring slots cannot absorb the decode snapshot "
                f"overrun of up to {self.decode_snapshot_overrun} tokens; need >= "
                f"{self.decode_snapshot_overrun}",
            )
        if self.block_tokens != BLOCK_TOKENS:
            # Block keys hash exactly BLOCK_TOKENS tokens; a different block size here would
            # size blocks that no key names.
            raise ConfigError(
                "block_tokens",
                f"must be {BLOCK_TOKENS} (kvstore.keys.BLOCK_TOKENS), got {self.block_tokens}",
            )
        lcm = math.lcm(*(LAYER_KINDS[kind].compress_ratio for kind in COMPRESSED_KINDS))
        if self.block_tokens % lcm:
            raise ConfigError("block_tokens", f"must be a multiple of {lcm}")
        minimum_keep = self.window + self.max_backtracking
        if self.yoco_keep is not None:
            _check_int("yoco_keep", self.yoco_keep, minimum=0)
        if self.truncation != "off":
            if self.yoco_keep is None:
                raise ConfigError(
                    "yoco_keep",
                    f"must be given explicitly when truncation is {self.truncation!r}; "
                    f"minimum {minimum_keep} (window {self.window} + backtracking "
                    f"{self.max_backtracking})",
                )
            if self.yoco_keep < minimum_keep:
                raise ConfigError(
                    "yoco_keep",
                    f"{self.yoco_keep} is below the minimum {minimum_keep} (window "
                    f"{self.window} + backtracking {self.max_backtracking}) for truncation "
                    f"{self.truncation!r}",
                )
        if self.extra_state and self.role != "prefill":
            raise ConfigError(
                "extra_state",
                "only a prefill engine (role prefill/PE) keeps the extra store ring; "
                "a decode engine's ring is the inference ring",
            )

    # --- loaders ---------------------------------------------------------------------------------

    @classmethod
    def default(cls) -> GeometryConfig:
        """V4.1-Flash, decode engine, truncation off."""
        return cls()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GeometryConfig:
        """Build from a mapping of field names (e.g. ``to_dict()`` output, a parsed TOML table)."""
        if not isinstance(data, Mapping):
            raise ConfigError("geometry", f"must be a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            known_list = ", ".join(sorted(known))
            raise ConfigError(unknown[0], f"unknown geometry field; known: {known_list}")
        return cls(**dict(data))

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, prefix: str = "KVSTORE_"
    ) -> GeometryConfig:
        """Build from ``{prefix}PRESET``, ``{prefix}ROLE``, ``{prefix}TRUNCATION``,
        ``{prefix}YOCO_KEEP``, ``{prefix}EXTRA_STATE``, ``{prefix}WINDOW``,
        ``{prefix}MAX_BACKTRACKING``, ``{prefix}PREFILL_STORE_EXTRA``, ``{prefix}BLOCK_TOKENS``,
        ``{prefix}NUM_STATE_SEQS``, ``{prefix}DECODE_SNAPSHOT_OVERRUN``; unset ones take the
        defaults. The only env read in kvstore's
        geometry."""
        return envconfig.from_env(cls, prefix, environ, lower=_NAME_FIELDS)

    def to_dict(self) -> dict[str, Any]:
        """The config fields (JSON-ready); ``from_dict(to_dict())`` gives an equal config."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> GeometryConfig:
        """A validated copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    def for_decode(self) -> GeometryConfig:
        """The matching decode-engine (CE) config: same model and knobs, no extra store ring."""
        return self.replace(role="decode", extra_state=False)

    # --- the model -------------------------------------------------------------------------------

    @property
    def model(self) -> ModelPreset:
        """The preset row (a plain table lookup, nothing cached)."""
        return PRESETS[self.preset]

    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return self.model.layer_kinds

    @property
    def stored_swa_layers(self) -> tuple[int, ...]:
        return self.model.stored_swa_layers

    @property
    def consumer_swa_layers(self) -> tuple[int, ...]:
        """YoCo consumer (dropped) SWA layers; from the model only, never from ``truncation``."""
        return self.model.consumer_swa_layers

    @property
    def swa_bytes_per_token(self) -> int:
        return self.model.swa_bytes_per_token

    # --- SWA rings (docs/rules.md §3) -------------------------------------------------------------

    @property
    def inference_ring(self) -> int:
        """Decode-engine SWA ring: window + backtracking (128 + 6 = 134)."""
        return self.window + self.max_backtracking

    @property
    def yoco_store_extra(self) -> int:
        """The YoCo keep term of the store ring: ``yoco_keep``, or 0 when truncation is off."""
        if self.truncation == "off" or self.yoco_keep is None:
            return 0
        return self.yoco_keep

    @property
    def store_ring(self) -> int:
        """Engine SWA ring: 134 + 128 + yoco keep = 396 on a PE with extra-state, else 134."""
        if not self.extra_state:
            return self.inference_ring
        return self.inference_ring + self.prefill_store_extra + self.yoco_store_extra

    @property
    def state_size_to_disk(self) -> int:
        """Persisted bytes per sequence: stored layers × inference ring × SWA bytes/token."""
        return len(self.stored_swa_layers) * self.inference_ring * self.swa_bytes_per_token

    # --- compression (docs/rules.md §3, our choice) -----------------------------------------------

    def compression_ring(self, kind: str) -> int:
        """Compression window(s) plus rollback history: CSA 2·4 + 6 = 14, HCA 128 + 6 = 134."""
        spec = LAYER_KINDS.get(kind)
        if spec is None or not spec.compress_ratio:
            raise InvalidArgument("kind", f"{kind!r} is not a compressed layer kind")
        windows = 2 if spec.overlapping_windows else 1
        return windows * spec.compress_ratio + self.max_backtracking

    @property
    def compression_rings(self) -> dict[str, int]:
        return {kind: self.compression_ring(kind) for kind in COMPRESSED_KINDS}

    def index_state_shape(self) -> tuple[int, int, int, int]:
        """Index-attn state of one CSA layer: ``[S, csa ring, 2, index_dim]`` fp32."""
        return (self.num_state_seqs, self.compression_ring("csa"), 2, self.model.index_dim)

    def compressed_state_shape(self, kind: str) -> tuple[int, int, int, int]:
        """Compressed-attn state of one ``kind`` layer: ``[S, ring, 2, dim]`` fp32."""
        dim = self.model.compressed_state_dim
        return (self.num_state_seqs, self.compression_ring(kind), 2, dim)

    def swa_cache_shape(self) -> tuple[int, int, int, int]:
        """SWA cache of one layer: ``[S, store ring, 1, swa bytes]`` uint8."""
        return (self.num_state_seqs, self.store_ring, 1, self.swa_bytes_per_token)

    def state_table_shapes(self) -> dict[str, dict[str, Any]]:
        """Per-layer state tables: shape, dtype and how many layers have one."""
        counts = self.model.kind_counts()
        tables: dict[str, dict[str, Any]] = {
            "swa_cache": {
                "shape": list(self.swa_cache_shape()),
                "dtype": "uint8",
                "layers": self.num_layers,
            },
            "csa_index_state": {
                "shape": list(self.index_state_shape()),
                "dtype": "float32",
                "layers": counts["csa"],
            },
        }
        for kind in COMPRESSED_KINDS:
            tables[f"{kind}_compressed_state"] = {
                "shape": list(self.compressed_state_shape(kind)),
                "dtype": "float32",
                "layers": counts[kind],
            }
        return tables

    def compression_state_bytes(self, kind: str) -> int:
        """fp32 compression-state bytes of one ``kind`` layer for one sequence."""
        _, ring, two, dim = self.compressed_state_shape(kind)
        total = ring * two * dim * 4
        if LAYER_KINDS[kind].has_indexer:
            _, iring, itwo, idim = self.index_state_shape()
            total += iring * itwo * idim * 4
        return total

    @property
    def state_block_bytes(self) -> int:
        """One sequence's whole state block on this engine, by formula (``layout.finalize`` checks
        the laid-out regions against it)."""
        swa = self.num_layers * self.store_ring * self.swa_bytes_per_token
        counts = self.model.kind_counts()
        compression = sum(counts[k] * self.compression_state_bytes(k) for k in COMPRESSED_KINDS)
        return swa + compression

    # --- block KV (docs/rules.md §2) --------------------------------------------------------------

    def block_bytes_of_layer(self, layer: int) -> int:
        """Block-KV bytes one layer contributes to one block (0 for SWA layers and consumers)."""
        if layer not in self.model.block_kv_layers:
            return 0
        kind = LAYER_KINDS[self.layer_kinds[layer]]
        entries = self.block_tokens // kind.compress_ratio
        if kind.name == "csa":
            return entries * (self.model.csa_entry_bytes + self.model.indexer_key_bytes)
        return entries * self.model.hca_entry_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one 128-token block of block KV (CSA: 32 entries + indexer keys; HCA: 1)."""
        return sum(self.block_bytes_of_layer(layer) for layer in range(self.num_layers))

    @property
    def block_bytes_per_token(self) -> float:
        return self.block_bytes / self.block_tokens

    # --- identity --------------------------------------------------------------------------

    def fingerprint(self) -> bytes:
        """Stable bytes naming the preset and every number that shapes stored bytes.

        Used as the model fingerprint of ``kvstore.keys.block_keys``. Role, truncation and the
        extra store ring are left out on purpose: they change engine-side rings, not the bytes
        that are persisted, so a prefill and a decode engine of one model share keys.
        """
        model = self.model
        shape = {
            "preset": model.name,
            "layer_kinds": "".join(kind[0] for kind in model.layer_kinds),
            "csa_entry_bytes": model.csa_entry_bytes,
            "hca_entry_bytes": model.hca_entry_bytes,
            "indexer_key_bytes": model.indexer_key_bytes,
            "swa_bytes_per_token": model.swa_bytes_per_token,
            "stored_swa_layers": list(model.stored_swa_layers),
            "consumer_swa_layers": list(model.consumer_swa_layers),
            "block_tokens": self.block_tokens,
            "window": self.window,
            "max_backtracking": self.max_backtracking,
        }
        text = json.dumps(shape, sort_keys=True, separators=(",", ":"))
        return b"kvstore.geometry.v1:" + text.encode("ascii")

    def summary(self) -> dict[str, Any]:
        """``to_dict()`` plus every derived number (what ``kvstore geometry --json`` prints)."""
        counts = self.model.kind_counts()
        return {
            **self.to_dict(),
            "num_layers": self.num_layers,
            "layer_kinds": list(self.layer_kinds),
            "layer_kind_counts": counts,
            "stored_swa_layers": list(self.stored_swa_layers),
            "consumer_swa_layers": list(self.consumer_swa_layers),
            "swa_bytes_per_token": self.swa_bytes_per_token,
            "inference_ring": self.inference_ring,
            "store_ring": self.store_ring,
            "yoco_store_extra": self.yoco_store_extra,
            "state_size_to_disk": self.state_size_to_disk,
            "compression_rings": self.compression_rings,
            "block_bytes": self.block_bytes,
            "block_bytes_per_token": self.block_bytes_per_token,
            "block_kv_layers": list(self.model.block_kv_layers),
            "ec_data_shard_bytes": -(-self.block_bytes // EC_DATA_SHARDS),
            "state_tables": self.state_table_shapes(),
            "state_block_bytes": self.state_block_bytes,
            # A short digest to compare two deployments; keys use the full fingerprint bytes.
            "fingerprint_blake2b": hashlib.blake2b(self.fingerprint(), digest_size=16).hexdigest(),
        }


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(name, f"must be >= {minimum}, got {value}")
