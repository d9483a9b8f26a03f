"""`kvstore simulate`: a discrete-event model of the block tier at fleet scale, driven by a
Mooncake request trace.

**Events** (in time order, ties in this order): machine failures (``fail_at`` and Poisson at
``afr``), repair rounds, GC passes (every ``gc_interval_s`` of simulated time, or after every
``gc_every_requests`` requests), and request arrivals at their trace time / ``speed``. A request
does what ``kvstore replay``'s engines do through the gateway: QueryHit (``kvstore.tier.hit.
HitQuery``: the blocks within the cap looked up, the hit from ``plan_hit``), GetBlocks of the hit
(k shards per block from its first k live machines), PutBlocks of every block from the hit on (a
stored one is not rewritten), lease given back. The tier is ``simtier.SimTier``: columns by block
id over counted machines, each decision (hit, placement, GC, repair) made by kvstore's own code.

**Copies.** A 17-minute trace of one cluster is far too little traffic for 1,000 machines, so
``copies`` = R stands for R copies of the trace with disjoint keys (the keys of copy r are those
of another model fingerprint), running in step. Copies share nothing but the machines and the
capacity, and are alike, so each holds 1/R of the tier, makes 1/R of its traffic and of its GC
and repair work, and is placed by rendezvous hashing independently of the others. The model
therefore follows one copy in full (every block, on all the machines, at 1/R of the capacity
and of the repair rate) and obtains the fleet by summing R copies of it whose machines are
relabelled by independent random permutations (copy 0 unpermuted): R rendezvous placements of
disjoint key sets are R independent uniform draws, and so are these. A prefix shared across
copies (one system prompt for the whole fleet) is not modelled: it would concentrate reads on
its stripe's machines more than this shows. Per-machine refusal of a full machine is modelled
for one copy; for R > 1 a machine holds the sum of R independent placements (its fill is the
tier's within ~1/sqrt(R)), so a put is refused when the tier is full.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvstore.blockstore.config import BlockStoreConfig
from kvstore.config import default_gc_config
from kvstore.errors import InvalidArgument
from kvstore.gc.config import GCConfig
from kvstore.geometry import GeometryConfig
from kvstore.hitplan import BOUNDED_REPLAY
from kvstore.keys import BLOCK_TOKENS
from kvstore.tier.hit import HitQuery, NoStates
from kvstore.tier.records import HitRequest
from kvstore.trace.fleetrisk import RepairRate, repair_rate
from kvstore.trace.mooncake import TraceRequest
from kvstore.trace.oracle import check_mode
from kvstore.trace.simtier import PlacementCache, ShardSizes, SimTier

DATA_SHARDS, PARITY_SHARDS = 10, 2
_GOLDEN = 0x9E3779B1


def model_block_bytes() -> int:
    """The configured model's block payload (``KVSTORE_PRESET``; v4.1-flash: 114,048 B)."""
    return GeometryConfig.from_env().block_bytes


def _positive(flag: str, value: float, integer: bool = False, zero: bool = False) -> None:
    """``value`` must be a finite number (an int with ``integer``) > 0 (>= 0 with ``zero``)."""
    kind = "an integer" if integer else "a number"
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    bad = isinstance(value, bool) or not ok or not math.isfinite(value)
    if bad or value < 0 or (value == 0 and not zero):
        raise InvalidArgument(flag, f"must be {kind} {'>= 0' if zero else '> 0'}, got {value!r}")


@dataclass(frozen=True)
class SimConfig:
    """One model run. Validated on construction; a bad value raises ``InvalidArgument`` naming
    its ``kvstore simulate`` flag.

    Capacities: ``capacity_bytes`` is the block **payload** bytes the whole tier may hold (the
    unit of ``kvstore replay --capacity-bytes`` and the oracles); each machine then gets that
    many blocks' worth of the live bytes a node counts (its shard records), spread over all
    machines, as the replay sizes its nodes. ``machine_capacity`` instead gives each machine's
    capacity in those live bytes (what ``kvstore up --capacity-bytes`` sets per node). Neither:
    unbounded.

    GC: the replay's watermarks (0.97 / 0.94) and a pass every ``gc_interval_s`` of simulated
    time (1 s, the replay's scan interval, which it counts in wall time), or after every
    ``gc_every_requests`` requests. The cadence matters only when the tier writes more between
    two passes than the 3 % between the watermarks: puts are then refused until the next pass.
    On the whole trace at 25 % of its unique blocks a pass a second and a pass after every
    request differ by 0.1 point of hit rate; on a 700-request slice at 25 % (a 14,000-block
    tier) by 0.4 point. To match a replay, pass ``gc_every_requests`` = its requests per
    second x its scan interval (on an idle machine; a busy one's GC passes take seconds and
    trim as they go) and ``gc_at_end`` (its bytes stored are measured once its GC settled).
    """

    machines: int = 14
    copies: int = 1
    capacity_bytes: int | None = None
    machine_capacity: int | None = None
    block_bytes: int = field(default_factory=model_block_bytes)
    gc_high: float = 0.97
    gc_low: float = 0.94
    gc_interval_s: float = 1.0
    gc_every_requests: int | None = None
    #: One more GC pass after the last request: the bytes stored are then the GC's settled
    #: state, as ``kvstore replay`` measures its own (a pass begun after its engines stopped).
    gc_at_end: bool = False
    mode: str = BOUNDED_REPLAY
    traffic_class: str = "chatbot"
    #: Trace time runs this many times faster than simulated time.
    speed: float = 1.0
    #: Annual failure rate of a machine (Poisson failures during the run).
    afr: float = 0.02
    #: Injected failures, seconds of simulated time from the first request.
    fail_at: tuple[float, ...] = ()
    seed: int = 0
    #: Per-machine network and disk bandwidth, bytes per second.
    net_bw: float = 25e9
    disk_bw: float = 6e9
    #: The repair's cap (None: ``BlockStoreConfig.repair_bytes_per_s``, 128 MiB/s).
    repair_bytes_per_s: int | None = None
    meta_shards: int = BlockStoreConfig.meta_shards
    #: Width of the timeline's buckets, seconds of simulated time.
    timeline_s: float = 60.0

    def __post_init__(self) -> None:
        width = DATA_SHARDS + PARITY_SHARDS
        _positive("--machines", self.machines, integer=True)
        if self.machines < width:
            raise InvalidArgument(
                "--machines", f"must be >= {width} (a stripe's 12 shards on distinct machines)"
            )
        if self.machines > 0xFFFE:
            raise InvalidArgument("--machines", f"at most {0xFFFE} (node ids are 16-bit)")
        _positive("--copies", self.copies, integer=True)
        _positive("block_bytes", self.block_bytes, integer=True)
        if self.capacity_bytes is not None and self.machine_capacity is not None:
            raise InvalidArgument(
                "--machine-capacity", "give --capacity-bytes or --machine-capacity, not both"
            )
        if self.capacity_bytes is not None:
            _positive("--capacity-bytes", self.capacity_bytes, integer=True)
            if self.capacity_bytes < self.block_bytes * self.copies:
                raise InvalidArgument(
                    "--capacity-bytes",
                    f"must hold at least one block per copy ({self.block_bytes * self.copies:,}"
                    f" B), got {self.capacity_bytes:,}",
                )
        if self.machine_capacity is not None:
            _positive("--machine-capacity", self.machine_capacity, integer=True)
        for flag, mark in (("--gc-high", self.gc_high), ("--gc-low", self.gc_low)):
            _positive(flag, mark)
            if mark > 1:
                raise InvalidArgument(flag, f"must be in (0, 1], got {mark}")
        if not self.gc_low < self.gc_high:
            raise InvalidArgument(
                "--gc-low", f"must be below --gc-high ({self.gc_low} >= {self.gc_high})"
            )
        _positive("--gc-interval", self.gc_interval_s)
        if self.gc_every_requests is not None:
            _positive("--gc-every", self.gc_every_requests, integer=True)
        check_mode(self.mode)
        classes = default_gc_config().class_names
        if self.traffic_class not in classes:
            raise InvalidArgument(
                "--traffic-class",
                f"unknown class {self.traffic_class!r} (the GC policy has {', '.join(classes)})",
            )
        _positive("--speed", self.speed)
        _positive("--afr", self.afr, zero=True)
        for at in self.fail_at:
            _positive("--fail-at", at, zero=True)
        _positive("--net-bw", self.net_bw)
        _positive("--disk-bw", self.disk_bw)
        if self.repair_bytes_per_s is not None:
            _positive("--repair-rate", self.repair_bytes_per_s, integer=True)
        _positive("meta_shards", self.meta_shards, integer=True)
        _positive("--timeline", self.timeline_s)

    @property
    def sizes(self) -> ShardSizes:
        return ShardSizes.of(self.block_bytes, DATA_SHARDS, PARITY_SHARDS)

    def node_capacity(self) -> int | None:
        """Live bytes each machine may hold for one copy of the traffic (None: unbounded)."""
        if self.machine_capacity is not None:
            return max(1, self.machine_capacity // self.copies)
        if self.capacity_bytes is None:
            return None
        blocks = self.capacity_bytes // self.block_bytes // self.copies
        return -(-blocks * self.sizes.live_per_block // self.machines)

    def capacity_payload_bytes(self) -> int | None:
        """The whole tier's capacity in block payload bytes (None: unbounded)."""
        if self.capacity_bytes is not None:
            return self.capacity_bytes
        if self.machine_capacity is None:
            return None
        blocks = self.machine_capacity * self.machines // self.sizes.live_per_block
        return blocks * self.block_bytes

    def store_config(self) -> BlockStoreConfig:
        """The tier's settings: kvstore's defaults (write quorum, repair bounds, detection),
        sized to this fleet, with the GC policy's traffic classes."""
        defaults = BlockStoreConfig()
        return BlockStoreConfig(
            data_shards=DATA_SHARDS,
            parity_shards=PARITY_SHARDS,
            storage_nodes=self.machines,
            meta_shards=self.meta_shards,
            traffic_classes=default_gc_config().class_names,
            repair_bytes_per_s=self.repair_bytes_per_s or defaults.repair_bytes_per_s,
        )

    def gc_config(self) -> GCConfig:
        """The GC policy (``gc/gc.toml``: TTLs, delete batch) with this run's watermarks."""
        policy = default_gc_config()
        return GCConfig(
            ttl=policy.ttl,
            default_class=policy.default_class,
            ttl_basis=policy.ttl_basis,
            high_watermark=self.gc_high,
            low_watermark=self.gc_low,
            scan_interval_s=self.gc_interval_s,
            delete_batch=policy.delete_batch,
            lease_default_s=policy.lease_default_s,
        )

    def repair(self) -> RepairRate:
        store = self.store_config()
        return repair_rate(
            store.repair_bytes_per_s, self.net_bw, self.disk_bw, self.machines, DATA_SHARDS
        )


# --- the trace, prepared once for many runs ----------------------------------------------------


@dataclass
class PreparedTrace:
    """A trace's keys, computed once: per request its full blocks' key words and their ids in
    ``unique_words``; the placement rankings per fleet size (``placement``)."""

    requests: list[TraceRequest]
    words: list[np.ndarray]
    ids: list[np.ndarray]
    unique_words: np.ndarray
    _placements: dict[int, PlacementCache] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        requests: Sequence[TraceRequest],
        fingerprint: bytes | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> PreparedTrace:
        """Keys with the model's fingerprint (``KVSTORE_PRESET``) unless ``fingerprint``."""
        if not requests:
            raise InvalidArgument("--trace", "holds no request")
        fingerprint = fingerprint or GeometryConfig.from_env().fingerprint()
        words = []
        for request in requests:
            words.append(request.key_words(fingerprint))
            if progress is not None:
                progress(1)
        flat = np.concatenate(words) if words else np.zeros((0, 4), np.uint64)
        rows = np.ascontiguousarray(flat).view(np.dtype((np.void, 32))).ravel()
        _, first, inverse = np.unique(rows, return_index=True, return_inverse=True)
        ids = np.split(inverse.astype(np.int64), np.cumsum([len(w) for w in words])[:-1])
        return cls(list(requests), words, ids, flat[first])

    @property
    def unique_blocks(self) -> int:
        return int(self.unique_words.shape[0])

    def placement(self, machines: int) -> PlacementCache:
        cache = self._placements.get(machines)
        if cache is None:
            cache = PlacementCache(self.unique_words, machines, DATA_SHARDS + PARITY_SHARDS)
            self._placements[machines] = cache
        return cache


# --- results -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClassFigures:
    """One traffic class, payload bytes (fleet: all copies)."""

    blocks_stored: int
    bytes_stored: int
    blocks_written: int
    bytes_written: int
    blocks_evicted: int
    bytes_evicted: int
    blocks_expired: int
    bytes_expired: int


@dataclass(frozen=True)
class TimelineBucket:
    start_s: float
    requests: int
    prompt_tokens: int
    hit_tokens: int
    net_bytes: float  # fleet: every machine's bytes sent and received

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class FailureRecord:
    """One machine lost during the run."""

    at_s: float
    machine: int
    injected: bool  # from ``fail_at`` (else drawn at ``afr``)
    live_bytes: int  # shard bytes the machine held (fleet: all copies)
    repair_s: float  # detection + live_bytes / achievable repair rate
    #: When the model's repair queue ran dry after it (seconds after the failure), None when
    #: it had not by the end of the model.
    simulated_repair_s: float | None


@dataclass(frozen=True)
class MachineFigures:
    """Per machine (fleet: all copies), over the run: live bytes held at the end (its shard
    records, what its capacity counts) and bytes moved; ``dead`` marks machines lost."""

    held_bytes: np.ndarray
    net_in: np.ndarray
    net_out: np.ndarray
    disk_read: np.ndarray
    disk_write: np.ndarray
    dead: np.ndarray


@dataclass
class SimResult:
    """What a run gives. Extensive figures are for the whole fleet (all copies); the hit rate
    and per-request hits are those of every copy."""

    config: SimConfig
    requests: int
    unique_blocks: int  # of one copy
    duration_s: float  # simulated time from the first request to the last
    prompt_tokens: int
    hit_tokens: int
    hits: np.ndarray  # hit tokens per request (trace order)
    by_class: dict[str, ClassFigures]
    blocks_refused: int
    blocks_under_redundant: int
    blocks_lost: int
    timeline: list[TimelineBucket]
    machines: MachineFigures
    failures: list[FailureRecord]
    repair: RepairRate
    gc_passes: int

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def _total(self, name: str) -> int:
        return sum(getattr(figures, name) for figures in self.by_class.values())

    @property
    def bytes_stored(self) -> int:
        """Payload bytes of the blocks held at the end."""
        return self._total("bytes_stored")

    @property
    def blocks_stored(self) -> int:
        return self._total("blocks_stored")

    @property
    def bytes_written(self) -> int:
        return self._total("bytes_written")

    @property
    def bytes_evicted(self) -> int:
        return self._total("bytes_evicted")

    @property
    def bytes_expired(self) -> int:
        return self._total("bytes_expired")

    def as_dict(self) -> dict[str, Any]:
        config = asdict(self.config)
        config["fail_at"] = list(self.config.fail_at)
        return {
            "config": config,
            "requests": self.requests,
            "unique_blocks_per_copy": self.unique_blocks,
            "duration_s": self.duration_s,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "token_hit_rate": self.token_hit_rate,
            "bytes_stored": self.bytes_stored,
            "bytes_written": self.bytes_written,
            "bytes_evicted": self.bytes_evicted,
            "bytes_expired": self.bytes_expired,
            "by_class": {name: asdict(figures) for name, figures in self.by_class.items()},
            "blocks_refused": self.blocks_refused,
            "blocks_under_redundant": self.blocks_under_redundant,
            "blocks_lost": self.blocks_lost,
            "gc_passes": self.gc_passes,
            "timeline": [{**asdict(b), "token_hit_rate": b.token_hit_rate} for b in self.timeline],
            "failures": [asdict(f) for f in self.failures],
            "repair_rate": asdict(self.repair),
        }


# --- the run -----------------------------------------------------------------------------------


def _failure_plan(config: SimConfig, horizon_s: float) -> list[tuple[float, bool]]:
    """(time, injected) of every failure: ``fail_at``, and a Poisson draw at ``afr`` per
    machine-year over ``horizon_s``."""
    rng = np.random.default_rng([config.seed, 1])
    rate = config.machines * config.afr / (365.25 * 86400.0)
    drawn = []
    t = 0.0
    while rate > 0:
        t += float(rng.exponential(1.0 / rate))
        if t > horizon_s:
            break
        drawn.append((t, False))
    return sorted([(float(at), True) for at in config.fail_at] + drawn)


class _Run:
    """One model run over a prepared trace (see the module doc)."""

    def __init__(
        self,
        prepared: PreparedTrace,
        config: SimConfig,
        progress: Callable[[int], None] | None,
    ) -> None:
        self.prepared = prepared
        self.config = config
        self.progress = progress
        self.store = config.store_config()
        self.sizes = config.sizes
        self.tier = SimTier(
            prepared.unique_words,
            self.store,
            config.gc_config(),
            prepared.placement(config.machines),
            self.sizes,
            config.traffic_class,
            config.node_capacity(),
            tier_refusal=config.copies > 1,
        )
        geometry = GeometryConfig.from_env()
        # A trace carries no SWA states: bounded replay keeps the block hit.
        self.query = HitQuery(blocks=self.tier, states=NoStates(), geometry=geometry)
        requests = prepared.requests
        start = requests[0].at_s
        self.times = [(r.at_s - start) / config.speed for r in requests]
        self.duration = self.times[-1]
        self.repair = config.repair()
        # Copy 0 repairs at its share of the rate: the copies' queues are alike.
        self.repair_rate0 = self.repair.bytes_per_s / config.copies
        self.rng = np.random.default_rng([config.seed, 2])
        self.victims = [int(m) for m in self.rng.permutation(config.machines)]
        self.failures = _failure_plan(config, self.duration)
        #: (time, machine, injected, live bytes it held) of each machine lost.
        self.failed: list[tuple[float, int, bool, int]] = []
        self.repaired_at: dict[int, float] = {}
        self.next_repair = math.inf
        self.last_gc = 0.0
        self.hits = np.zeros(len(requests), dtype=np.int64)
        buckets = int(self.duration // config.timeline_s) + 1
        self.bucket_requests = np.zeros(buckets, np.int64)
        self.bucket_prompt = np.zeros(buckets, np.int64)
        self.bucket_hit = np.zeros(buckets, np.int64)
        self.bucket_net = np.zeros(buckets, np.float64)

    # --- events ------------------------------------------------------------------------------

    def _fail(self, at: float, injected: bool) -> None:
        tier = self.tier
        live = [m for m in self.victims if not tier.dead[m]]
        if len(live) <= self.store.stripe_width:
            return  # the model keeps a stripe's width of machines
        machine = live[0]
        self.victims.remove(machine)
        held = tier.fail(machine)
        self.failed.append((at, machine, injected, held))
        self.next_repair = min(self.next_repair, at + self.store.dead_after_s)

    def _repair(self, at: float) -> None:
        detect = self.store.dead_after_s
        known = [machine for when, machine, _, _ in self.failed if when + detect <= at]
        host = int(self.tier.live_machines()[0])
        result = self.tier.repair_round(host, known)
        if result.stripes == 0 and result.unrecoverable == 0:
            self.next_repair = math.inf
            for machine in known:
                self.repaired_at.setdefault(machine, at)
            if len(known) < len(self.failed):  # one not declared dead yet: its turn comes
                self.next_repair = min(when + detect for when, _, _, _ in self.failed[len(known) :])
            return
        self.next_repair = at + result.bytes / self.repair_rate0

    def _gc(self, at: float) -> None:
        self.tier.at(at)
        self.tier.gc_pass()
        self.last_gc = at

    def _advance(self, until: float) -> None:
        """Run every failure, repair round and GC pass due up to ``until``, in time order. GC
        passes with no event between them would find what the first found, so only the last
        grid point before the next event runs."""
        interval = self.config.gc_interval_s
        periodic = self.config.gc_every_requests is None
        while True:
            fail_at = self.failures[0][0] if self.failures else math.inf
            gc_at = self.last_gc + interval if periodic else math.inf
            first = min(fail_at, self.next_repair, gc_at)
            if first > until:
                return
            if first == fail_at:
                at, injected = self.failures.pop(0)
                self.tier.at(at)
                self._fail(at, injected)
            elif first == self.next_repair:
                self.tier.at(first)
                self._repair(first)
            else:
                latest = min(until, fail_at, self.next_repair)
                steps = max(1, math.floor((latest - self.last_gc) / interval))
                self._gc(self.last_gc + steps * interval)

    def _serve(self, index: int, at: float) -> None:
        tier = self.tier
        tier.at(at)
        request = self.prepared.requests[index]
        ids = self.prepared.ids[index]
        engine = self._engine(request)
        before = tier.counters.total()
        tier.serving(ids)
        result = self.query.query_hit(
            HitRequest(
                block_keys=self.prepared.words[index],
                prompt_len=request.input_length,
                mode=self.config.mode,
            )
        )
        hit_blocks = result.plan.hit_tokens // BLOCK_TOKENS
        tier.read(ids[:hit_blocks], engine)
        tier.put(ids[hit_blocks:], engine)
        tier.release(result.lease)
        if tier.repair_pending() and self.next_repair == math.inf:
            self.next_repair = at + self.store.health_interval_s
        self.hits[index] = result.plan.hit_tokens
        bucket = int(at // self.config.timeline_s)
        self.bucket_requests[bucket] += 1
        self.bucket_prompt[bucket] += request.input_length
        self.bucket_hit[bucket] += result.plan.hit_tokens
        self.bucket_net[bucket] += tier.counters.total() - before

    def _engine(self, request: TraceRequest) -> int:
        """The machine whose engine serves ``request``: spread by its line, a live one."""
        machines = self.config.machines
        machine = (request.line * _GOLDEN) % machines
        while self.tier.dead[machine]:
            machine = (machine + 1) % machines
        return machine

    def run(self) -> SimResult:
        every = self.config.gc_every_requests
        for index, at in enumerate(self.times):
            self._advance(at)
            self._serve(index, at)
            if every is not None and (index + 1) % every == 0:
                self._gc(at)
            if self.progress is not None:
                self.progress(1)
        self._advance(self.duration)
        if self.config.gc_at_end:
            self._gc(self.duration)
        # After the trace: no more requests, the repair goes on until its queue runs dry.
        while self.next_repair < math.inf:
            self.tier.at(self.next_repair)
            self._repair(self.next_repair)
        return self._result()

    # --- the fleet from copy 0 ---------------------------------------------------------------

    def _permutations(self) -> list[np.ndarray]:
        """Copy r's machine relabelling (copy 0: none): machine ``perm[j]`` holds copy r's
        share of what machine j holds in copy 0. A machine lost is lost to every copy, so the
        dead keep their label and only the live are shuffled among themselves."""
        rng = np.random.default_rng([self.config.seed, 3])
        live = self.tier.live_machines()
        perms = [np.arange(self.config.machines)]
        for _ in range(self.config.copies - 1):
            perm = np.arange(self.config.machines)
            perm[live] = live[rng.permutation(live.size)]
            perms.append(perm)
        return perms

    @staticmethod
    def _fleet(vector: np.ndarray, permutations: Sequence[np.ndarray]) -> np.ndarray:
        total = np.zeros(vector.shape, dtype=np.float64)
        for perm in permutations:
            total[perm] += vector
        return total

    def _result(self) -> SimResult:
        config, tier = self.config, self.tier
        copies = config.copies
        perms = self._permutations()
        counters = tier.counters
        machines = MachineFigures(
            held_bytes=self._fleet(tier.shards * float(self.sizes.live), perms),
            net_in=self._fleet(counters.net_in, perms),
            net_out=self._fleet(counters.net_out, perms),
            disk_read=self._fleet(counters.disk_read, perms),
            disk_write=self._fleet(counters.disk_write, perms),
            dead=tier.dead.copy(),
        )
        stored = tier.stored_by_class()
        block = self.sizes.block_bytes
        by_class = {}
        for name in self.store.traffic_classes:
            figures = ClassFigures(
                blocks_stored=copies * stored.get(name, 0) // block,
                bytes_stored=copies * stored.get(name, 0),
                blocks_written=copies * tier.written.blocks.get(name, 0),
                bytes_written=copies * tier.written.bytes.get(name, 0),
                blocks_evicted=copies * tier.evicted.blocks.get(name, 0),
                bytes_evicted=copies * tier.evicted.bytes.get(name, 0),
                blocks_expired=copies * tier.expired.blocks.get(name, 0),
                bytes_expired=copies * tier.expired.bytes.get(name, 0),
            )
            if any(asdict(figures).values()) or name == config.traffic_class:
                by_class[name] = figures
        failures = []
        detect = self.store.dead_after_s
        for at, machine, injected, held in self.failed:
            # Every copy's share of a lost machine is copy 0's (it keeps its label).
            fleet_held = copies * held
            repaired = self.repaired_at.get(machine)
            failures.append(
                FailureRecord(
                    at_s=at,
                    machine=machine,
                    injected=injected,
                    live_bytes=fleet_held,
                    repair_s=self.repair.seconds(fleet_held, detect),
                    simulated_repair_s=None if repaired is None else repaired - at,
                )
            )
        timeline = [
            TimelineBucket(
                start_s=i * config.timeline_s,
                requests=int(self.bucket_requests[i]),
                prompt_tokens=int(self.bucket_prompt[i]),
                hit_tokens=int(self.bucket_hit[i]),
                net_bytes=float(self.bucket_net[i]) * copies,
            )
            for i in range(self.bucket_requests.size)
        ]
        prompts = np.array([r.input_length for r in self.prepared.requests], dtype=np.int64)
        return SimResult(
            config=config,
            requests=len(self.prepared.requests),
            unique_blocks=self.prepared.unique_blocks,
            duration_s=self.duration,
            prompt_tokens=int(prompts.sum()),
            hit_tokens=int(self.hits.sum()),
            hits=self.hits,
            by_class=by_class,
            blocks_refused=copies * tier.refused_blocks,
            blocks_under_redundant=copies * tier.under_redundant_blocks,
            blocks_lost=copies * int(tier.lost.sum()),
            timeline=timeline,
            machines=machines,
            failures=failures,
            repair=self.repair,
            gc_passes=tier.gc_passes,
        )


def simulate(
    requests: Sequence[TraceRequest],
    config: SimConfig,
    *,
    prepared: PreparedTrace | None = None,
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    """Run the model over ``requests`` (timestamp order, as ``load_trace`` gives them).
    ``prepared``: the trace's keys and placements from an earlier run over the same requests
    (``PreparedTrace.of``), so a sweep pays for them once; ``progress`` is called with the
    number of requests done since its last call."""
    if prepared is None:
        prepared = PreparedTrace.of(requests)
    elif len(prepared.requests) != len(requests):
        raise InvalidArgument("prepared", "was prepared from other requests")
    return _Run(prepared, config, progress).run()
