"""BlockIndex against a plain dict reference model (Hypothesis stateful testing)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.blockstore.index import BlockIndex
from kvstore.keys import key_words

W = 4
T0 = 1_000_000.0
# A small key space so upserts hit existing keys and removals hit live ones. Keys differ only
# in their last word for some, so hashing must not rely on the first bytes alone.
KEY_SPACE = [i.to_bytes(32, "big") for i in range(40)] + [bytes([i]) * 32 for i in range(1, 20)]
keys_st = st.lists(st.sampled_from(KEY_SPACE), min_size=0, max_size=12)


@dataclass
class Model:
    placement: list[int]
    size: int
    cls: int
    created: float
    last: float
    lease_count: int = 0
    lease_until: float = 0.0
    extra: dict[str, int] = field(default_factory=dict)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = BlockIndex(stripe_width=W, initial_capacity=1)
        self.model: dict[bytes, Model] = {}
        self.now = T0
        self.rows_seen: dict[bytes, int] = {}
        self.freed_rows: set[int] = set()

    @rule(seconds=st.integers(0, 50))
    def advance(self, seconds: int) -> None:
        self.now += seconds

    @rule(keys=keys_st, data=st.data())
    def upsert(self, keys: list[bytes], data: st.DataObject) -> None:
        n = len(keys)
        placement = np.array(
            data.draw(
                st.lists(
                    st.lists(st.integers(-1, 30), min_size=W, max_size=W), min_size=n, max_size=n
                )
            ),
            dtype=np.int32,
        ).reshape(n, W)
        sizes = np.array(
            data.draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n)), dtype=np.int64
        )
        classes = np.array(
            data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)), dtype=np.int64
        )
        before_free = set(self.freed_rows)
        rows = self.index.upsert(keys, placement, sizes, classes, self.now)
        for i, key in enumerate(keys):
            if key in self.model:
                entry = self.model[key]
                entry.placement = placement[i].tolist()
                entry.size = int(sizes[i])
                entry.cls = int(classes[i])
                entry.last = max(entry.last, self.now)
            else:
                self.model[key] = Model(
                    placement[i].tolist(), int(sizes[i]), int(classes[i]), self.now, self.now
                )
        new_rows = {int(r) for k, r in zip(keys, rows, strict=True) if k not in self.rows_seen}
        for key, row in zip(keys, rows, strict=True):
            self.rows_seen[key] = int(row)
        # Freed rows are reused before the index grows.
        assert len(new_rows & before_free) == min(len(new_rows), len(before_free))
        self.freed_rows -= new_rows

    @rule(keys=keys_st)
    def remove(self, keys: list[bytes]) -> None:
        removed = self.index.remove(keys)
        expected = {k for k in keys if k in self.model}
        assert set(removed.keys) == expected
        assert len(removed) == len(expected)
        for key in expected:
            del self.model[key]
            self.freed_rows.add(self.rows_seen.pop(key))

    @rule(keys=keys_st)
    def touch(self, keys: list[bytes]) -> None:
        present = [k for k in keys if k in self.model]
        self.index.touch(self.index.find(present), self.now)
        for key in present:
            self.model[key].last = max(self.model[key].last, self.now)

    @rule(keys=keys_st, duration=st.integers(1, 100))
    def acquire(self, keys: list[bytes], duration: int) -> None:
        present = [k for k in keys if k in self.model]
        self.index.acquire_lease(self.index.find(present), self.now + duration)
        for key in present:
            entry = self.model[key]
            entry.lease_count += 1
            entry.lease_until = max(entry.lease_until, self.now + duration)

    @rule(keys=keys_st)
    def release(self, keys: list[bytes]) -> None:
        present = [k for k in keys if k in self.model]
        self.index.release_lease(self.index.find(present))
        for key in present:
            entry = self.model[key]
            entry.lease_count = max(0, entry.lease_count - 1)
            if entry.lease_count == 0:
                entry.lease_until = 0.0

    @precondition(lambda self: len(self.model) > 0)
    @rule(fraction=st.floats(0.0, 1.0))
    def lru(self, fraction: float) -> None:
        leased = {k for k, e in self.model.items() if e.lease_count and e.lease_until > self.now}
        candidates = sorted(
            (k for k in self.model if k not in leased),
            key=lambda k: (self.model[k].last, self.rows_seen[k]),
        )
        total = sum(self.model[k].size for k in candidates)
        needed = int(total * fraction)
        got = self.index.get(self.index.lru_rows(self.now, needed)).keys if needed else []
        expected: list[bytes] = []
        running = 0
        for key in candidates:
            if running >= needed:
                break
            expected.append(key)
            running += self.model[key].size
        assert got == expected

    @rule(ttl=st.lists(st.integers(0, 200), min_size=3, max_size=3))
    def expired(self, ttl: list[int]) -> None:
        rows = self.index.expired_rows(self.now, np.array(ttl, dtype=np.float64))
        got = set(self.index.get(rows).keys)
        expected = {
            k
            for k, e in self.model.items()
            if self.now - e.last > ttl[e.cls] and not (e.lease_count and e.lease_until > self.now)
        }
        assert got == expected

    @invariant()
    def agrees_with_model(self) -> None:
        assert len(self.index) == len(self.model)
        keys = list(self.model)
        rows = self.index.find(keys)
        assert (rows >= 0).all()
        assert len(set(rows.tolist())) == len(rows)
        absent = [k for k in KEY_SPACE if k not in self.model]
        assert (self.index.find(absent) == -1).all()
        if not keys:
            return
        records = self.index.get(rows)
        assert records.keys == keys
        for i, key in enumerate(keys):
            entry = self.model[key]
            assert records.placements[i].tolist() == entry.placement
            assert records.sizes[i] == entry.size
            assert records.classes[i] == entry.cls
            assert records.created[i] == entry.created
            assert records.last_access[i] == entry.last
            assert records.lease_count[i] == entry.lease_count
            assert records.lease_until[i] == entry.lease_until
        leased = self.index.is_leased(rows, self.now).tolist()
        assert leased == [
            bool(self.model[k].lease_count and self.model[k].lease_until > self.now) for k in keys
        ]
        assert self.index.total_bytes() == sum(e.size for e in self.model.values())
        # Rows never exceed the most blocks ever live at once (freed rows are reused).
        assert self.index._high <= len(KEY_SPACE)

    @invariant()
    def the_c_probe_agrees_with_the_numpy_reference(self) -> None:
        words = key_words(KEY_SPACE)  # live, removed (tombstones) and never-written keys
        assert np.array_equal(self.index.find(words), self.index._probe(words, insert=False)[0])


TestBlockIndexMachine = IndexMachine.TestCase
TestBlockIndexMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_the_c_probe_is_built_and_follows_long_chains_through_tombstones() -> None:
    """The extension must be there (an install that silently fell back to numpy would pass
    every other test, slower), and agree with the reference where chains are long: keys whose
    words XOR to one value all share a home slot."""
    from kvstore.blockstore import index as index_module

    assert index_module._native is not None, "kvstore.blockstore._probe was not built"
    rng = np.random.default_rng(3)
    words = rng.integers(0, 2**63, size=(600, 4), dtype=np.uint64)
    words[:300, 3] = words[:300, 0] ^ words[:300, 1] ^ words[:300, 2]  # XOR of all four = 0
    index = BlockIndex(stripe_width=W)
    keys = [row.tobytes() for row in words]
    placement = np.zeros((600, W), dtype=np.int32)
    index.upsert(keys, placement, np.ones(600, np.int64), np.zeros(600, np.uint8), T0)
    index.remove(keys[::3])  # tombstones in the middle of the shared chain
    absent = rng.integers(0, 2**63, size=(100, 4), dtype=np.uint64)
    absent[:50, 3] = absent[:50, 0] ^ absent[:50, 1] ^ absent[:50, 2]
    probe = np.concatenate([words, absent])
    rows = index.find(probe)
    assert np.array_equal(rows, index._probe(probe, insert=False)[0])
    assert (rows[:600][::3] == -1).all() and (rows[600:] == -1).all()
    assert (np.delete(rows[:600], np.arange(0, 600, 3)) >= 0).all()


def test_the_c_insert_agrees_with_the_numpy_reference_on_shared_chains_and_repeats() -> None:
    """Upserts through ``claim_slots`` and through the numpy ``_probe`` leave the same blocks:
    keys sharing one home slot (long chains), tombstones in them, keys repeated within a call
    (the last occurrence's values win, one row each) and keys already there."""
    from kvstore.blockstore import index as index_module

    assert index_module._native is not None, "kvstore.blockstore._probe was not built"
    rng = np.random.default_rng(5)
    words = rng.integers(0, 2**63, size=(400, 4), dtype=np.uint64)
    words[:200, 3] = words[:200, 0] ^ words[:200, 1] ^ words[:200, 2]  # one shared home slot
    keys = [row.tobytes() for row in words]
    batches = [rng.choice(400, size=int(rng.integers(1, 60)), replace=True) for _ in range(40)]

    def build(native: object) -> BlockIndex:
        saved, index_module._native = index_module._native, native
        try:
            index = BlockIndex(stripe_width=W, initial_capacity=1)
            for step, chosen in enumerate(batches):
                batch = [keys[i] for i in chosen.tolist()]
                placement = np.tile(chosen[:, None] % 31, (1, W)).astype(np.int32) + step % 2
                index.upsert(batch, placement, chosen * 10 + step, chosen % 7, T0 + step)
                if step % 5 == 4:
                    index.remove(batch[::4])  # tombstones along the chains
            return index
        finally:
            index_module._native = saved

    native, reference = build(index_module._native), build(None)
    assert len(native) == len(reference) and native._live == reference._live
    found = native.find(keys)
    assert np.array_equal(found >= 0, reference.find(keys) >= 0)
    assert np.array_equal(found, native._probe(words, insert=False)[0])
    live = [key for key, row in zip(keys, found.tolist(), strict=True) if row >= 0]
    assert len(set(found[found >= 0].tolist())) == len(live)  # one row per key
    ours, theirs = native.get(native.find(live)), reference.get(reference.find(live))
    assert ours.keys == theirs.keys == live
    assert np.array_equal(ours.placements, theirs.placements)
    assert np.array_equal(ours.sizes, theirs.sizes)
    assert np.array_equal(ours.classes, theirs.classes)
    assert np.array_equal(ours.created, theirs.created)
    assert not (native._table <= -3).any()  # every claimed slot got its row
