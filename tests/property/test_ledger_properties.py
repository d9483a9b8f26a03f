"""Stateful property tests: both ledgers against naive reference models.

The references use plain lists and linear scans (obviously correct, slow); the real ledgers use
O(1) queues. After every step the two must agree exactly (tables, free order, cached keys), and
the structural invariants must hold on the real ledger on its own.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstore.errors import LedgerError, OutOfBlocks, OutOfSlots
from kvstore.keys import BlockKey
from kvstore.ledger import PagedBlockLedger, StateSlotLedger

NUM_BLOCKS = 6
NUM_SLOTS = 4
KEYS = [BlockKey(bytes([i + 1]) * 32) for i in range(10)]
# Two prompts sharing a two-block system prompt, as chained keys would be.
FAMILIES = [KEYS[0:6], KEYS[0:2] + KEYS[6:10]]
SEQS = st.sampled_from(["s0", "s1", "s2", "s3"])
FAMILY = st.integers(0, len(FAMILIES) - 1)
KEY_INDEX = st.integers(0, len(KEYS) - 1)
SETTINGS = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class ReferenceBlocks:
    """The documented policy, written as plainly as possible."""

    def __init__(self, num_blocks: int) -> None:
        self.tables: dict[str, list[int]] = {}
        self.key: dict[int, BlockKey] = {}  # key recorded on a block
        self.owner: dict[BlockKey, int] = {}  # registered key -> block
        self.uncached: list[int] = list(range(num_blocks))
        self.cached: list[int] = []

    def refs(self, block: int) -> int:
        return sum(table.count(block) for table in self.tables.values())

    def free_order(self) -> list[int]:
        return self.uncached + self.cached

    def computed(self, keys: list[BlockKey]) -> list[int]:
        out = []
        for key in keys:
            if key not in self.owner:
                break
            out.append(self.owner[key])
        return out

    def take(self) -> int:
        if self.uncached:
            return self.uncached.pop(0)
        block = self.cached.pop(0)
        del self.owner[self.key.pop(block)]
        return block

    def touch(self, block: int) -> None:
        if block in self.cached:
            self.cached.remove(block)

    def release(self, block: int) -> None:
        key = self.key.get(block)
        if key is not None and self.owner.setdefault(key, block) == block:
            self.cached.append(block)
        else:
            self.key.pop(block, None)
            self.uncached.append(block)


class BlockLedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ledger = PagedBlockLedger(NUM_BLOCKS)
        self.ref = ReferenceBlocks(NUM_BLOCKS)

    @rule(seq=SEQS, n=st.integers(0, 4))
    def allocate(self, seq: str, n: int) -> None:
        if n > len(self.ref.free_order()):
            with pytest.raises(OutOfBlocks):
                self.ledger.allocate(seq, n)
            return
        got = self.ledger.allocate(seq, n)
        expected = [self.ref.take() for _ in range(n)]
        self.ref.tables.setdefault(seq, []).extend(expected)
        assert got == expected

    @rule(seq=SEQS, picks=st.lists(KEY_INDEX, max_size=3))
    def append_cached(self, seq: str, picks: list[int]) -> None:
        keys = [KEYS[i] for i in picks]
        if any(key not in self.ref.owner for key in keys):
            with pytest.raises(LedgerError):
                self.ledger.append_cached(seq, keys)
            return
        got = self.ledger.append_cached(seq, keys)
        expected = [self.ref.owner[key] for key in keys]
        for block in expected:
            self.ref.touch(block)
        self.ref.tables.setdefault(seq, []).extend(expected)
        assert got == expected

    @rule(seq=SEQS, family=FAMILY, length=st.integers(0, 6), extra=st.integers(0, 2))
    def admit(self, seq: str, family: int, length: int, extra: int) -> None:
        keys = FAMILIES[family][:length]
        num_blocks = len(keys) + extra
        if seq in self.ref.tables:
            with pytest.raises(LedgerError):
                self.ledger.admit(seq, keys, num_blocks)
            return
        hits = self.ref.computed(keys)
        free_after_touch = [b for b in self.ref.free_order() if b not in hits]
        if num_blocks - len(hits) > len(free_after_touch):
            with pytest.raises(OutOfBlocks):
                self.ledger.admit(seq, keys, num_blocks)
            return
        assert self.ledger.admit(seq, keys, num_blocks) == len(hits)
        for block in hits:
            self.ref.touch(block)
        self.ref.tables[seq] = hits + [self.ref.take() for _ in range(num_blocks - len(hits))]

    @rule(seq=SEQS, index=st.integers(-1, 6), key_index=KEY_INDEX)
    def commit(self, seq: str, index: int, key_index: int) -> None:
        key = KEYS[key_index]
        table = self.ref.tables.get(seq)
        if table is None or not 0 <= index < len(table):
            with pytest.raises(LedgerError):
                self.ledger.commit(seq, index, key)
            return
        block = table[index]
        if self.ref.key.get(block, key) != key:
            with pytest.raises(LedgerError):
                self.ledger.commit(seq, index, key)
            return
        self.ledger.commit(seq, index, key)
        self.ref.key[block] = key
        self.ref.owner.setdefault(key, block)

    @rule(seq=SEQS, family=FAMILY)
    def commit_next(self, seq: str, family: int) -> None:
        """Commit the sequence's first keyless block under its prompt's key, as an engine would."""
        table = self.ref.tables.get(seq, [])
        index = next((i for i, b in enumerate(table) if b not in self.ref.key), None)
        if index is None or index >= len(FAMILIES[family]):
            return
        key = FAMILIES[family][index]
        self.ledger.commit(seq, index, key)
        self.ref.key[table[index]] = key
        self.ref.owner.setdefault(key, table[index])

    @rule(seq=SEQS)
    def free(self, seq: str) -> None:
        if seq not in self.ref.tables:
            with pytest.raises(LedgerError):
                self.ledger.free(seq)
            return
        self.ledger.free(seq)
        table = self.ref.tables.pop(seq)
        # A block reaches zero at its first position (walking in reverse) with no references
        # left: none earlier in this table, none in any other table.
        remaining = Counter(table)
        for block in reversed(table):
            remaining[block] -= 1
            if remaining[block] == 0 and self.ref.refs(block) == 0:
                self.ref.release(block)

    @rule(picks=st.lists(KEY_INDEX, max_size=4))
    def lookup(self, picks: list[int]) -> None:
        keys = [KEYS[i] for i in picks]
        assert self.ledger.get_computed_blocks(keys) == self.ref.computed(keys)

    # --- invariants, checked after every step ---------------------------------------------

    @invariant()
    def matches_reference(self) -> None:
        assert self.ledger.free_order() == self.ref.free_order()
        assert {s: self.ledger.block_table(s) for s in self.ledger.sequences()} == self.ref.tables
        assert [self.ledger.is_cached(key) for key in KEYS] == [k in self.ref.owner for k in KEYS]
        assert self.ledger.num_cached == len(self.ref.owner)

    @invariant()
    def refcounts_equal_table_references(self) -> None:
        references = Counter(b for s in self.ledger.sequences() for b in self.ledger.block_table(s))
        for block in range(NUM_BLOCKS):
            assert self.ledger.refcount(block) == references[block]

    @invariant()
    def blocks_conserved_and_never_both_free_and_used(self) -> None:
        free = self.ledger.free_order()
        in_use = {b for b in range(NUM_BLOCKS) if self.ledger.refcount(b) > 0}
        assert len(free) == len(set(free)) == self.ledger.num_free
        assert not set(free) & in_use
        assert set(free) | in_use == set(range(NUM_BLOCKS))

    @invariant()
    def cached_free_blocks_hold_their_registered_key(self) -> None:
        for block in self.ledger.free_order():
            key = self.ledger.key_of(block)
            if key is not None:
                assert self.ledger.get_computed_blocks([key]) == [block]


class SlotLedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ledger = StateSlotLedger(NUM_SLOTS)
        self.held: dict[str, int] = {}
        self.free_stack = list(range(NUM_SLOTS - 1, -1, -1))

    @rule(seq=st.sampled_from([f"q{i}" for i in range(6)]))
    def allocate(self, seq: str) -> None:
        if seq in self.held:
            with pytest.raises(LedgerError):
                self.ledger.allocate(seq)
        elif not self.free_stack:
            with pytest.raises(OutOfSlots):
                self.ledger.allocate(seq)
        else:
            self.held[seq] = self.free_stack.pop()
            assert self.ledger.allocate(seq) == self.held[seq]

    @rule(seq=st.sampled_from([f"q{i}" for i in range(6)]))
    def free(self, seq: str) -> None:
        if seq not in self.held:
            with pytest.raises(LedgerError):
                self.ledger.free(seq)
            with pytest.raises(LedgerError):
                self.ledger.slot_of(seq)
            return
        slot = self.held.pop(seq)
        self.free_stack.append(slot)
        assert self.ledger.free(seq) == slot

    @invariant()
    def bijection_between_live_sequences_and_held_slots(self) -> None:
        slots = [self.ledger.slot_of(seq) for seq in self.held]
        assert slots == list(self.held.values())
        assert len(set(slots)) == len(slots) == len(self.ledger)
        assert self.ledger.num_free == NUM_SLOTS - len(slots)
        assert all(0 <= slot < NUM_SLOTS for slot in slots)


TestBlockLedger = BlockLedgerMachine.TestCase
TestBlockLedger.settings = SETTINGS
TestSlotLedger = SlotLedgerMachine.TestCase
TestSlotLedger.settings = SETTINGS
