"""Where blocks live: meta shard by key hash, stripe placement by rendezvous hashing.

Rendezvous (highest-random-weight) hashing: every (key, node) pair gets a pseudo-random score;
a stripe goes to the ``width`` live nodes with the highest scores, shard i to the i-th best.
Why this scheme:

- deterministic: the same key and live set give the same placement in every process;
- balanced: each node is equally likely to be in any rank, so load spreads evenly (tested);
- minimal movement: a node joining or leaving only changes stripes that scored it in their top
  ``width`` — and we never move existing stripes anyway: the chosen placement is recorded in the
  meta index at commit time, so later membership changes affect only new writes and repairs;
- one stripe never has two shards on one node (the top-``width`` set has no duplicates), and
  where several nodes share a host (``FailureDomains``: fewer hosts than nodes), at most
  ceil(width / hosts) on one host: the best-scoring nodes are taken in order, skipping a node
  whose host already holds that many of the stripe's shards. With 7 hosts a stripe has at most
  2 shards on a host, so losing any host loses at most m = 2 of them. The cap gives way only
  where the live hosts cannot hold a whole stripe under it (then it rises by one until they
  can): a stripe with all its shards, a few hosts holding one more, beats a stripe left short.

Scores are splitmix64 mixes of a little-endian word of the key and a per-node salt, computed for
a whole batch with numpy (no Python loop per pair).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.keys import key_words as _key_words

_native: ModuleType | None
try:  # the keys' hash in C; without a compiler at install, the numpy reference serves
    from kvstore.blockstore import _keymix as _native
except ImportError:  # pragma: no cover - the CI machine builds it
    _native = None

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
#: Domain-separates meta-shard choice from placement (different key words and salt).
_META_SALT = np.uint64(0x6D657461_73686172)
_PLACEMENT_SEED = np.uint64(0x706C6163_656D6E74)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = values + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def key_words(keys: Sequence[bytes] | np.ndarray) -> np.ndarray:
    """(n, 4) little-endian uint64 words of 32-byte keys (the same on any machine)."""
    return _key_words(keys).astype("<u8", copy=False)  # a no-op on little-endian hosts


def meta_shard_of(keys: Sequence[bytes] | np.ndarray, num_shards: int) -> np.ndarray:
    """Meta shard (0..num_shards-1) owning each key, as an int64 array."""
    if num_shards <= 0:
        raise InvalidArgument("num_shards", f"must be >= 1, got {num_shards}")
    mixed = _key_hash(key_words(keys), _META_SALT)
    return (mixed % np.uint64(num_shards)).astype(np.int64)


def _node_salts(nodes: np.ndarray) -> np.ndarray:
    return _splitmix64(nodes.astype(np.uint64) * _MIX2)


def _key_hash(words: np.ndarray, seed: np.uint64) -> np.ndarray:
    """A 64-bit hash of all 32 key bytes (keys are BLAKE2 digests in production, but tools and
    tests use structured keys too: every word must count). In C where built (``_keymix``: the
    numpy chain below is ~40 array operations, most of a meta shard's check of a call's keys);
    this is its reference."""
    if _native is not None and words.ndim == 2 and words.shape[1]:
        out = np.empty(words.shape[0], np.uint64)
        _native.key_hash(np.ascontiguousarray(words, np.uint64), words.shape[1], int(seed), out)
        return out
    mixed = _splitmix64(words[:, 0] ^ seed)
    for column in range(1, words.shape[1]):
        mixed = _splitmix64(mixed ^ words[:, column])
    return mixed


def _scores(keys: Sequence[bytes], nodes: np.ndarray) -> np.ndarray:
    key_part = _key_hash(key_words(keys), _PLACEMENT_SEED)
    return _splitmix64(key_part[:, None] ^ _node_salts(nodes)[None, :])


class FailureDomains:
    """Which failure domain (host) each storage node is in, and the most shards of one stripe
    a domain may hold: ceil(width / domains), counting every domain the deployment has (a
    domain down for now still counts: the cap must not loosen when hosts fail)."""

    def __init__(self, labels: Sequence[str], width: int) -> None:
        names = sorted(set(labels))
        if not names or width <= 0:
            raise InvalidArgument("labels", "need at least one domain and a positive width")
        self.labels = tuple(labels)
        self.count = len(names)
        self.cap = -(-width // self.count)
        #: Domain index of node id i (nodes are 0..len(labels)-1).
        self._of = np.array([names.index(label) for label in labels], dtype=np.int64)

    @classmethod
    def of_config(cls, labels: Sequence[str], width: int) -> FailureDomains | None:
        """The domains ``labels`` (a config's ``failure_domains``) name; None when they cap
        nothing: every node a domain of its own (no labels, or all distinct), or one domain
        that may hold a whole stripe anyway."""
        if not labels:
            return None
        domains = cls(labels, width)
        return None if domains.cap >= width or domains.count == len(labels) else domains

    def of(self, nodes: np.ndarray) -> np.ndarray:
        """Domain index of each node id in ``nodes`` (same shape)."""
        nodes = np.asarray(nodes, dtype=np.int64)
        if nodes.size and (nodes.min() < 0 or nodes.max() >= self._of.size):
            raise InvalidArgument("nodes", f"node ids must be in [0, {self._of.size})")
        return self._of[nodes]

    def room(self, nodes: Sequence[int] | np.ndarray, cap: int | None = None) -> int:
        """Shards of one stripe that ``nodes`` can take at ``cap`` a domain (default: the cap)."""
        counts = np.bincount(self.of(np.asarray(nodes, dtype=np.int64)), minlength=self.count)
        return int(np.minimum(counts, self.cap if cap is None else cap).sum())

    def cap_for(self, nodes: Sequence[int] | np.ndarray, width: int) -> int:
        """The cap, raised as little as needed for ``nodes`` to take ``width`` shards."""
        cap = self.cap
        while cap < width and self.room(nodes, cap) < width:
            cap += 1
        return cap


def _check_nodes(nodes: Sequence[int] | np.ndarray) -> np.ndarray:
    array = np.asarray(nodes, dtype=np.int64).reshape(-1)
    if array.size and (array.min() < 0 or np.unique(array).size != array.size):
        raise InvalidArgument("nodes", "must be distinct non-negative node ids")
    return array


def place(
    keys: Sequence[bytes],
    nodes: Sequence[int] | np.ndarray,
    width: int,
    domains: FailureDomains | None = None,
) -> np.ndarray:
    """Placement of each key's stripe: (n, width) int32 node ids, shard i on column i, at most
    ``domains.cap_for(nodes, width)`` of them in one domain.

    Raises ``InvalidArgument`` when fewer than ``width`` nodes are given: a stripe never puts two
    shards on one node.
    """
    node_array = _check_nodes(nodes)
    if node_array.size < width:
        raise InvalidArgument(
            "nodes", f"{node_array.size} live nodes, a stripe needs {width} distinct ones"
        )
    if len(keys) == 0:
        return np.zeros((0, width), dtype=np.int32)
    node_array = np.sort(node_array)  # the input order of the live set must not matter
    scores = _scores(keys, node_array)
    # ~score ascending == score descending; stable sort breaks (practically impossible) ties by
    # node id, so the result is deterministic.
    order = np.argsort(~scores, axis=1, kind="stable")
    if domains is None:
        return node_array[order[:, :width]].astype(np.int32)
    ranked = domains.of(node_array)[order]  # (n, nodes): the domain of each ranked node
    seen = np.empty_like(ranked)  # how many better-ranked nodes share that domain
    for domain in np.unique(ranked):
        mask = ranked == domain
        seen[mask] = (np.cumsum(mask, axis=1) - 1)[mask]
    allowed = seen < domains.cap_for(node_array, width)
    first = np.argsort(~allowed, axis=1, kind="stable")[:, :width]  # first `width` allowed
    return node_array[np.take_along_axis(order, first, axis=1)].astype(np.int32)


def replacement(
    key: bytes, nodes: Sequence[int] | np.ndarray, exclude: Sequence[int] | np.ndarray
) -> int | None:
    """Best node for a lost shard of ``key``: the highest-scoring live node not in ``exclude``
    (the stripe's other nodes), or None when there is none."""
    node_array = _check_nodes(nodes)
    excluded = set(int(node) for node in exclude)
    candidates = np.sort(
        np.array([n for n in node_array if int(n) not in excluded], dtype=np.int64)
    )
    if candidates.size == 0:
        return None
    scores = _scores([key], candidates)[0]
    return int(candidates[int(np.argmax(scores))])


def replacements(
    keys: Sequence[bytes],
    nodes: Sequence[int] | np.ndarray,
    placements: np.ndarray,
    wanted: np.ndarray,
    domains: FailureDomains | None = None,
) -> np.ndarray:
    """``replacement`` for many stripes at once: for each stripe ``i`` and each shard index
    with ``wanted[i, j]``, in index order, the best node of ``nodes`` outside ``placements[i]``
    and outside the ones already chosen for it, in a domain holding fewer than ``domains.cap``
    of the stripe's kept and chosen shards (where none is, the cap rises by one for what is
    left, up to the width); -1 where no node is left. (n, width) int64."""
    node_array = np.sort(_check_nodes(nodes))
    wanted = np.asarray(wanted, dtype=bool)
    out = np.full(wanted.shape, -1, dtype=np.int64)
    if len(keys) == 0 or node_array.size == 0:
        return out
    placements = np.asarray(placements)
    scores = _scores(keys, node_array)
    taken = (placements[:, :, None] == node_array[None, None, :]).any(axis=1)
    if domains is None:
        _choose(scores, taken, wanted, out, node_array, None)
        return out
    node_domain = domains.of(node_array)
    kept = ~wanted & (placements >= 0)
    held = np.zeros((placements.shape[0], domains.count), dtype=np.int64)
    rows, columns = np.nonzero(kept)
    np.add.at(held, (rows, domains.of(placements[rows, columns])), 1)
    for cap in range(domains.cap, wanted.shape[1] + 1):
        left = wanted & (out < 0)
        if not left.any():
            break
        _choose(scores, taken, left, out, node_array, (held, node_domain, cap))
    return out


def _choose(
    scores: np.ndarray,
    taken: np.ndarray,
    wanted: np.ndarray,
    out: np.ndarray,
    node_array: np.ndarray,
    capped: tuple[np.ndarray, np.ndarray, int] | None,
) -> None:
    """Fill ``out[i, j]`` for each ``wanted[i, j]``, index by index: the best node not ``taken``
    by stripe ``i`` (and, ``capped`` = (shards each domain holds of each stripe, each node's
    domain, cap), in a domain under the cap); both are updated with every choice."""
    for index in range(wanted.shape[1]):
        rows = np.flatnonzero(wanted[:, index])
        if rows.size == 0:
            continue
        blocked = taken[rows]
        if capped is not None:
            held, node_domain, cap = capped
            blocked = blocked | (held[rows][:, node_domain] >= cap)
        best = np.argmax(np.where(blocked, np.uint64(0), scores[rows]), axis=1)
        free = ~blocked[np.arange(rows.size), best]  # all blocked: argmax fell on one
        out[rows[free], index] = node_array[best[free]]
        taken[rows[free], best[free]] = True
        if capped is not None:
            np.add.at(held, (rows[free], node_domain[best[free]]), 1)
