"""The GC policy (``gc/gc.toml``) as one frozen, validated dataclass.

Every value is checked in ``__post_init__``; a bad one raises ``ConfigError`` naming its key in
the file (``gc.watermarks.high``, ``gc.ttl.agent``, ...), so a typo stops start-up instead of
silently keeping blocks forever or evicting the whole tier.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from kvstore.errors import ConfigError
from kvstore.traffic import DAY as DAY  # re-exported: durations in days
from kvstore.traffic import DEFAULT_LEASE_S, DEFAULT_TTL

TTLBasis = Literal["last_access", "created"]
_BASES = ("last_access", "created")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd])\s*$")

#: Where the policy file lives in a checkout (``gc/gc.toml`` at the top level).
DEFAULT_PATH = Path(__file__).resolve().parents[2] / "gc" / "gc.toml"
#: The built-in policy (the same as ``gc/gc.toml``) lives in ``kvstore.traffic``: TTL per
#: traffic class in class-id order, and the lease a reader gets.


def parse_duration(value: object, key: str) -> float:
    """Seconds from a number (seconds) or a string with a unit: ``"90s"``, ``"30m"``,
    ``"12h"``, ``"3d"``."""
    if isinstance(value, bool):
        raise ConfigError(key, f"must be a duration, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        match = _DURATION.match(value)
        if not match:
            raise ConfigError(
                key, f"must be seconds or a number with a unit s/m/h/d (e.g. '3d'), got {value!r}"
            )
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    else:
        raise ConfigError(key, f"must be a duration, got {type(value).__name__}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(key, f"must be a positive finite duration, got {value!r}")
    return seconds


@dataclass(frozen=True)
class GCConfig:
    """What the GC workers do and how often."""

    #: TTL per traffic class name, as (name, seconds) pairs (a mapping is accepted and
    #: normalised; durations like "3d" are accepted too). ``ttl_seconds`` gives it as a dict.
    ttl: tuple[tuple[str, float], ...] | Mapping[str, Any] = DEFAULT_TTL
    #: The class whose TTL applies to blocks of a class ``ttl_seconds`` does not name.
    default_class: str = "default"
    #: Age is measured from the last access (idle time) or from creation. See gc/gc.toml.
    ttl_basis: TTLBasis = "last_access"
    #: Evict when used bytes exceed ``high_watermark`` x capacity ...
    high_watermark: float = 0.90
    #: ... until they are at or below ``low_watermark`` x capacity.
    low_watermark: float = 0.80
    scan_interval_s: float = 60.0
    #: Blocks removed per index call and per batched shard delete.
    delete_batch: int = 1000
    lease_default_s: float = DEFAULT_LEASE_S

    def __post_init__(self) -> None:
        pairs = list(self.ttl.items()) if isinstance(self.ttl, Mapping) else list(self.ttl)
        if not pairs:
            raise ConfigError("gc.ttl", "must name at least one traffic class")
        checked: dict[str, float] = {}
        for pair in pairs:
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise ConfigError("gc.ttl", f"entries are (class, duration) pairs, got {pair!r}")
            name, seconds = pair
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ConfigError("gc.ttl", f"class names are [A-Za-z0-9_.-]+, got {name!r}")
            if name in checked:
                raise ConfigError(f"gc.ttl.{name}", "given twice")
            checked[name] = parse_duration(seconds, f"gc.ttl.{name}")
        # A tuple, not the caller's dict: frozen all the way down, hashable, picklable.
        object.__setattr__(self, "ttl", tuple(checked.items()))
        if self.default_class not in checked:
            raise ConfigError(
                "gc.default_class",
                f"{self.default_class!r} has no TTL in gc.ttl (classes: {sorted(checked)})",
            )
        if self.ttl_basis not in _BASES:
            raise ConfigError("gc.ttl_basis", f"must be one of {_BASES}, got {self.ttl_basis!r}")
        for key, value in (
            ("gc.watermarks.high", self.high_watermark),
            ("gc.watermarks.low", self.low_watermark),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(key, f"must be a number in (0, 1], got {value!r}")
            if not 0 < value <= 1:
                raise ConfigError(key, f"must be in (0, 1], got {value}")
        if not self.low_watermark < self.high_watermark:
            raise ConfigError(
                "gc.watermarks.low",
                f"must be below gc.watermarks.high ({self.low_watermark} >= {self.high_watermark})",
            )
        object.__setattr__(
            self, "scan_interval_s", parse_duration(self.scan_interval_s, "gc.scan_interval_s")
        )
        object.__setattr__(
            self, "lease_default_s", parse_duration(self.lease_default_s, "gc.lease_default_s")
        )
        if (
            isinstance(self.delete_batch, bool)
            or not isinstance(self.delete_batch, int)
            or self.delete_batch < 1
        ):
            raise ConfigError("gc.delete_batch", f"must be an int >= 1, got {self.delete_batch!r}")

    # --- loading ---------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, document: Mapping[str, Any]) -> GCConfig:
        """From a parsed gc.toml (the whole document, with its ``[gc]`` table)."""
        unknown_top = sorted(set(document) - {"gc"})
        if unknown_top:
            raise ConfigError(unknown_top[0], "unknown table (the GC policy lives under [gc])")
        table = document.get("gc", {})
        if not isinstance(table, Mapping):
            raise ConfigError("gc", "must be a table")
        known = {
            "ttl",
            "watermarks",
            "ttl_basis",
            "scan_interval_s",
            "delete_batch",
            "lease_default_s",
            "default_class",
        }
        for key in table:
            if key not in known:
                raise ConfigError(f"gc.{key}", f"unknown key (known: {', '.join(sorted(known))})")
        kwargs: dict[str, Any] = {}
        if "ttl" in table:
            if not isinstance(table["ttl"], Mapping):
                raise ConfigError("gc.ttl", "must be a table of class = duration")
            kwargs["ttl"] = dict(table["ttl"])
        if "watermarks" in table:
            marks = table["watermarks"]
            if not isinstance(marks, Mapping):
                raise ConfigError("gc.watermarks", "must be a table with high and low")
            for key in marks:
                if key not in ("high", "low"):
                    raise ConfigError(f"gc.watermarks.{key}", "unknown key (known: high, low)")
            if "high" in marks:
                kwargs["high_watermark"] = marks["high"]
            if "low" in marks:
                kwargs["low_watermark"] = marks["low"]
        for key in ("ttl_basis", "scan_interval_s", "delete_batch", "lease_default_s"):
            if key in table:
                kwargs[key] = table[key]
        if "default_class" in table:
            kwargs["default_class"] = table["default_class"]
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: str | Path = DEFAULT_PATH) -> GCConfig:
        path = Path(path)
        try:
            with path.open("rb") as handle:
                document = tomllib.load(handle)
        except FileNotFoundError:
            raise ConfigError(str(path), "GC policy file not found") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(str(path), f"not valid TOML: {error}") from None
        return cls.from_dict(document)

    # --- use -------------------------------------------------------------------------------

    @property
    def ttl_seconds(self) -> dict[str, float]:
        """TTL seconds per class name (a copy)."""
        return dict(self._pairs())

    @property
    def class_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self._pairs())

    def _pairs(self) -> tuple[tuple[str, float], ...]:
        # __post_init__ normalised the field to pairs; the Mapping in its type is input only.
        return cast("tuple[tuple[str, float], ...]", self.ttl)

    def ttl_for(self, class_name: str) -> float:
        """TTL seconds of a class (the default class's TTL for a class this policy omits)."""
        ttl = self.ttl_seconds
        return ttl.get(class_name, ttl[self.default_class])

    def ttl_seconds_by_class(self, class_names: Sequence[str]) -> np.ndarray:
        """float64 TTL per class id, where class id = position in ``class_names`` (the block
        tier's configured names): the array ``BlockIndex.expired_rows`` takes."""
        return np.array([self.ttl_for(name) for name in class_names], dtype=np.float64)

    def bytes_to_free(self, used_bytes: int, capacity_bytes: int) -> int:
        """Bytes to evict now: 0 at or below the high watermark, else down to the low one."""
        if capacity_bytes <= 0 or used_bytes <= self.high_watermark * capacity_bytes:
            return 0
        return max(0, int(math.ceil(used_bytes - self.low_watermark * capacity_bytes)))
