"""What the connector's scheduler side hands its worker side each step (plain, picklable data).

An engine with a paged KV cache (vLLM's) keeps, per attention layer, one tensor whose first
dimension is the block id; one block of 128 tokens is one opaque row of bytes of that layer. The
scheduler side (``kvstore.engine.scheduler``) decides which rows to fill from the tier and
which to save; the worker side (``kvstore.engine.worker``) moves the bytes. Block ids are
the engine's, per KV-cache group (``kvstore.engine.groups``): ``block_ids`` name rows of the
full-attention group's layers, ``windows`` (one tuple per sliding-window group) rows of that
group's layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.tier.records import DirectGrant


def describe(error: BaseException) -> str:
    """One line for a failed call (a gRPC error's code and details, not its repr)."""
    code = getattr(error, "code", None)
    details = getattr(error, "details", None)
    if callable(code) and callable(details):
        try:
            return f"{code().name}: {details()}"
        except Exception:  # noqa: BLE001 - fall back to the plain text
            pass
    return f"{type(error).__name__}: {error}"


@dataclass(frozen=True)
class PagedLoad:
    """Fill ``block_ids`` (full-attention rows) with the tier's blocks ``keys`` (same order)
    and, for a hybrid model, each sliding group's ``windows`` rows with the window state kept
    under ``state_key`` at ``state_position``. ``asynchronous``: the engine waits for the whole
    load before it schedules the request (vLLM's hybrid models), instead of layer by layer
    within the step."""

    request_id: str
    block_ids: tuple[int, ...]
    keys: tuple[bytes, ...]
    lease_id: str | None = None
    windows: tuple[tuple[int, ...], ...] = ()
    state_key: bytes | None = None
    state_position: int | None = None
    asynchronous: bool = False
    #: The lease's read grant for ``keys`` (same order): the fetcher reads them straight from
    #: the storage nodes (None: through the tier's ``get_blocks``).
    direct: DirectGrant | None = None


@dataclass(frozen=True)
class StateSave:
    """Save the window state at ``position`` (rows ``windows`` of each sliding group) under
    ``key``. ``hold``: a decode-time state, kept by the worker and stored when the request ends
    (only its last one is: docs/rules.md §6's store at request end)."""

    key: bytes
    position: int
    windows: tuple[tuple[int, ...], ...]
    hold: bool = False


@dataclass(frozen=True)
class PagedSave:
    """Store full-attention rows ``block_ids`` under ``keys`` (same order), and a state."""

    request_id: str
    block_ids: tuple[int, ...]
    keys: tuple[bytes, ...]
    traffic_class: str = ""
    state: StateSave | None = None


@dataclass
class StepPlan:
    """What the scheduler decided since the last step (crosses to the worker pickled)."""

    loads: list[PagedLoad] = field(default_factory=list)
    saves: list[PagedSave] = field(default_factory=list)
    #: Requests that finished with saves still to be gathered: request → saves emitted for it.
    #: The worker reports one as done once it has gathered that many.
    finished: dict[str, int] = field(default_factory=dict)
    #: Every request that ended since the last step: the worker stores its held state.
    ended: list[str] = field(default_factory=list)
