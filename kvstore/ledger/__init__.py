"""Engine-side ledgers: paged block ledger, state slot ledger, per-sequence state block layout."""

from kvstore.ledger.blocks import PagedBlockLedger
from kvstore.ledger.slots import StateSlotLedger

__all__ = ["PagedBlockLedger", "StateSlotLedger"]
