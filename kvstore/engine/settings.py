"""What an engine's connector is told (``kv_connector_extra_config``) and what names its blocks.

No engine is imported here: ``ConnectorSettings.from_extra_config`` validates the plain dict a
user writes into ``--kv-transfer-config '{"kv_connector_extra_config": {...}}'``, and
``EngineLayout`` + ``engine_fingerprint`` turn what the engine says about its KV cache into the
fingerprint every block key is chained from (``kvstore.keys.block_keys``), so two engines whose
blocks differ in any byte-shaping way (model, dtype, block size, heads, layout/backend, tensor
parallel rank) never read each other's blocks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError
from kvstore.hitplan import MODES

#: Where the settings come from, for error messages.
SOURCE = "kv_connector_extra_config"


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's knobs. Only ``address`` is required."""

    #: The tier's gRPC gateway, ``host:port`` (what ``kvstore up`` prints).
    address: str = ""
    #: File holding this engine's bearer token (mode 0600): its tenant.
    token_file: str | None = None
    #: PEM root certificate of the gateway (TLS); with ``tls_client_cert``/``tls_client_key``
    #: mutual TLS (the certificate's common name names the tenant).
    tls_root_cert: str | None = None
    tls_client_cert: str | None = None
    tls_client_key: str | None = None
    #: GC traffic class of what this engine saves (``agent``, ``chatbot``, ...; "" = default).
    traffic_class: str = ""
    #: Hit rule asked of the tier; leave it out: the connector takes the one the model's
    #: KV-cache groups need (``full-attention`` for a dense model, ``exact-window`` for one
    #: with sliding-window layers), and refuses any other.
    hit_mode: str | None = None
    #: Bytes of the /dev/shm staging area loads land in before they are copied into the KV cache.
    staging_bytes: int = 256 * 1024 * 1024
    #: Where this user's private staging directory (``kvstore-<uid>``) is made; None:
    #: ``/dev/shm``, or the temp directory where there is none.
    staging_dir: str | None = None
    #: Seconds a QueryHit may take before the request is planned as a miss.
    lookup_timeout_s: float = 2.0
    #: After the tier failed to answer, every lookup is a miss for this long without asking.
    retry_after_s: float = 5.0
    #: Seconds per GetBlocks / PutBlocks call.
    call_timeout_s: float = 30.0
    #: Seconds the forward waits for one layer of a load before its blocks are recomputed.
    layer_timeout_s: float = 30.0
    #: Saved bytes waiting for the tier at once; a save beyond it is dropped (a future miss),
    #: never a stall of the forward.
    max_pending_save_bytes: int = 256 * 1024 * 1024
    load: bool = True
    save: bool = True
    #: Accept a tier hit only when loading it is faster than computing it, by this engine's
    #: measured rates (``kvstore.engine.worth``); false: always load.
    load_only_if_faster: bool = True
    #: On a CPU engine, move the KV cache into shared memory so loads land in its rows
    #: straight from the storage nodes (``kvstore.engine.sharedkv``); false: loads land in
    #: staging and are copied into the rows (costs a copy of every loaded byte).
    loads_in_place: bool = True
    #: Names the model in the key fingerprint instead of the path or hub id vLLM was given
    #: (set it when one model is reached under two names, or two weights under one name).
    model_id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or not self.address.strip():
            raise ConfigError("address", f"{SOURCE} needs the tier's gRPC address (host:port)")
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError("address", f"must be host:port, got {self.address!r}")
        for name in ("token_file", "tls_root_cert", "tls_client_cert", "tls_client_key"):
            value = getattr(self, name)
            if value is not None and not Path(value).is_file():
                raise ConfigError(name, f"{value} is not a file")
        if (self.tls_client_cert is None) != (self.tls_client_key is None):
            raise ConfigError("tls_client_cert", "give tls_client_cert and tls_client_key together")
        if self.tls_client_cert is not None and self.tls_root_cert is None:
            raise ConfigError("tls_client_cert", "mutual TLS needs tls_root_cert too")
        if not isinstance(self.traffic_class, str):
            raise ConfigError("traffic_class", f"must be a string, got {self.traffic_class!r}")
        if self.hit_mode is not None and self.hit_mode not in MODES:
            raise ConfigError(
                "hit_mode", f"must be one of {', '.join(MODES)}, got {self.hit_mode!r}"
            )
        for name in ("staging_bytes", "max_pending_save_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 << 20:
                raise ConfigError(name, f"must be an integer of at least 1 MiB, got {value!r}")
        for name in ("lookup_timeout_s", "retry_after_s", "call_timeout_s", "layer_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(name, f"must be a number of seconds > 0, got {value!r}")
        for name in ("load", "save", "load_only_if_faster", "loads_in_place"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.staging_dir is not None and not Path(self.staging_dir).is_dir():
            raise ConfigError("staging_dir", f"{self.staging_dir} is not a directory")

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """Validate the dict; an unknown key is an error naming it (a typo must not be a
        silent default)."""
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ConfigError(SOURCE, f"must be a JSON object, got {type(extra).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConfigError(
                unknown[0], f"is not a key of {SOURCE}; known keys: {', '.join(known)}"
            )
        return cls(**extra)

    def token(self) -> str | None:
        if self.token_file is None:
            return None
        from kvstore.api.server import read_token_file  # checks the file's mode

        return read_token_file(Path(self.token_file))


@dataclass(frozen=True)
class EngineLayout:
    """What shapes the bytes of one block in an engine's KV cache."""

    model: str
    revision: str | None
    dtype: str
    block_tokens: int
    #: Per attention layer, in layer order: (name, KV heads, head size).
    layers: tuple[tuple[str, int, int], ...]
    #: Attention backend / platform and the per-block tensor layout, e.g. ``cpu:[2,128,64]``.
    backend: str
    tp_rank: int = 0
    tp_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def engine_fingerprint(layout: EngineLayout) -> bytes:
    """32 bytes naming every byte-shaping fact of ``layout`` (the block keys' fingerprint)."""
    text = json.dumps({"kvstore-engine-layout": 1, **layout.describe()}, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=32).digest()
