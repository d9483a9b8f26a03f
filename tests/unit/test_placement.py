"""Placement: rendezvous hashing over live nodes, meta shard by key hash."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore.blockstore import placement
from kvstore.blockstore.placement import meta_shard_of, place, replacement
from kvstore.errors import InvalidArgument

WIDTH = 12


def _keys(count: int, salt: bytes = b"") -> list[bytes]:
    return [
        hashlib.blake2b(salt + i.to_bytes(8, "little"), digest_size=32).digest()
        for i in range(count)
    ]


@pytest.fixture(params=["c", "numpy"])
def key_hash_in(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The keys' hash by the C extension (``_keymix``; the CI machine builds it), or by its
    numpy reference."""
    if request.param == "numpy":
        monkeypatch.setattr(placement, "_native", None)
    else:
        assert placement._native is not None
    return str(request.param)


def test_placement_is_golden_and_independent_of_process_and_input_order(key_hash_in: str) -> None:
    keys = [bytes(range(i, i + 32)) for i in range(3)]
    expected = [
        [7, 0, 1, 10, 11, 8, 3, 9, 5, 2, 13, 6],
        [0, 5, 2, 13, 9, 8, 10, 11, 3, 4, 6, 1],
        [8, 13, 2, 4, 0, 11, 9, 3, 10, 7, 1, 6],
    ]
    assert place(keys, range(14), WIDTH).tolist() == expected
    assert place(keys, list(reversed(range(14))), WIDTH).tolist() == expected
    assert meta_shard_of(keys, 4).tolist() == [0, 1, 1]
    # Another interpreter with another hash seed agrees (nothing depends on Python's hash()).
    code = (
        "from kvstore.blockstore.placement import place, meta_shard_of;"
        "keys=[bytes(range(i, i + 32)) for i in range(3)];"
        "print(place(keys, range(14), 12).tolist(), meta_shard_of(keys, 4).tolist())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == f"{expected} [0, 1, 1]"


def test_the_keys_hash_in_c_is_the_numpy_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    words = np.frombuffer(b"".join(_keys(3000)), "<u8").reshape(3000, 4)
    structured = np.arange(4 * 64, dtype=np.uint64).reshape(64, 4)
    cases = [words, words[:1], words[:0], words[:, :3], structured, words[::2]]
    seeds = [placement._META_SALT, placement._PLACEMENT_SEED, np.uint64(2**64 - 1)]
    in_c = [placement._key_hash(case, seed) for case in cases for seed in seeds]
    monkeypatch.setattr(placement, "_native", None)
    reference = [placement._key_hash(case, seed) for case in cases for seed in seeds]
    for got, want in zip(in_c, reference, strict=True):
        assert got.dtype == want.dtype == np.uint64 and np.array_equal(got, want)


def test_a_stripe_never_has_two_shards_in_one_domain() -> None:
    placements = place(_keys(2000), range(15), WIDTH)
    assert placements.shape == (2000, WIDTH)
    assert all(len(set(row)) == WIDTH for row in placements.tolist())
    assert placements.min() >= 0 and placements.max() < 15


def test_placement_is_balanced_across_nodes_and_stripe_positions() -> None:
    nodes = 16
    placements = place(_keys(16_000), range(nodes), WIDTH)
    per_node = np.bincount(placements.ravel(), minlength=nodes)
    expected = 16_000 * WIDTH / nodes
    assert np.all(np.abs(per_node - expected) < 0.05 * expected)
    data_shards = np.bincount(placements[:, :10].ravel(), minlength=nodes)
    assert np.all(np.abs(data_shards - 16_000 * 10 / nodes) < 0.06 * 16_000 * 10 / nodes)


def test_structured_keys_spread_too() -> None:
    keys = [i.to_bytes(32, "big") for i in range(4000)]
    assert len({tuple(row) for row in place(keys, range(14), WIDTH).tolist()}) > 3000
    shards = np.bincount(meta_shard_of(keys, 4), minlength=4)
    assert np.all(np.abs(shards - 1000) < 120)


def test_a_node_leaving_only_moves_the_stripes_that_used_it() -> None:
    keys = _keys(3000)
    before = place(keys, range(16), WIDTH)
    after = place(keys, [n for n in range(16) if n != 5], WIDTH)
    unaffected = ~(before == 5).any(axis=1)
    assert np.array_equal(before[unaffected], after[unaffected])
    assert not (after == 5).any()


def test_too_few_live_nodes_is_an_error_not_a_doubled_domain() -> None:
    with pytest.raises(InvalidArgument, match="nodes"):
        place(_keys(3), range(11), WIDTH)
    with pytest.raises(InvalidArgument, match="nodes"):
        place(_keys(3), [1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], WIDTH)
    with pytest.raises(InvalidArgument, match="keys"):
        place([b"short"], range(12), WIDTH)
    with pytest.raises(InvalidArgument, match="num_shards"):
        meta_shard_of(_keys(1), 0)


def test_replacement_picks_a_node_outside_the_stripe_deterministically() -> None:
    key = _keys(1)[0]
    stripe = place([key], range(14), WIDTH)[0].tolist()
    spare = sorted(set(range(14)) - set(stripe))
    chosen = replacement(key, range(14), stripe)
    assert chosen in spare
    assert replacement(key, list(reversed(range(14))), stripe) == chosen
    assert (
        replacement(key, range(12), stripe) is None
        or replacement(key, range(12), stripe) not in stripe
    )
    assert replacement(key, stripe, stripe) is None
