"""State slot ledger: exact LIFO reuse order, exhaustion, misuse."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgument, LedgerError, OutOfSlots
from kvstore.ledger import StateSlotLedger


def test_slots_are_handed_out_lowest_first_then_most_recently_freed_first() -> None:
    ledger = StateSlotLedger(4)
    assert [ledger.allocate(seq) for seq in "abc"] == [0, 1, 2]
    assert ledger.free("a") == 0
    assert ledger.free("c") == 2
    assert ledger.num_free == 3
    assert ledger.allocate("d") == 2
    assert ledger.allocate("e") == 0
    assert ledger.allocate("f") == 3
    assert {seq: ledger.slot_of(seq) for seq in "bdef"} == {"b": 1, "d": 2, "e": 0, "f": 3}
    assert len(ledger) == 4 and ledger.num_free == 0


def test_exhaustion_raises_out_of_slots_and_changes_nothing() -> None:
    ledger = StateSlotLedger(2)
    ledger.allocate("a")
    ledger.allocate("b")
    with pytest.raises(OutOfSlots, match="asked for 1 state slot but 0 are free of 2"):
        ledger.allocate("c")
    assert "c" not in ledger
    assert ledger.num_free == 0
    ledger.free("b")
    assert ledger.allocate("c") == 1
    assert isinstance(OutOfSlots("x"), LedgerError)


def test_double_allocate_and_double_free_raise() -> None:
    ledger = StateSlotLedger(3)
    ledger.allocate("a")
    with pytest.raises(LedgerError, match="'a' already holds state slot 0"):
        ledger.allocate("a")
    assert ledger.num_free == 2
    ledger.free("a")
    with pytest.raises(LedgerError, match="'a' holds no state slot"):
        ledger.free("a")
    with pytest.raises(LedgerError, match="'a' holds no state slot"):
        ledger.slot_of("a")
    assert ledger.num_free == 3
    assert "a" not in ledger


def test_sequence_ids_may_be_any_hashable() -> None:
    ledger = StateSlotLedger(2)
    assert ledger.allocate(7) == 0
    assert ledger.allocate(("req", 7)) == 1
    assert ledger.slot_of(7) == 0
    assert ledger.slot_of(("req", 7)) == 1


@pytest.mark.parametrize("bad", [0, -3, False, 1.5, "2"])
def test_bad_slot_counts_raise_invalid_argument(bad: object) -> None:
    with pytest.raises(InvalidArgument, match="num_slots"):
        StateSlotLedger(bad)  # type: ignore[arg-type]
