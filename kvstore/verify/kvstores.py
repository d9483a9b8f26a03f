"""Where one layer's SWA keys live: the buffers the truncation modes and the decode ring use.

- ``LinearKV``: every key from ``first_pos`` on, one row per position. ``attend_whole=False``
  hands a query block only the rows its window can reach (a long prefill or a replay);
  ``attend_whole=True`` hands it the whole buffer, as an engine does with truncation ``off`` and
  ``mask``. With ``mask_truncation`` a ``truncate(keep)`` hides every position older than the
  last ``keep`` (the rows stay: memory is not freed).
- ``CompactKV``: truncation ``compact``: ``truncate(keep)`` moves the last ``keep`` rows to the
  front of a buffer of fixed capacity; a row's position is implied by its slot
  (``base + slot``), there is no per-row position table. ``off_by_one=True`` is the deliberately
  broken move the check must catch.
- ``RingKV``: the decode ring of ``window + backtracking`` slots; position ``p`` lives in slot
  ``p % slots``.

Each ``view`` returns keys, values and positions, with -1 for a row the query must not see.
"""

from __future__ import annotations

import torch

from kvstore.errors import InvalidArgument


def _check_start(start: int, expected: int) -> None:
    if start != expected:
        raise InvalidArgument("start", f"next position is {expected}, got {start}")


class LinearKV:
    def __init__(
        self,
        first_pos: int,
        window: int,
        *,
        attend_whole: bool = False,
        mask_truncation: bool = False,
    ) -> None:
        self.first_pos = first_pos
        self.window = window
        self.attend_whole = attend_whole
        self.mask_truncation = mask_truncation
        self.kept_from = first_pos
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.first_pos + (0 if self.keys is None else int(self.keys.shape[0]))

    @property
    def rows(self) -> int:
        """Rows of memory held."""
        return self.end - self.first_pos

    def append(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        _check_start(start, self.end)
        if self.keys is None or self.values is None:
            self.keys, self.values = keys.clone(), values.clone()
        else:
            self.keys = torch.cat([self.keys, keys])
            self.values = torch.cat([self.values, values])

    def view(self, q_lo: int, q_hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None
        if self.attend_whole:
            lo = self.first_pos
        else:
            lo = max(self.first_pos, q_lo - self.window + 1)
        hi = min(q_hi, self.end)  # queries never see keys past the last one appended
        rows = slice(lo - self.first_pos, hi - self.first_pos)
        positions = torch.arange(lo, hi)
        if self.mask_truncation:
            positions = torch.where(positions >= self.kept_from, positions, -1)
        return self.keys[rows], self.values[rows], positions

    def truncate(self, keep: int) -> None:
        if self.mask_truncation:
            self.kept_from = max(self.kept_from, self.end - keep)

    def window_rows(self, stop: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at positions ``[stop-length, stop)``."""
        assert self.keys is not None and self.values is not None
        lo = stop - length - self.first_pos
        if lo < 0 or stop > self.end:
            raise InvalidArgument("stop", f"positions {stop - length}..{stop} not all held")
        return self.keys[lo : lo + length], self.values[lo : lo + length]


class CompactKV:
    def __init__(
        self, capacity: int, head_dim: int, dtype: torch.dtype, *, off_by_one: bool = False
    ):
        self.capacity = capacity
        self.keys = torch.zeros(capacity, head_dim, dtype=dtype)
        self.values = torch.zeros(capacity, head_dim, dtype=dtype)
        self.base = 0  # position of slot 0
        self.count = 0
        self.off_by_one = off_by_one

    @property
    def end(self) -> int:
        return self.base + self.count

    @property
    def rows(self) -> int:
        return self.capacity

    def append(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        _check_start(start, self.end)
        n = keys.shape[0]
        if self.count + n > self.capacity:
            raise InvalidArgument("keys", f"{n} rows overflow compact buffer of {self.capacity}")
        self.keys[self.count : self.count + n] = keys
        self.values[self.count : self.count + n] = values
        self.count += n

    def view(self, q_lo: int, q_hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        positions = self.base + torch.arange(self.count)
        return self.keys[: self.count], self.values[: self.count], positions

    def truncate(self, keep: int) -> None:
        if self.count <= keep:
            return
        src = self.count - keep
        if self.off_by_one:
            src -= 1  # the bug: copies one row too early, so slot i is labelled one too late
        # Source and destination overlap when count < 2*keep: copy through a clone.
        self.keys[:keep] = self.keys[src : src + keep].clone()
        self.values[:keep] = self.values[src : src + keep].clone()
        self.base += self.count - keep
        self.count = keep

    def window_rows(self, stop: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo = stop - length - self.base
        if lo < 0 or stop > self.end:
            raise InvalidArgument("stop", f"positions {stop - length}..{stop} not all held")
        return self.keys[lo : lo + length], self.values[lo : lo + length]


class RingKV:
    """The decode ring. Appends of more than ``slots - window + 1`` rows at once would overwrite
    keys the first of those queries still needs, so they are refused."""

    def __init__(self, slots: int, window: int, head_dim: int, dtype: torch.dtype) -> None:
        if slots < window:
            raise InvalidArgument("slots", f"ring of {slots} cannot hold a {window}-token window")
        self.slots = slots
        self.window = window
        self.keys = torch.zeros(slots, head_dim, dtype=dtype)
        self.values = torch.zeros(slots, head_dim, dtype=dtype)
        self.next_pos = 0
        self.valid_from = 0

    @property
    def rows(self) -> int:
        return self.slots

    @classmethod
    def from_window(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        first_pos: int,
        slots: int,
        window: int,
    ) -> RingKV:
        """A ring holding ``keys``/``values`` for positions ``[first_pos, first_pos+n)``."""
        n = keys.shape[0]
        ring = cls(slots, window, keys.shape[1], keys.dtype)
        take = min(n, slots)
        positions = torch.arange(first_pos + n - take, first_pos + n)
        ring.keys[positions % slots] = keys[n - take :]
        ring.values[positions % slots] = values[n - take :]
        ring.next_pos = first_pos + n
        ring.valid_from = first_pos + n - take
        return ring

    def append(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        _check_start(start, self.next_pos)
        n = keys.shape[0]
        if n > self.slots - self.window + 1:
            raise InvalidArgument("keys", f"{n} rows at once overflow a {self.slots}-slot ring")
        positions = torch.arange(start, start + n)
        self.keys[positions % self.slots] = keys
        self.values[positions % self.slots] = values
        self.next_pos = start + n

    def truncate(self, keep: int) -> None:
        """A ring is bounded by construction: nothing to truncate."""

    def view(self, q_lo: int, q_hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        oldest = self.next_pos - self.slots
        slot = torch.arange(self.slots)
        positions = oldest + (slot - oldest) % self.slots
        positions = torch.where(positions >= max(self.valid_from, 0), positions, -1)
        return self.keys, self.values, positions
