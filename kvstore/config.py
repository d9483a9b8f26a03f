"""The service's config root. The one loader of environment variables every config uses is
``kvstore.envconfig.from_env`` (a leaf: the part configs import it, this module composes them).

``ServiceConfig`` is what ``kvstore up`` deploys: it embeds each part's own config (block tier,
SWA tier, GC policy, model geometry) instead of re-declaring their fields, and derives the few
values two parts share from one source — the traffic classes and the lease length from the GC
policy (``gc/gc.toml``), which is where an operator states them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.blockstore.config import BlockStoreConfig
from kvstore.envconfig import env_values, from_env
from kvstore.errors import ConfigError
from kvstore.gc.config import DEFAULT_PATH as GC_DEFAULT_PATH
from kvstore.gc.config import GCConfig
from kvstore.geometry import GeometryConfig
from kvstore.swa.config import SWAConfig, deployment_swa_name


def default_gc_config() -> GCConfig:
    """``gc/gc.toml`` of the source tree when present, else the built-in defaults."""
    if Path(GC_DEFAULT_PATH).is_file():
        return GCConfig.from_file(GC_DEFAULT_PATH)
    return GCConfig.from_dict({})


@dataclass(frozen=True)
class ServiceConfig:
    """A whole deployment: the block tier, the SWA tier, the GC policy, the model.

    ``blockstore.traffic_classes`` and ``blockstore.lease_seconds`` are taken from ``gc`` (the
    operator's policy file): a class without a TTL cannot exist, and the lease a reader gets is
    the one the GC honours."""

    blockstore: BlockStoreConfig = field(
        default_factory=lambda: BlockStoreConfig(deployment="kvstore")
    )
    geometry: GeometryConfig = field(default_factory=GeometryConfig.default)
    swa: SWAConfig = field(default_factory=SWAConfig)
    gc: GCConfig = field(default_factory=default_gc_config)
    run_gc: bool = True
    start_repair: bool = True
    #: Exact size of one block payload the tier accepts. None: the preset's
    #: (``GeometryConfig.block_bytes``). Set it for an engine whose blocks are laid out by the
    #: engine, not by a kvstore preset: a vLLM model through ``kvstore.engine.vllm``
    #: (layers × 2 × KV heads × head size × 128 tokens × dtype bytes; the connector prints it).
    block_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.block_bytes is not None and (
            isinstance(self.block_bytes, bool)
            or not isinstance(self.block_bytes, int)
            or self.block_bytes < 1
        ):
            raise ConfigError(
                "block_bytes", f"must be a positive integer, got {self.block_bytes!r}"
            )
        shared: dict[str, Any] = {
            "traffic_classes": self.gc.class_names,
            "lease_seconds": self.gc.lease_default_s,
        }
        if not self.blockstore.repair_class_order:  # repair order: the policy's TTLs, longest first
            ttl = self.gc.ttl_seconds
            shared["repair_class_order"] = tuple(sorted(ttl, key=lambda name: -ttl[name]))
        if any(getattr(self.blockstore, k) != v for k, v in shared.items()):
            object.__setattr__(self, "blockstore", self.blockstore.with_overrides(**shared))

    @property
    def data_root(self) -> Path:
        return Path(self.blockstore.data_root)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **changes: Any) -> ServiceConfig:
        """The environment first (``KVSTORE_BLOCKSTORE_*``, ``KVSTORE_SWA_*``, the geometry's
        ``KVSTORE_*``, ``KVSTORE_GC_FILE``: a gc.toml, ``KVSTORE_BLOCK_BYTES``), then
        ``changes`` (None = not given):
        a block tier field by its name (``data_root``, ``deployment``, ``storage_nodes``,
        ``meta_shards``, ...), ``fsync`` / ``node_capacity_bytes`` for the storage nodes,
        ``preset`` for the model, or one of this class's own fields."""
        env = os.environ if environ is None else environ
        changes = {k: v for k, v in changes.items() if v is not None}
        own = {f.name for f in dataclasses.fields(cls)}
        mine = {k: v for k, v in changes.items() if k in own}
        block: dict[str, Any] = {"deployment": "kvstore"}
        block.update(env_values(BlockStoreConfig, "KVSTORE_BLOCKSTORE_", env))
        node = block.pop("node", BlockStoreConfig().node)
        node_changes: dict[str, Any] = {}
        preset = changes.pop("preset", None)
        for key, value in changes.items():
            if key in own:
                continue
            if key in ("fsync", "node_capacity_bytes"):
                node_changes[key.removeprefix("node_")] = value
            elif key in BlockStoreConfig.__dataclass_fields__:
                block[key] = str(value) if key == "data_root" else value
            else:
                raise ConfigError(key, "not a field of ServiceConfig or of the block tier")
        block["node"] = dataclasses.replace(node, **node_changes)
        if "geometry" not in mine:
            geometry = GeometryConfig.from_env(env)
            mine["geometry"] = geometry if preset is None else geometry.replace(preset=preset)
        if "swa" not in mine:
            swa = from_env(SWAConfig, "KVSTORE_SWA_", env)
            if not env.get("KVSTORE_SWA_NAME"):
                swa = dataclasses.replace(swa, name=deployment_swa_name(block["deployment"]))
            mine["swa"] = swa
        if "gc" not in mine and env.get("KVSTORE_GC_FILE"):
            mine["gc"] = GCConfig.from_file(env["KVSTORE_GC_FILE"])
        from_environment = env_values(BlockStoreConfig, "KVSTORE_BLOCKSTORE_", env)
        try:
            blockstore = BlockStoreConfig(**block)
        except ConfigError as error:
            if error.field in from_environment and error.field not in changes:
                variable = "KVSTORE_BLOCKSTORE_" + error.field.upper()
                raise ConfigError(variable, f"{error.detail} (field {error.field})") from None
            raise
        if "block_bytes" not in mine and env.get("KVSTORE_BLOCK_BYTES"):
            try:
                mine["block_bytes"] = int(env["KVSTORE_BLOCK_BYTES"])
            except ValueError:
                raise ConfigError(
                    "KVSTORE_BLOCK_BYTES", f"must be an integer, got {env['KVSTORE_BLOCK_BYTES']!r}"
                ) from None
        return cls(blockstore=blockstore, **mine)
