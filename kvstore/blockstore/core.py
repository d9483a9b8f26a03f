"""The state every part of the block client shares: configuration, the fanout, node health
(which nodes failed and when to try them again, their latency), and the plumbing of waiting
for many calls at once. The read path (``reads.py``) and the write/lookup path (``client.py``)
build on it."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Concatenate, ParamSpec, TypeVar

import numpy as np

from kvstore.blockstore.calls import MetaShardCalls, meta_target
from kvstore.blockstore.config import BlockStoreConfig
from kvstore.blockstore.fanout import Fanout, Ticket, gather
from kvstore.blockstore.placement import meta_shard_of
from kvstore.clock import Clock, SystemClock
from kvstore.ec import Codec
from kvstore.errors import (
    InvalidArgument,
    NodeUnavailable,
)
from kvstore.keys import BlockKey, check_keys, key_words

#: Weight of the newest sample in a node's moving latency estimate.
_EWMA = 0.2

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
        self._nodes = list(node_ids if node_ids is not None else range(config.storage_nodes))
        self._retry_at: dict[int, float] = {}
        self._latency: dict[int, float] = {}
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

    def _mark_failed(self, node: int) -> None:
        self._retry_at[node] = time.monotonic() + self.config.node_retry_s
        self.counters["node_failures"] += 1

    def _mark_ok(self, node: int, seconds: float) -> None:
        self._retry_at.pop(node, None)
        self._note_latency(node, seconds)

    def _note_latency(self, node: int, seconds: float) -> None:
        """Fold one call's latency (or a lower bound of it: a call given up) into the node's
        moving estimate."""
        previous = self._latency.get(node)
        self._latency[node] = (
            seconds if previous is None else (1 - _EWMA) * previous + (_EWMA * seconds)
        )

    def _learn_down(self, nodes: Sequence[int]) -> None:
        """Nodes the cluster declared dead: skip them without trying first."""
        until = time.monotonic() + self.config.node_retry_s
        for node in nodes:
            self._retry_at[int(node)] = max(self._retry_at.get(int(node), 0.0), until)

    def _live_nodes(self) -> list[int]:
        down = set(self.down_nodes())
        return [node for node in self._nodes if node not in down]

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
            "latency_ms": {node: round(v * 1e3, 3) for node, v in sorted(self._latency.items())},
        }
