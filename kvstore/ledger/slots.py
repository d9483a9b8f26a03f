"""State slot ledger: the engine's second ledger (sequence state, docs/rules.md §2).

Sequence state (SWA window ring, uncompressed tail, fp32 compression accumulators) is bounded, so
each sequence gets exactly one fixed-size slot for its whole life: no block table, no refcount, no
sharing, no eviction. The slot is freed whole when the sequence ends.

Free-slot policy (exact; the tests pin it): a LIFO free list. At start slot 0 is handed out first,
then 1, 2, ...; a freed slot is the next one handed out (its memory is the most recently touched,
and the policy is trivially O(1)).
"""

from __future__ import annotations

from collections.abc import Hashable

from kvstore.errors import InvalidArgument, LedgerError, OutOfSlots


class StateSlotLedger:
    """One slot per live sequence over ``num_slots`` slots, O(1) allocate and free."""

    __slots__ = ("_num_slots", "_free", "_slot_of")

    def __init__(self, num_slots: int) -> None:
        """Create a ledger with every slot free.

        Raises:
            InvalidArgument: ``num_slots`` is not an int >= 1.
        """
        if not isinstance(num_slots, int) or isinstance(num_slots, bool):
            raise InvalidArgument("num_slots", f"must be an int, got {type(num_slots).__name__}")
        if num_slots < 1:
            raise InvalidArgument("num_slots", f"must be >= 1, got {num_slots}")
        self._num_slots = num_slots
        # Stack: the end of the list is handed out next, so slot 0 goes first.
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[Hashable, int] = {}

    @property
    def num_slots(self) -> int:
        """Total number of slots."""
        return self._num_slots

    @property
    def num_free(self) -> int:
        """Slots not held by any sequence."""
        return len(self._free)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._slot_of

    def __len__(self) -> int:
        """Number of sequences holding a slot."""
        return len(self._slot_of)

    def slot_of(self, seq_id: Hashable) -> int:
        """The slot held by ``seq_id``.

        Raises:
            LedgerError: the sequence holds no slot.
        """
        try:
            return self._slot_of[seq_id]
        except KeyError:
            raise LedgerError(f"sequence {seq_id!r} holds no state slot") from None

    def allocate(self, seq_id: Hashable) -> int:
        """Give ``seq_id`` a slot (the most recently freed one, else the lowest never used).

        Raises:
            LedgerError: the sequence already holds a slot; nothing changed.
            OutOfSlots: every slot is held; nothing changed.
        """
        if seq_id in self._slot_of:
            raise LedgerError(
                f"sequence {seq_id!r} already holds state slot {self._slot_of[seq_id]}"
            )
        if not self._free:
            raise OutOfSlots(
                f"sequence {seq_id!r} asked for 1 state slot but 0 are free of {self._num_slots}"
            )
        slot = self._free.pop()
        self._slot_of[seq_id] = slot
        return slot

    def free(self, seq_id: Hashable) -> int:
        """Release the slot held by ``seq_id``; returns that slot.

        Raises:
            LedgerError: the sequence holds no slot (never allocated, or already freed).
        """
        try:
            slot = self._slot_of.pop(seq_id)
        except KeyError:
            raise LedgerError(
                f"sequence {seq_id!r} holds no state slot (never allocated, or already freed)"
            ) from None
        self._free.append(slot)
        return slot
