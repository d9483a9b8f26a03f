"""The one frozen configuration of the Block KVCache tier (validated on construction).

Sizes and timings are plain fields; nothing here is read at import time. ``from_env`` is the
only place that reads environment variables (``KVSTORE_BLOCKSTORE_<FIELD>``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from kvstore import envconfig  # the one environment loader
from kvstore.errors import ConfigError

# The built-in policy, for a tier built alone (tests, tools); a deployment's comes from its GC
# policy, handed over by ``kvstore.config.ServiceConfig``.
from kvstore.traffic import DEFAULT_CLASSES, DEFAULT_LEASE_S, DEFAULT_REPAIR_ORDER

FsyncPolicy = Literal["always", "batch", "never"]
_FSYNC_POLICIES = ("always", "batch", "never")
_ENV_PREFIX = "KVSTORE_BLOCKSTORE_"
_MIB = 1024 * 1024


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(name, f"must be a positive integer, got {value!r}")


def _non_negative_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(name, f"must be an integer >= 0, got {value!r}")


def _number_in(name: str, value: object, low: float, high: float, unit: str = "") -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(name, f"must be in [{low:g}, {high:g}]{unit}, got {value!r}")


@dataclass(frozen=True)
class StorageNodeConfig:
    """What one storage node needs to know about itself."""

    #: When a put/commit is acknowledged, its records are on stable storage:
    #: ``always`` and ``batch``: one ``fdatasync`` of the segment file per put/commit batch (the
    #: log appends a batch in one write, so one flush covers it; ``always`` also syncs the
    #: directory when a segment is created or removed);
    #: ``never``: the page cache decides (a process crash loses nothing, a power cut may).
    fsync: FsyncPolicy = "batch"
    #: A segment file is sealed (footer written, a new one opened) once it holds this many bytes.
    segment_bytes: int = 64 * _MIB
    #: Compaction rewrites a sealed segment whose live share of bytes fell below this.
    compact_live_fraction: float = 0.5
    #: Bytes compaction may copy per second (bounds its disk I/O against foreground work).
    compact_bytes_per_s: int = 64 * _MIB
    #: Bytes of disk blocks this node may hold; a put beyond it is refused (the GC evicts
    #: first). None: what its filesystem has free beyond the reserve below, shared with the other
    #: nodes on that filesystem (``kvstore.blockstore.capacity``). Set: the operator's figure.
    capacity_bytes: int | None = None
    #: With the capacity from the disk, left free on the filesystem for everything else: this
    #: share of its size or ``disk_reserve_bytes``, whichever is larger.
    disk_reserve_fraction: float = 0.10
    disk_reserve_bytes: int = 1024 * _MIB
    #: The newest bytes of its log this node keeps in the page cache. Appending past them, it
    #: drops the oldest from the cache, so its writes reuse memory it freed instead of taking
    #: memory the machine never touched (on a VM whose host takes back unused guest memory,
    #: filling such a page costs ~5x a reused one), and its share of the machine's memory stays
    #: bounded. Blocks read soon after they were written come from memory; older ones from the
    #: disk (``docs/block-tier.md``, "The page cache"). None: no bound, the kernel decides.
    cached_log_bytes: int | None = 256 * _MIB

    def __post_init__(self) -> None:
        if self.fsync not in _FSYNC_POLICIES:
            raise ConfigError("fsync", f"must be one of {_FSYNC_POLICIES}, got {self.fsync!r}")
        _positive_int("segment_bytes", self.segment_bytes)
        live = self.compact_live_fraction
        if not isinstance(live, int | float) or isinstance(live, bool) or not 0 <= live < 1:
            raise ConfigError("compact_live_fraction", f"must be in [0, 1), got {live!r}")
        _positive_int("compact_bytes_per_s", self.compact_bytes_per_s)
        if self.capacity_bytes is not None:
            _non_negative_int("capacity_bytes", self.capacity_bytes)
            if self.capacity_bytes == 0:
                raise ConfigError("capacity_bytes", "must be > 0 (or None: from the disk)")
        fraction = self.disk_reserve_fraction
        if (
            not isinstance(fraction, int | float)
            or isinstance(fraction, bool)
            or not 0 <= fraction < 1
        ):
            raise ConfigError("disk_reserve_fraction", f"must be in [0, 1), got {fraction!r}")
        _non_negative_int("disk_reserve_bytes", self.disk_reserve_bytes)
        if self.cached_log_bytes is not None:
            _non_negative_int("cached_log_bytes", self.cached_log_bytes)


@dataclass(frozen=True)
class BlockStoreConfig:
    """The whole tier: geometry, actor counts, timings."""

    data_shards: int = 10
    parity_shards: int = 2
    #: Storage nodes (failure domains). On one machine: N actors with their own data dirs.
    storage_nodes: int = 12
    meta_shards: int = 4
    #: Traffic class names; a block's class id is the position of its name here. A deployment
    #: takes them from its GC policy (``kvstore.config.ServiceConfig``).
    traffic_classes: tuple[str, ...] = DEFAULT_CLASSES
    #: How long a lookup's lease protects its blocks (from the GC policy in a deployment).
    lease_seconds: float = DEFAULT_LEASE_S
    #: Longest any single remote call may take before its node counts as unreachable.
    call_timeout_s: float = 10.0
    #: A read asks the fastest k nodes; shards still missing after the ``hedge_percentile``
    #: of the client's recent reads of that size are asked of the remaining m nodes too
    #: (hedging). Until a client has timed enough reads of a size it waits this long.
    hedge_after_s: float = 0.05
    hedge_percentile: float = 95.0
    #: A lease given back without waiting (``release_many(wait=False)``, the blocks a lookup
    #: leased beyond its prefix) waits up to this long to ride on the next lookup to its meta
    #: shard, so under load releases cost no calls of their own (an engine releases a lease
    #: after every load: its next lookup usually comes within this). 0 sends each at once.
    release_batch_s: float = 0.25
    #: A client that saw a node fail skips it for this long before trying it again; twice as
    #: long after each further failure in a row, up to 8 times (a success resets it).
    node_retry_s: float = 5.0
    #: How long a writer's reservation of a key lasts (a put longer than this loses it).
    put_reservation_s: float = 60.0
    #: Pending shards and unreferenced committed shards younger than this are never reclaimed.
    orphan_grace_s: float = 600.0
    #: A node whose health checks fail for this long is declared dead and repaired.
    dead_after_s: float = 10.0
    health_interval_s: float = 1.0
    #: A put needs this many live failure domains: with fewer than ``stripe_width`` (but at
    #: least this many) it writes one shard per live domain, commits the stripe as
    #: *under-redundant* (the missing shards recorded lost) and the repair restores it first.
    #: Below it the put fails. 0 (the default) means k + 1, at most k + m (Ceph's advice for
    #: k=10, m=2: a stripe written with 11 shards still survives one more loss);
    #: ``write_quorum`` is the number in force.
    min_write_shards: int = 0
    #: Repair's cap, in shard bytes restored per second (it reads k times as much to decode).
    repair_bytes_per_s: int = 128 << 20
    #: Stripes one repair round reads, decodes and writes at once (its concurrency cap; a round
    #: also stays under ``repair_round_bytes`` of shards read).
    repair_stripes_per_round: int = 256
    repair_round_bytes: int = 64 << 20
    #: Traffic classes in repair order among stripes that lost as many shards (first = first
    #: repaired). Empty: by TTL, longest first (a deployment sets it from its GC policy): a
    #: block kept longer is expected to serve more hits before it goes.
    repair_class_order: tuple[str, ...] = ()
    #: Background scrub: shard bytes every live node verifies per second (0 = never). A
    #: corrupt shard is dropped from its node's index and repaired.
    scrub_bytes_per_s: int = 4 << 20
    #: Misses remembered with their reason per meta shard (evicted / expired), newest kept.
    tombstones: int = 100_000
    node: StorageNodeConfig = StorageNodeConfig()
    #: Storage node ``i`` keeps its files in ``<data_root>/node-<i>`` (a local path on whichever
    #: machine hosts it).
    data_root: str = "/var/lib/kvstore/blocks"
    #: Name prefix of the Ray actors of one deployment (several may share a cluster).
    deployment: str = "blockstore"
    #: The failure domain (host) of each storage node, by node id; a stripe puts at most
    #: ceil(width / domains) of its shards in one domain where the live ones allow it
    #: (``placement.FailureDomains``). Empty:
    #: every node is a domain of its own. A deployment sets it from where its nodes run
    #: (``kvstore.runtime.deploy``: several nodes on a host when hosts are fewer than nodes).
    failure_domains: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("data_shards", "parity_shards", "storage_nodes", "meta_shards"):
            _positive_int(name, getattr(self, name))
        if self.storage_nodes < self.stripe_width:
            raise ConfigError(
                "storage_nodes",
                f"must be >= data_shards + parity_shards = {self.stripe_width} "
                f"(one failure domain per shard), got {self.storage_nodes}",
            )
        if not self.traffic_classes or len(set(self.traffic_classes)) != len(self.traffic_classes):
            raise ConfigError("traffic_classes", "must be a non-empty tuple of distinct names")
        if len(self.traffic_classes) > 254:
            raise ConfigError("traffic_classes", "at most 254 classes")
        for name in (
            "lease_seconds",
            "call_timeout_s",
            "hedge_after_s",
            "node_retry_s",
            "put_reservation_s",
            "dead_after_s",
            "health_interval_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ConfigError(name, f"must be a positive number of seconds, got {value!r}")
        _number_in("hedge_percentile", self.hedge_percentile, 50, 100)
        _number_in("release_batch_s", self.release_batch_s, 0, 1, " seconds")
        if not isinstance(self.orphan_grace_s, int | float) or self.orphan_grace_s < 0:
            raise ConfigError("orphan_grace_s", f"must be >= 0, got {self.orphan_grace_s!r}")
        if (
            isinstance(self.min_write_shards, bool)
            or not isinstance(self.min_write_shards, int)
            or not (
                self.min_write_shards == 0
                or self.data_shards <= self.min_write_shards <= self.stripe_width
            )
        ):
            raise ConfigError(
                "min_write_shards",
                f"must be 0 (k + 1) or an integer in [data_shards, data_shards + parity_shards]"
                f" = [{self.data_shards}, {self.stripe_width}], got {self.min_write_shards!r}",
            )
        for name in ("repair_bytes_per_s", "repair_stripes_per_round", "repair_round_bytes"):
            _positive_int(name, getattr(self, name))
        _non_negative_int("scrub_bytes_per_s", self.scrub_bytes_per_s)
        unknown = [name for name in self.repair_class_order if name not in self.traffic_classes]
        if unknown or len(set(self.repair_class_order)) != len(self.repair_class_order):
            raise ConfigError(
                "repair_class_order",
                f"must list distinct traffic classes (known: {list(self.traffic_classes)}), "
                f"got {list(self.repair_class_order)}",
            )
        _non_negative_int("tombstones", self.tombstones)
        if not isinstance(self.node, StorageNodeConfig):
            raise ConfigError("node", "must be a StorageNodeConfig")
        if not self.data_root:
            raise ConfigError("data_root", "must name a directory")
        if not self.deployment or not self.deployment.replace("-", "").isalnum():
            raise ConfigError("deployment", f"must be alphanumeric/dashes, got {self.deployment!r}")
        self._check_domains()

    def _check_domains(self) -> None:
        domains = self.failure_domains
        if not domains:
            return
        if len(domains) != self.storage_nodes or not all(isinstance(d, str) for d in domains):
            raise ConfigError(
                "failure_domains",
                f"must name the domain of each of the {self.storage_nodes} storage nodes, "
                f"got {len(domains)} entries",
            )

    @property
    def stripe_width(self) -> int:
        return self.data_shards + self.parity_shards

    @property
    def write_quorum(self) -> int:
        """Fewest shards a put commits (``min_write_shards``, 0 meaning k + 1)."""
        return self.min_write_shards or min(self.data_shards + 1, self.stripe_width)

    def class_id(self, name: str) -> int:
        try:
            return self.traffic_classes.index(name)
        except ValueError:
            raise ConfigError(
                "traffic_class", f"unknown class {name!r} (known: {list(self.traffic_classes)})"
            ) from None

    def class_name(self, class_id: int) -> str:
        if 0 <= class_id < len(self.traffic_classes):
            return self.traffic_classes[class_id]
        return f"class-{class_id}"

    def repair_rank(self) -> list[int]:
        """Repair priority of each class id (0 = repaired first among stripes that lost as
        many shards): ``repair_class_order``, or ``DEFAULT_REPAIR_ORDER`` (the built-in TTLs
        longest first), then the remaining classes in id order."""
        order = list(self.repair_class_order)
        if not order:
            order = [name for name in DEFAULT_REPAIR_ORDER if name in self.traffic_classes]
        order += [name for name in self.traffic_classes if name not in order]
        return [order.index(name) for name in self.traffic_classes]

    def with_overrides(self, **changes: Any) -> BlockStoreConfig:
        return replace(self, **changes)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> BlockStoreConfig:
        """Build from a plain mapping (e.g. a TOML table); ``node`` may be a nested mapping."""
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ConfigError(sorted(unknown)[0], f"unknown field (known: {sorted(known)})")
        data = dict(values)
        if isinstance(data.get("node"), Mapping):
            node_known = {f.name for f in fields(StorageNodeConfig)}
            bad = set(data["node"]) - node_known
            if bad:
                raise ConfigError(f"node.{sorted(bad)[0]}", "unknown field")
            data["node"] = StorageNodeConfig(**data["node"])
        for name in ("traffic_classes", "repair_class_order", "failure_domains"):
            if name in data:
                data[name] = tuple(data[name])
        return cls(**data)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> BlockStoreConfig:
        """``KVSTORE_BLOCKSTORE_<FIELD>`` (upper case) overrides; ``..._NODE_<FIELD>`` for the
        storage node part; ``..._TRAFFIC_CLASSES`` is comma-separated."""
        return envconfig.from_env(cls, _ENV_PREFIX, environ)
