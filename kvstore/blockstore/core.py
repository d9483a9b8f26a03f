"""The state every part of the block client shares: configuration, the fanout, node health
(which nodes failed and when to try them again, which are draining, their latency), and the
plumbing of waiting for many calls at once. The read path (``reads.py``) and the write/lookup
path (``client.py``) build on it."""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Concatenate, ParamSpec, TypeVar

import numpy as np

from kvstore.blockstore.calls import MetaShardCalls, meta_target
from kvstore.blockstore.config import BlockStoreConfig
from kvstore.blockstore.fanout import Fanout, Ticket, gather
from kvstore.blockstore.placement import FailureDomains, meta_shard_of
from kvstore.clock import Clock, SystemClock
from kvstore.ec import Codec
from kvstore.errors import (
    InvalidArgument,
    NodeUnavailable,
)
from kvstore.keys import BlockKey, check_keys, key_words

#: Weight of the newest sample in a node's moving latency estimate.
_EWMA = 0.2
#: Reads of one size class timed before their own percentile sets the hedge delay (until
#: then: ``hedge_after_s``), and how many recent ones it looks at.
_HEDGE_MIN_READS = 16
_HEDGE_WINDOW = 256
#: The hedge delay never goes below this (in-process or on an idle LAN a p95 can be ~0.1 ms:
#: hedging every read that is a hair late would only double the calls).
_HEDGE_FLOOR_S = 0.001
#: A node is slow (asked only when the others cannot serve) above this multiple of the median
#: node's latency estimate, and at least this much above the median: in-process or on an idle
#: LAN the median is tens of microseconds, where one scheduling hiccup doubles a node's
#: estimate, and reordering over that sends reads to parity shards (a decode) for nothing.
_SLOW_FACTOR = 2.0
_SLOW_MARGIN_S = 0.001
#: The longest skip of a failing node, in ``node_retry_s`` units (8: 40 s at the default).
_MAX_BACKOFF = 8

P = ParamSpec("P")
R = TypeVar("R")


class ClientCore:
    """Shared state of ``BlockStoreClient`` (see the module doc)."""

    def __init__(
        self,
        config: BlockStoreConfig,
        fanout: Fanout,
        node_ids: Sequence[int] | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.config = config
        self._fanout = fanout
        self._clock = clock or SystemClock()
        self._codec = Codec(config.data_shards, config.parity_shards)
        self._k = config.data_shards
        self._width = config.stripe_width
        #: Hosts holding several nodes (None: every node its own): caps a stripe per host.
        self._domains = FailureDomains.of_config(config.failure_domains, config.stripe_width)
        self._nodes = list(node_ids if node_ids is not None else range(config.storage_nodes))
        self._retry_at: dict[int, float] = {}
        #: Nodes whose being down is more than one failed call: the cluster declared them, or
        #: they failed again while skipped (asked as a last resort, or probed). A node down
        #: on one failure alone is only suspected: a lookup probes it (``suspects``), and one
        #: that answered (``_vouched``: for which skip, by its end) counts as up to lookups
        #: until that skip is over (writes still leave it out: its failure may be theirs).
        self._confirmed: set[int] = set()
        self._vouched: dict[int, float] = {}
        #: Slow failures of each node in a row (calls that waited half a call timeout or more,
        #: no success between): the skip window doubles with each, so a node cut off for long
        #: (a partitioned host) costs a caller one call timeout now and then, not one every
        #: ``node_retry_s``. A node that refuses at once (its process died) costs nothing to
        #: try again and is skipped for ``node_retry_s``, so a restarted node is used again soon.
        self._failures_in_a_row: dict[int, int] = {}
        #: Nodes that refused a put as draining, until when writes leave them out (reads do not:
        #: a draining node still serves what it holds).
        self._draining_until: dict[int, float] = {}
        self._latency: dict[int, float] = {}
        #: Nodes whose estimate only bounds have set (``_note_latency``): never counted slow.
        self._bounded_only: set[int] = set()
        #: Recent read durations by size class (``_size_class``): the hedge waits for the
        #: ``hedge_percentile`` of these.
        self._read_times: dict[int, deque[float]] = {}
        self._read_times_lock = threading.Lock()  # a client serves many threads (the gateway)
        self._fetches = 0
        self.counters: dict[str, int] = defaultdict(int)
        # Releases waiting to ride on the next lookup (see ``BlockStoreConfig.release_batch_s``).
        self._deferred: list[tuple[np.ndarray, np.ndarray]] = []
        self._deferred_lock = threading.Lock()
        self._deferred_since: float | None = None  # when the oldest deferred release came
        self._flush_wake = threading.Event()
        self._flusher: threading.Thread | None = None

    # --- membership and health --------------------------------------------------------------

    @property
    def node_ids(self) -> list[int]:
        return list(self._nodes)

    def set_nodes(self, node_ids: Sequence[int]) -> None:
        self._nodes = sorted({int(node) for node in node_ids})

    def down_nodes(self) -> list[int]:
        now = time.monotonic()
        return sorted(node for node, until in self._retry_at.items() if until > now)

    def confirmed_down(self) -> list[int]:
        """The nodes a lookup takes for down (see ``_confirmed``)."""
        return [node for node in self.down_nodes() if node in self._confirmed]

    def suspects(self) -> list[int]:
        """Nodes skipped on the word of one failed call alone that no probe answered for yet
        (a lookup probes them)."""
        return [
            node
            for node in self.down_nodes()
            if node not in self._confirmed and self._vouched.get(node) != self._retry_at.get(node)
        ]

    def _vouch(self, node: int, answered: bool) -> None:
        """A probe of a suspected node: answered, it counts as up to lookups for the rest of
        its skip; not, it is confirmed down."""
        if answered:
            self._vouched[node] = self._retry_at.get(node, 0.0)
        else:
            self._confirmed.add(node)

    def _mark_failed(self, node: int, waited_s: float = 0.0) -> None:
        """``node`` failed a call that waited ``waited_s`` for it; a second failure while it
        is skipped confirms it down."""
        if self._retry_at.get(node, 0.0) > time.monotonic():
            self._confirmed.add(node)
        else:
            self._confirmed.discard(node)  # up until now: a suspicion, not yet a verdict
        row = 0
        if waited_s >= 0.5 * self.config.call_timeout_s:
            row = self._failures_in_a_row.get(node, 0) + 1
            self._failures_in_a_row[node] = row
        backoff = min(2 ** max(row - 1, 0), _MAX_BACKOFF)
        self._retry_at[node] = time.monotonic() + self.config.node_retry_s * backoff
        self.counters["node_failures"] += 1

    def _mark_draining(self, node: int) -> None:
        """``node`` takes no new shards: leave it out of write placement for ``node_retry_s``
        (then ask again: a drain may have been called off). Not a failure: reads still use it."""
        self._draining_until[node] = time.monotonic() + self.config.node_retry_s
        self.counters["node_draining_refusals"] += 1

    def draining_nodes(self) -> list[int]:
        now = time.monotonic()
        return sorted(node for node, until in self._draining_until.items() if until > now)

    def _mark_ok(self, node: int, seconds: float, upper_bound: bool = False) -> None:
        self._mark_up(node)
        self._note_latency(node, seconds, upper_bound=upper_bound)

    def _mark_up(self, node: int) -> None:
        """``node`` answered: no longer skipped."""
        self._retry_at.pop(node, None)
        self._failures_in_a_row.pop(node, None)
        self._confirmed.discard(node)
        self._vouched.pop(node, None)

    def slow_nodes(self) -> set[int]:
        """Nodes much slower than the median (see ``_SLOW_FACTOR``): reads ask them last."""
        return set(self.slow_estimates())

    def slow_estimates(self) -> dict[int, float]:
        """The slow nodes (``slow_nodes``) and their latency estimates, in seconds."""
        latency = dict(self._latency)  # a copy: the gateway's threads add nodes meanwhile
        if len(latency) < 2:
            return {}
        median = float(np.median(list(latency.values())))
        threshold = max(_SLOW_FACTOR * median, median + _SLOW_MARGIN_S)
        bounded = set(self._bounded_only)
        return {node: v for node, v in latency.items() if v > threshold and node not in bounded}

    def _note_latency(
        self, node: int, seconds: float, lower_bound: bool = False, upper_bound: bool = False
    ) -> None:
        """Fold one call's latency into the node's moving estimate. A ``lower_bound`` is a call
        given up because the read completed without it: the node was slower than the nodes
        asked after it, and its estimate becomes at least that wait at once (never lower: a
        slow node's probes are given up as soon as their read completes, and folding those
        short waits in as answers made the node look fast again in the middle of its slow
        spell, so read after read waited for its hedge). Answers bring it back down.
        An ``upper_bound`` is an answer taken with others after one wait (a reader that sleeps
        until all its calls answered): the node answered within that time, maybe long before,
        so it only lowers the estimate. Folded in as a time, a reader's own stall (descheduled,
        or waiting on a hung node) raised every node's estimate at once, and a node known slow
        fell under twice the median and was asked, and hedged, again.
        An estimate that only bounds have set says how slow the node was at most, never that
        it is slow: such a node is not counted slow (``slow_estimates``), and its first time or
        lower bound replaces the estimate. (A put's times are bounds, its calls taken together;
        the first node sent to waits for the sends to all the others, and on a busy host its
        bound alone made it slow, where the reads then asked a node that never answers.)"""
        previous = self._latency.get(node)
        if previous is None or (node in self._bounded_only and not upper_bound):
            # The first estimate, or a time or lower bound where only bounds had set it.
            if upper_bound:
                self._bounded_only.add(node)
            else:
                self._bounded_only.discard(node)
            self._latency[node] = seconds
        elif lower_bound:
            self._latency[node] = max(previous, seconds)
        elif upper_bound and seconds >= previous:
            return  # answered within ``seconds``: no news
        else:
            self._latency[node] = (1 - _EWMA) * previous + _EWMA * seconds

    @staticmethod
    def _size_class(blocks: int) -> int:
        """Reads of 1, 2-3, 4-7, ... blocks are timed apart: a batch of 64 takes longer than
        one block, and must not set the single-block read's hedge."""
        return max(int(blocks), 1).bit_length()

    def _note_read_time(self, blocks: int, seconds: float) -> None:
        size_class = self._size_class(blocks)
        with self._read_times_lock:
            times = self._read_times.get(size_class)
            if times is None:
                times = self._read_times[size_class] = deque(maxlen=_HEDGE_WINDOW)
            times.append(seconds)

    def _hedge_delay(self, blocks: int) -> float:
        """How long a read of ``blocks`` blocks waits for its first k shards before asking the
        other nodes: the ``hedge_percentile`` of recent reads of its size (hedging "after the
        95th-percentile expected latency", as in Dean & Barroso's *The Tail at Scale*: only
        the slowest few reads pay for a second request, and a read that meets a newly slow node
        waits about one normal tail, not a fixed 50 ms); ``hedge_after_s`` until enough reads of
        that size were timed."""
        with self._read_times_lock:  # a deque another thread appends to cannot be iterated
            recent = list(self._read_times.get(self._size_class(blocks), ()))
        if len(recent) < _HEDGE_MIN_READS:
            return self.config.hedge_after_s
        return max(_HEDGE_FLOOR_S, float(np.percentile(recent, self.config.hedge_percentile)))

    def _learn_down(self, nodes: Sequence[int]) -> None:
        """Nodes the cluster declared dead: skip them without trying first."""
        until = time.monotonic() + self.config.node_retry_s
        for node in nodes:
            self._retry_at[int(node)] = max(self._retry_at.get(int(node), 0.0), until)
            self._confirmed.add(int(node))

    def _live_nodes(self) -> list[int]:
        down = set(self.down_nodes())
        return [node for node in self._nodes if node not in down]

    def _write_nodes(self) -> list[int]:
        """The nodes new shards may go to: live and not known to be draining."""
        draining = set(self.draining_nodes())
        return [node for node in self._live_nodes() if node not in draining]

    # --- plumbing ---------------------------------------------------------------------------

    def _gather(
        self, tickets: Iterable[Ticket[R]], timeout: float
    ) -> dict[Ticket[R], R | NodeUnavailable]:
        """Wait for every ticket (up to ``timeout``); values are results or NodeUnavailable."""
        return gather(self._fanout, tickets, timeout)

    def _by_meta(self, keys: Sequence[BlockKey]) -> dict[int, list[int]]:
        groups = self._by_meta_words(key_words(keys)).items()
        # Shards in order of their first key, so answers built from them keep the keys' order.
        return {shard: p.tolist() for shard, p in sorted(groups, key=lambda item: item[1][0])}

    def _by_meta_words(self, words: np.ndarray) -> dict[int, np.ndarray]:
        """Positions of ``words`` per owning meta shard (vectorised)."""
        if words.shape[0] == 0:
            return {}
        if self.config.meta_shards == 1:
            return {0: np.arange(words.shape[0])}
        owners = meta_shard_of(words, self.config.meta_shards)
        order = np.argsort(owners, kind="stable")
        shards, starts = np.unique(owners[order], return_index=True)
        bounds = [*starts.tolist(), order.size]
        return {
            int(shard): order[bounds[i] : bounds[i + 1]] for i, shard in enumerate(shards.tolist())
        }

    def _meta_calls(
        self,
        keys: Sequence[BlockKey],
        method: Callable[Concatenate[MetaShardCalls, list[BlockKey], P], R],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> dict[int, tuple[list[int], R | NodeUnavailable]]:
        """Call ``method(keys_of_shard, *args)`` on every meta shard owning some of ``keys``;
        returns shard -> (positions, result or NodeUnavailable)."""
        groups = self._by_meta(keys)
        tickets = {
            self._fanout.submit(
                meta_target(shard), method, [keys[p] for p in positions], *args, **kwargs
            ): shard
            for shard, positions in groups.items()
        }
        outcomes = self._gather(tickets, self.config.call_timeout_s)
        return {tickets[t]: (groups[tickets[t]], outcome) for t, outcome in outcomes.items()}

    def _check_keys(self, keys: Sequence[bytes]) -> list[BlockKey]:
        if isinstance(keys, bytes | bytearray):
            raise InvalidArgument("keys", "must be a sequence of keys, got one bytes object")
        return check_keys(keys, "keys")

    def stats(self) -> dict[str, object]:
        return {
            **self.counters,
            "down_nodes": self.down_nodes(),
            "draining_nodes": self.draining_nodes(),
            "slow_nodes": sorted(self.slow_nodes()),
            "latency_ms": {node: round(v * 1e3, 3) for node, v in sorted(self._latency.items())},
            # By the smallest read size of each class (1, 2, 4, ... blocks).
            "hedge_delay_ms": {
                1 << (size_class - 1): round(self._hedge_delay(1 << (size_class - 1)) * 1e3, 3)
                for size_class in sorted(self._read_times)
            },
        }
