"""Figures for a person to read: bytes, rates and durations, ``n/a`` for a figure that is
missing (never a guess). Shared by the sub-commands and the reports of replays and simulations."""

from __future__ import annotations

NA = "n/a"


def size(value: float | None) -> str:
    """Bytes for a person: ``1.23 GB``, ``456.0 MB``, ``12.0 kB`` (decimal units)."""
    if value is None:
        return NA
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.{2 if unit in ('TB', 'GB') else 1}f} {unit}"
    return f"{value:.0f} B"


def rate(value: float | None) -> str:
    return NA if value is None else f"{size(value)}/s"


def duration(seconds: float | None) -> str:
    """``42 s``, ``3m05s``, ``2h07m``; n/a for none."""
    if seconds is None or seconds < 0:
        return NA
    whole = int(round(seconds))
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
