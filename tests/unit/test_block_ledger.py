"""Paged block ledger: exact reuse order, prefix sharing, rollback, misuse."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgument, LedgerError, OutOfBlocks
from kvstore.keys import BLOCK_TOKENS, BlockKey, block_keys
from kvstore.ledger import PagedBlockLedger

FINGERPRINT = b"test-model"


def k(i: int) -> BlockKey:
    return BlockKey(bytes([i]) * 32)


def snapshot(ledger: PagedBlockLedger) -> tuple[object, ...]:
    """Everything observable, to prove a failed call changed nothing."""
    return (
        ledger.free_order(),
        {seq: ledger.block_table(seq) for seq in ledger.sequences()},
        [ledger.refcount(b) for b in range(ledger.num_blocks)],
        [ledger.key_of(b) for b in range(ledger.num_blocks)],
        ledger.num_cached,
    )


def allocate_committed(ledger: PagedBlockLedger, seq: str, keys: list[BlockKey]) -> list[int]:
    blocks = ledger.allocate(seq, len(keys))
    for index, key in enumerate(keys):
        ledger.commit(seq, index, key)
    return blocks


# --- allocation order -------------------------------------------------------------------------


def test_fresh_ledger_hands_out_blocks_in_id_order() -> None:
    ledger = PagedBlockLedger(8)
    assert ledger.num_free == 8
    assert ledger.allocate("a", 3) == [0, 1, 2]
    assert ledger.allocate("b", 2) == [3, 4]
    assert ledger.allocate("a", 1) == [5]
    assert ledger.block_table("a") == [0, 1, 2, 5]
    assert ledger.block_table("b") == [3, 4]
    assert ledger.num_free == 2
    assert [ledger.refcount(b) for b in range(8)] == [1, 1, 1, 1, 1, 1, 0, 0]


def test_allocate_zero_creates_an_empty_table() -> None:
    ledger = PagedBlockLedger(2)
    assert ledger.allocate("a", 0) == []
    assert "a" in ledger
    assert ledger.block_table("a") == []
    ledger.free("a")
    assert "a" not in ledger


def test_uncommitted_blocks_return_to_uncached_tail_in_reverse_table_order() -> None:
    ledger = PagedBlockLedger(6)
    ledger.allocate("a", 3)
    ledger.free("a")
    assert ledger.free_order() == [3, 4, 5, 2, 1, 0]
    assert ledger.allocate("b", 4) == [3, 4, 5, 2]


def test_block_table_is_a_copy() -> None:
    ledger = PagedBlockLedger(4)
    ledger.allocate("a", 2)
    ledger.block_table("a").append(99)
    assert ledger.block_table("a") == [0, 1]


# --- exact LRU eviction -----------------------------------------------------------------------


def test_cached_blocks_are_evicted_tail_first_least_recently_freed_first() -> None:
    ledger = PagedBlockLedger(4)
    allocate_committed(ledger, "a", [k(0), k(1), k(2), k(3)])
    ledger.free("a")
    # Reverse table order: the tail block is least valuable (chained keys), evicted first.
    assert ledger.free_order() == [3, 2, 1, 0]
    assert ledger.num_cached == 4

    assert ledger.allocate("b", 1) == [3]
    assert not ledger.is_cached(k(3))
    assert ledger.key_of(3) is None
    assert ledger.get_computed_blocks([k(0), k(1), k(2), k(3)]) == [0, 1, 2]

    assert ledger.allocate("b", 2) == [2, 1]
    assert ledger.get_computed_blocks([k(0), k(1), k(2)]) == [0]
    assert ledger.num_cached == 1


def test_uncached_free_blocks_are_used_before_any_cached_block_is_evicted() -> None:
    ledger = PagedBlockLedger(6)
    allocate_committed(ledger, "a", [k(0), k(1)])
    ledger.free("a")
    assert ledger.free_order() == [2, 3, 4, 5, 1, 0]

    assert ledger.allocate("b", 4) == [2, 3, 4, 5]
    assert ledger.get_computed_blocks([k(0), k(1)]) == [0, 1]  # nothing evicted yet

    assert ledger.allocate("b", 1) == [1]
    assert ledger.get_computed_blocks([k(0), k(1)]) == [0]


def test_eviction_follows_free_time_across_sequences() -> None:
    ledger = PagedBlockLedger(4)
    allocate_committed(ledger, "a", [k(0), k(1)])
    allocate_committed(ledger, "b", [k(10), k(11)])
    ledger.free("b")
    ledger.free("a")
    assert ledger.free_order() == [3, 2, 1, 0]
    assert ledger.allocate("c", 3) == [3, 2, 1]
    assert [ledger.is_cached(key) for key in (k(0), k(1), k(10), k(11))] == [
        True,
        False,
        False,
        False,
    ]


def test_reusing_a_free_cached_block_refreshes_its_recency() -> None:
    ledger = PagedBlockLedger(3)
    allocate_committed(ledger, "a", [k(0)])
    allocate_committed(ledger, "b", [k(1)])
    allocate_committed(ledger, "c", [k(2)])
    ledger.free("a")
    ledger.free("b")
    ledger.free("c")
    assert ledger.free_order() == [0, 1, 2]

    # Block 0 leaves the middle... here the head of the queue, in O(1), keeping its content.
    assert ledger.append_cached("d", [k(0)]) == [0]
    assert ledger.free_order() == [1, 2]
    assert ledger.refcount(0) == 1
    ledger.free("d")
    assert ledger.free_order() == [1, 2, 0]
    assert ledger.allocate("e", 1) == [1]
    assert ledger.get_computed_blocks([k(0)]) == [0]


def test_touching_a_block_in_the_middle_of_the_free_queue() -> None:
    ledger = PagedBlockLedger(3)
    allocate_committed(ledger, "a", [k(0), k(1), k(2)])
    ledger.free("a")
    assert ledger.free_order() == [2, 1, 0]
    ledger.append_cached("b", [k(1)])
    assert ledger.free_order() == [2, 0]
    assert ledger.num_free == 2


# --- prefix sharing ---------------------------------------------------------------------------


def test_two_sequences_share_a_system_prompt() -> None:
    system = list(range(2 * BLOCK_TOKENS))
    keys_a = block_keys(FINGERPRINT, system + [7] * BLOCK_TOKENS)
    keys_b = block_keys(FINGERPRINT, system + [9] * BLOCK_TOKENS)
    assert keys_a[:2] == keys_b[:2] and keys_a[2] != keys_b[2]

    ledger = PagedBlockLedger(8)
    assert ledger.admit("a", keys_a, 4) == 0  # 3 full blocks + a partial one
    for index, key in enumerate(keys_a):
        ledger.commit("a", index, key)
    assert ledger.block_table("a") == [0, 1, 2, 3]

    assert ledger.get_computed_blocks(keys_b) == [0, 1]
    assert ledger.admit("b", keys_b, 4) == 2
    assert ledger.block_table("b") == [0, 1, 4, 5]
    assert [ledger.refcount(b) for b in range(6)] == [2, 2, 1, 1, 1, 1]
    ledger.commit("b", 2, keys_b[2])

    # Free one: the shared blocks stay in use and cached.
    ledger.free("a")
    assert [ledger.refcount(b) for b in range(6)] == [1, 1, 0, 0, 1, 1]
    assert ledger.free_order() == [6, 7, 3, 2]
    assert ledger.get_computed_blocks(keys_a) == [0, 1, 2]

    # Free both: every block is free. The partial tail blocks (3, 5) hold no key, so they are
    # reused before any cached block; cached ones follow in exact order, tails first.
    ledger.free("b")
    assert ledger.num_free == 8
    assert ledger.free_order() == [6, 7, 3, 5, 2, 4, 1, 0]

    # A third sequence with the same system prompt hits the free cached prefix.
    keys_c = block_keys(FINGERPRINT, system + [11] * BLOCK_TOKENS)
    assert ledger.admit("c", keys_c, 3) == 2
    assert ledger.block_table("c") == [0, 1, 6]
    assert ledger.free_order() == [7, 3, 5, 2, 4]

    # Pressure evicts the least recently freed cached blocks, never the ones in use.
    assert ledger.allocate("d", 4) == [7, 3, 5, 2]
    assert ledger.get_computed_blocks(keys_a) == [0, 1]
    assert ledger.get_computed_blocks(keys_b) == [0, 1, 4]


def test_duplicate_commit_keeps_first_registration_and_drops_the_copy() -> None:
    ledger = PagedBlockLedger(4)
    ledger.allocate("a", 1)
    ledger.allocate("b", 1)
    ledger.commit("a", 0, k(0))
    ledger.commit("b", 0, k(0))  # same prefix computed twice at once
    assert ledger.get_computed_blocks([k(0)]) == [0]
    assert ledger.key_of(1) == k(0)
    ledger.free("b")
    assert ledger.key_of(1) is None
    assert ledger.free_order() == [2, 3, 1]


def test_duplicate_takes_over_a_key_evicted_while_it_was_in_use() -> None:
    ledger = PagedBlockLedger(2)
    ledger.allocate("a", 1)
    ledger.allocate("b", 1)
    ledger.commit("a", 0, k(0))
    ledger.commit("b", 0, k(0))
    ledger.free("a")
    assert ledger.allocate("c", 1) == [0]  # evicts k(0) from block 0
    assert not ledger.is_cached(k(0))
    ledger.free("b")
    assert ledger.get_computed_blocks([k(0)]) == [1]
    assert ledger.free_order() == [1]


def test_committing_again_registers_a_key_whose_block_was_evicted_since() -> None:
    """Found by the ledger's property test: block 1 holds k(0) as a duplicate, k(0)'s block 0
    is evicted and reused, then the engine commits k(0) on block 1 again; block 1 must now serve
    k(0) (it used to be a no-op, leaving held content no lookup could find)."""
    ledger = PagedBlockLedger(3)
    ledger.allocate("a", 1)
    ledger.allocate("b", 1)
    ledger.commit("a", 0, k(0))
    ledger.commit("b", 0, k(0))  # a duplicate: block 0 keeps the registration
    ledger.free("a")
    assert ledger.allocate("c", 2) == [2, 0]  # evicts k(0) from block 0
    assert not ledger.is_cached(k(0))
    ledger.commit("b", 0, k(0))
    assert ledger.get_computed_blocks([k(0)]) == [1]
    ledger.commit("b", 0, k(0))  # and again: nothing changes
    assert ledger.get_computed_blocks([k(0)]) == [1]


# --- rollback -------------------------------------------------------------------------------


def test_out_of_blocks_changes_nothing_and_names_the_numbers() -> None:
    ledger = PagedBlockLedger(4)
    allocate_committed(ledger, "a", [k(0), k(1)])
    ledger.free("a")
    ledger.allocate("b", 1)
    before = snapshot(ledger)
    with pytest.raises(OutOfBlocks, match=r"asked for 4 blocks but only 3 are free of 4"):
        ledger.allocate("b", 4)
    with pytest.raises(OutOfBlocks):
        ledger.allocate("new", 4)
    assert snapshot(ledger) == before
    assert "new" not in ledger
    assert isinstance(OutOfBlocks("x"), LedgerError)


def test_admit_does_not_count_reused_free_cached_blocks_as_free() -> None:
    ledger = PagedBlockLedger(4)
    allocate_committed(ledger, "a", [k(0), k(1), k(2), k(3)])
    ledger.free("a")
    assert ledger.num_free == 4
    before = snapshot(ledger)
    # 2 hits are taken from the free queue, so only 2 blocks remain for 3 new ones.
    with pytest.raises(OutOfBlocks, match=r"asked for 3 new blocks .* only 2 are free of 4"):
        ledger.admit("b", [k(0), k(1)], 5)
    assert snapshot(ledger) == before
    assert "b" not in ledger

    assert ledger.admit("b", [k(0), k(1)], 4) == 2
    assert ledger.block_table("b") == [0, 1, 3, 2]
    assert ledger.num_free == 0
    assert ledger.get_computed_blocks([k(0), k(1), k(2)]) == [0, 1]


def test_append_cached_with_a_miss_changes_nothing() -> None:
    ledger = PagedBlockLedger(4)
    allocate_committed(ledger, "a", [k(0)])
    ledger.free("a")
    before = snapshot(ledger)
    with pytest.raises(LedgerError, match=r"keys\[1\] .* is not cached"):
        ledger.append_cached("b", [k(0), k(5)])
    assert snapshot(ledger) == before
    assert "b" not in ledger


# --- misuse -----------------------------------------------------------------------------------


def test_double_free_and_unknown_sequences_raise() -> None:
    ledger = PagedBlockLedger(2)
    ledger.allocate("a", 1)
    ledger.free("a")
    with pytest.raises(LedgerError, match="unknown sequence 'a'"):
        ledger.free("a")
    with pytest.raises(LedgerError, match="unknown sequence 'zz'"):
        ledger.block_table("zz")
    with pytest.raises(LedgerError):
        ledger.commit("zz", 0, k(0))
    assert ledger.num_free == 2


def test_commit_rules() -> None:
    ledger = PagedBlockLedger(4)
    ledger.allocate("a", 2)
    ledger.commit("a", 0, k(0))
    ledger.commit("a", 0, k(0))  # idempotent
    assert ledger.num_cached == 1
    with pytest.raises(LedgerError, match="already holds key"):
        ledger.commit("a", 0, k(1))
    with pytest.raises(LedgerError, match="block_index 2 outside"):
        ledger.commit("a", 2, k(1))
    with pytest.raises(LedgerError, match="block_index -1 outside"):
        ledger.commit("a", -1, k(1))
    with pytest.raises(InvalidArgument, match="key: must be 32 bytes"):
        ledger.commit("a", 1, b"short")
    assert ledger.key_of(1) is None and ledger.key_of(0) == k(0)


def test_admit_rejects_an_existing_sequence_and_too_many_keys() -> None:
    ledger = PagedBlockLedger(4)
    ledger.allocate("a", 1)
    with pytest.raises(LedgerError, match="already has a block table"):
        ledger.admit("a", [], 1)
    with pytest.raises(InvalidArgument, match="keys: 2 keys for a table of 1 blocks"):
        ledger.admit("b", [k(0), k(1)], 1)
    assert ledger.num_free == 3


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "3"])
def test_bad_sizes_raise_invalid_argument(bad: object) -> None:
    with pytest.raises(InvalidArgument, match="num_blocks"):
        PagedBlockLedger(bad)  # type: ignore[arg-type]
    ledger = PagedBlockLedger(2)
    if bad != 0:
        with pytest.raises(InvalidArgument, match="n: "):
            ledger.allocate("a", bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="block_id"):
        ledger.refcount(2)


def test_lookups_validate_keys() -> None:
    ledger = PagedBlockLedger(2)
    allocate_committed(ledger, "a", [k(0)])
    with pytest.raises(InvalidArgument, match=r"keys\[1\]: must be 32 bytes, got 31"):
        ledger.get_computed_blocks([k(0), b"x" * 31])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match="key: must be 32 bytes"):
        ledger.is_cached(b"")  # type: ignore[arg-type]
