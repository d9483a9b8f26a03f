"""Where blocks live: meta shard by key hash, stripe placement by rendezvous hashing.

Rendezvous (highest-random-weight) hashing: every (key, node) pair gets a pseudo-random score;
a stripe goes to the ``width`` live nodes with the highest scores, shard i to the i-th best.
Why this scheme:

- deterministic: the same key and live set give the same placement in every process;
- balanced: each node is equally likely to be in any rank, so load spreads evenly (tested);
- minimal movement: a node joining or leaving only changes stripes that scored it in their top
  ``width`` — and we never move existing stripes anyway: the chosen placement is recorded in the
  meta index at commit time, so later membership changes affect only new writes and repairs;
- one stripe never has two shards in one failure domain: node ids are distinct domains and the
  top-``width`` set has no duplicates by construction.

Scores are splitmix64 mixes of a little-endian word of the key and a per-node salt, computed for
a whole batch with numpy (no Python loop per pair).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.keys import key_words as _key_words

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
    tests use structured keys too: every word must count)."""
    mixed = _splitmix64(words[:, 0] ^ seed)
    for column in range(1, words.shape[1]):
        mixed = _splitmix64(mixed ^ words[:, column])
    return mixed


def _scores(keys: Sequence[bytes], nodes: np.ndarray) -> np.ndarray:
    key_part = _key_hash(key_words(keys), _PLACEMENT_SEED)
    return _splitmix64(key_part[:, None] ^ _node_salts(nodes)[None, :])


def _check_nodes(nodes: Sequence[int] | np.ndarray) -> np.ndarray:
    array = np.asarray(nodes, dtype=np.int64).reshape(-1)
    if array.size and (array.min() < 0 or np.unique(array).size != array.size):
        raise InvalidArgument("nodes", "must be distinct non-negative node ids")
    return array


def place(keys: Sequence[bytes], nodes: Sequence[int] | np.ndarray, width: int) -> np.ndarray:
    """Placement of each key's stripe: (n, width) int32 node ids, shard i on column i.

    Raises ``InvalidArgument`` when fewer than ``width`` nodes are given: a stripe never doubles
    up in a failure domain.
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
    return node_array[order[:, :width]].astype(np.int32)


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
