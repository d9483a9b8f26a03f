"""Engine-side ledgers: paged block ledger, state slot ledger, per-sequence state block layout."""
