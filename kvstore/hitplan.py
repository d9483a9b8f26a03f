"""How much of a prompt is reused from cache, and where sequence state is stored
(docs/rules.md §5, §6).

A prompt's reuse depends on two ledgers together (docs/rules.md §2): the block store says how many
whole 128-token blocks of compressed KV are cached; the SWA store says whether the sliding-window
state at the end of that run exists. The rule (docs/rules.md §5, from DeepInfer's V4.1 deployment
Q&A):

1. cap = L − (window + max_backtracking) = L − 134: the last 134 tokens are always computed,
   because YoCo truncation keeps window + speculative rollback positions live.
2. L1 = the leading run of consecutive cached blocks, truncated to whole blocks within the cap.
3. SWA is looked for ONLY at position L1 (the snapshot covering [L1 − 128, L1]).
4. Found → hit = L1 (fetch the state, resume exactly there). Missing → hit = L1 − 128: give up
   reusing the last block and recompute it; those 128 tokens rebuild the window. The compressed
   entries of that block were right, but its attention cannot be computed without the window.

Bounded-replay mode (V4.1) keeps hit = L1 whatever the SWA store says; a missing state is rebuilt
by replaying [L1 − 128, L1) with attention bounded to the replay start. Replay rebuilds SWA state
only and never recomputes or overwrites block KV.

Full-attention mode is for engines whose attention has no sliding window and no speculative
rollback to protect (a dense model served by vLLM through ``kvstore.engine.vllm``): the
cap is L − 1 (the engine computes at least the last prompt token, whose logits it samples
from), no SWA state is looked for, and hit = L1.

Exact-window mode is for engines that compute exact attention over a sliding window (a hybrid
model served by vLLM): the cap is L − 1 as in full-attention mode, and a hit must be one the
engine can finish exactly, so it is the longest prefix within the block run whose window state
exists — L1 when the state at L1 is there, else the highest position below L1 that has one —
or a miss; never a hit that would need a window nobody stored (no replay, no approximation).

Hits are whole blocks, never the middle of one, so SWA states are only ever stored at positions
p > 0 with p % 128 == 0 (docs/rules.md §6): prefill stores at floor((L − 1)/128)·128, chunked
prefill only after its last chunk, decode from the last boundary-crossing copy anchored at the
boundary below.

Everything here is a pure function of its arguments. The three numbers (window, max_backtracking,
block_tokens) are keyword arguments, or read from any object that has them as attributes (such as
``kvstore.geometry.GeometryConfig``): never an environment variable or a cached global, because a
stale backtracking value is exactly the out-of-bounds bug the article warns about.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol, SupportsIndex

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.keys import BLOCK_TOKENS

DEFAULT_WINDOW = 128
DEFAULT_MAX_BACKTRACKING = 6
DEFAULT_BLOCK_TOKENS = BLOCK_TOKENS  # one source: the block key's span (kvstore.keys)

STANDARD = "standard"
BOUNDED_REPLAY = "bounded-replay"
FULL_ATTENTION = "full-attention"
EXACT_WINDOW = "exact-window"
MODES = (STANDARD, BOUNDED_REPLAY, FULL_ATTENTION, EXACT_WINDOW)
Mode = Literal["standard", "bounded-replay", "full-attention", "exact-window"]

#: What the caller knows about SWA states: positions (a set, a range, ...), a mapping
#: position -> machine holding it, a callable position -> bool | machine name, or None (none).
SwaAvailability = Container[int] | Mapping[int, str] | Callable[[int], bool | str | None] | None


class HasHitGeometry(Protocol):
    """Anything with the three numbers the rule needs (e.g. ``geometry.GeometryConfig``)."""

    @property
    def window(self) -> int: ...

    @property
    def max_backtracking(self) -> int: ...

    @property
    def block_tokens(self) -> int: ...


@dataclass(frozen=True)
class HitGeometry:
    """The three numbers of the hit rule, validated."""

    window: int = DEFAULT_WINDOW
    max_backtracking: int = DEFAULT_MAX_BACKTRACKING
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    def __post_init__(self) -> None:
        _positive_int(self.window, "window")
        _non_negative_int(self.max_backtracking, "max_backtracking")
        _positive_int(self.block_tokens, "block_tokens")

    @property
    def protected_tokens(self) -> int:
        """Tokens at the end of every prompt that are always computed (128 + 6 = 134)."""
        return self.window + self.max_backtracking

    @property
    def max_decode_overrun(self) -> int:
        """How far past a boundary a decode snapshot copy may land (6 spare ring slots → 5)."""
        return max(self.max_backtracking - 1, 0)


def resolve_geometry(
    geometry: HasHitGeometry | None = None,
    *,
    window: int = DEFAULT_WINDOW,
    max_backtracking: int = DEFAULT_MAX_BACKTRACKING,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> HitGeometry:
    """The numbers to plan with: ``geometry``'s when given, else the keyword arguments.

    A keyword argument that was changed from its default and disagrees with ``geometry`` is an
    error rather than silently losing to one of them.
    """
    if geometry is None:
        return HitGeometry(window, max_backtracking, block_tokens)
    chosen = {}
    for name, value, default in (
        ("window", window, DEFAULT_WINDOW),
        ("max_backtracking", max_backtracking, DEFAULT_MAX_BACKTRACKING),
        ("block_tokens", block_tokens, DEFAULT_BLOCK_TOKENS),
    ):
        if not hasattr(geometry, name):
            raise InvalidArgument("geometry", f"has no attribute {name!r}")
        from_geometry = getattr(geometry, name)
        if value != default and value != from_geometry:
            raise InvalidArgument(name, f"{value} conflicts with geometry.{name}={from_geometry}")
        chosen[name] = from_geometry
    return HitGeometry(**chosen)


@dataclass(frozen=True)
class HitPlan:
    """What the engine does with one prompt: what it reuses, what it computes, where it stores.

    ``compute_from`` is always ``hit_tokens``; in bounded-replay mode the engine additionally runs
    ``replay_tokens`` tokens from ``replay_start`` only to rebuild the window state.
    """

    prompt_len: int
    mode: str
    #: L − (window + max_backtracking), clamped at 0: no hit may go beyond it.
    cap: int
    #: L1: the cached block run truncated to whole blocks within the cap.
    block_hit_tokens: int
    hit_tokens: int
    swa_hit: bool
    #: The one position whose SWA state was looked for (L1), None when L1 = 0.
    swa_position: int | None
    replay_start: int | None
    replay_tokens: int
    compute_from: int
    #: docs/rules.md §6 prefill store position for this prompt (None when L ≤ block_tokens).
    store_at: int | None
    # Context below has defaults so a plan can be rebuilt from the wire message (which carries
    # only the fields above) without inventing values.
    window: int = DEFAULT_WINDOW
    max_backtracking: int = DEFAULT_MAX_BACKTRACKING
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    #: Leading run of cached blocks as the block store gave it, before the cap (None: unknown).
    block_run_tokens: int | None = None
    #: Machine holding the SWA state, when the caller said so.
    swa_location: str | None = None

    @property
    def protected_tokens(self) -> int:
        """Tokens at the end of the prompt that are always computed."""
        return protected_tokens(self.mode, self.window + self.max_backtracking)

    @property
    def compute_tokens(self) -> int:
        """Prompt tokens this request computes (replay not included)."""
        return self.prompt_len - self.compute_from

    @property
    def reason(self) -> str:
        """One line saying why the hit is what it is."""
        protected = self.protected_tokens
        if self.block_hit_tokens == 0:
            if self.cap < self.block_tokens:
                return (
                    f"cap L − {protected} = {self.cap} holds no whole "
                    f"block → hit 0, compute everything"
                )
            return "no cached block at the start of the prompt → hit 0, compute everything"
        prefix = ""
        if self.block_run_tokens is not None and self.block_run_tokens > self.block_hit_tokens:
            prefix = (
                f"block run {self.block_run_tokens} truncated to the cap {self.cap} → "
                f"L1 = {self.block_hit_tokens}; "
            )
        where = f" on {self.swa_location}" if self.swa_location else ""
        if self.mode == FULL_ATTENTION:
            return f"{prefix}full attention, no window state → hit {self.hit_tokens}"
        if self.mode == EXACT_WINDOW:
            if not self.swa_hit:
                return (
                    f"{prefix}no window state at {self.block_hit_tokens} or below → hit 0, "
                    "compute everything (exact attention needs the window)"
                )
            below = (
                ""
                if self.hit_tokens == self.block_hit_tokens
                else (f"none at {self.block_hit_tokens}, ")
            )
            return (
                f"{prefix}{below}window state at {self.swa_position} found{where} → "
                f"hit {self.hit_tokens}, fetch it and resume there"
            )
        if self.swa_hit:
            return (
                f"{prefix}SWA state at {self.swa_position} found{where} → "
                f"hit {self.hit_tokens}, fetch the state and resume there"
            )
        if self.mode == BOUNDED_REPLAY:
            end = self.block_hit_tokens
            return (
                f"{prefix}SWA state at {self.swa_position} missing → replay "
                f"[{self.replay_start}, {end}) to rebuild it (block KV kept), hit {self.hit_tokens}"
            )
        return (
            f"{prefix}SWA state at {self.swa_position} missing → back off one block: "
            f"hit {self.hit_tokens}, recompute [{self.hit_tokens}, {self.block_hit_tokens})"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready view (None stays None → null)."""
        data = asdict(self)
        data["compute_tokens"] = self.compute_tokens
        data["reason"] = self.reason
        return data


# --- the hit rule ---------------------------------------------------------------------------


def protected_tokens(mode: str, window_and_backtracking: int) -> int:
    """Tokens a hit leaves to compute: 1 for an exact engine (it samples from the last prompt
    token's logits), window + backtracking for the V4 rules (YoCo keeps them live)."""
    return 1 if mode in (FULL_ATTENTION, EXACT_WINDOW) else window_and_backtracking


def hit_cap(
    prompt_len: int,
    *,
    window: int = DEFAULT_WINDOW,
    max_backtracking: int = DEFAULT_MAX_BACKTRACKING,
    geometry: HasHitGeometry | None = None,
    mode: str = STANDARD,
) -> int:
    """L − (window + max_backtracking), at least 0: the most tokens a hit may cover
    (full-attention mode: L − 1)."""
    geo = resolve_geometry(geometry, window=window, max_backtracking=max_backtracking)
    length = _positive_int(prompt_len, "prompt_len")
    return max(length - protected_tokens(mode, geo.protected_tokens), 0)


def plan_hit(
    prompt_len: int,
    block_hit_tokens: int | Sequence[bool] | np.ndarray,
    swa_available: SwaAvailability = None,
    *,
    mode: str = STANDARD,
    window: int = DEFAULT_WINDOW,
    max_backtracking: int = DEFAULT_MAX_BACKTRACKING,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    geometry: HasHitGeometry | None = None,
) -> HitPlan:
    """Plan the prefix hit of a prompt of ``prompt_len`` tokens (docs/rules.md §5).

    ``block_hit_tokens`` is what the block store answered: either the token length of the leading
    run of consecutive cached blocks (a multiple of ``block_tokens``; above the cap is fine, it is
    truncated), or one boolean per full block of the prompt (True = cached and readable).

    ``swa_available`` says which SWA states exist: a container of positions, a mapping position →
    machine, a callable position → bool or machine name, or None for none at all. Only position
    L1 is ever asked about (exact-window mode: L1, then each block boundary below it, highest
    first, until one is found); states at other positions are ignored.
    """
    geo = resolve_geometry(
        geometry, window=window, max_backtracking=max_backtracking, block_tokens=block_tokens
    )
    length = _positive_int(prompt_len, "prompt_len")
    if mode not in MODES:
        raise InvalidArgument("mode", f"must be one of {', '.join(MODES)}, got {mode!r}")
    block = geo.block_tokens
    full_blocks = length // block
    run = _block_run_tokens(block_hit_tokens, full_blocks, block)

    cap = max(length - protected_tokens(mode, geo.protected_tokens), 0)
    # Whole blocks only: a hit in the middle of a block would need a window state that §6 never
    # stores, so the cap is rounded down to a block boundary before it limits the run.
    block_hit = min(run, cap // block * block)

    swa_hit = False
    swa_position: int | None = None
    swa_location: str | None = None
    replay_start: int | None = None
    replay_tokens = 0
    hit = 0
    if block_hit > 0 and mode == FULL_ATTENTION:
        hit = block_hit  # no window state exists to look for
    elif block_hit > 0 and mode == EXACT_WINDOW:
        swa_position = block_hit
        for position in range(block_hit, 0, -block):
            swa_hit, swa_location = _lookup_swa(swa_available, position)
            if swa_hit:
                swa_position = hit = position
                break
    elif block_hit > 0:
        swa_position = block_hit
        swa_hit, swa_location = _lookup_swa(swa_available, block_hit)
        if swa_hit:
            hit = block_hit
        elif mode == BOUNDED_REPLAY:
            hit = block_hit
            # The window before L1 is rebuilt by replaying it; block KV is reused untouched.
            replay_tokens = min(geo.window, block_hit)
            replay_start = block_hit - replay_tokens
        else:
            hit = block_hit - block
    return HitPlan(
        prompt_len=length,
        mode=mode,
        window=geo.window,
        max_backtracking=geo.max_backtracking,
        block_tokens=block,
        cap=cap,
        block_run_tokens=run,
        block_hit_tokens=block_hit,
        hit_tokens=hit,
        swa_hit=swa_hit,
        swa_position=swa_position,
        swa_location=swa_location,
        replay_start=replay_start,
        replay_tokens=replay_tokens,
        compute_from=hit,
        store_at=_prefill_store(length, block),
    )


def _block_run_tokens(
    block_hit: int | Sequence[bool] | np.ndarray, full_blocks: int, block: int
) -> int:
    """Token length of the leading cached run, validated against the prompt's full blocks."""
    if isinstance(block_hit, np.ndarray) or (
        isinstance(block_hit, Sequence) and not isinstance(block_hit, str | bytes)
    ):
        return _run_of_flags(block_hit, full_blocks) * block
    tokens = _non_negative_int(block_hit, "block_hit_tokens")
    if tokens % block:
        raise InvalidArgument(
            "block_hit_tokens", f"must be a multiple of {block} (whole blocks), got {tokens}"
        )
    if tokens > full_blocks * block:
        raise InvalidArgument(
            "block_hit_tokens",
            f"{tokens} exceeds the prompt's {full_blocks} full blocks ({full_blocks * block})",
        )
    return tokens


def _run_of_flags(flags: Sequence[bool] | np.ndarray, full_blocks: int) -> int:
    """Number of leading True flags (one flag per full block of the prompt)."""
    if isinstance(flags, np.ndarray):
        if flags.ndim != 1 or flags.dtype != np.bool_:
            raise InvalidArgument(
                "block_hit_tokens",
                f"per-block flags must be a 1-D bool array, got {flags.dtype} {flags.shape}",
            )
        items: list[bool] = [bool(flag) for flag in flags]
    else:
        items = []
        for index, flag in enumerate(flags):
            # 0/1 integers are refused: an int here is more likely a token count in a list.
            if not isinstance(flag, bool | np.bool_):
                raise InvalidArgument(
                    "block_hit_tokens",
                    f"per-block flags must be booleans, item {index} is {type(flag).__name__}",
                )
            items.append(bool(flag))
    if len(items) > full_blocks:
        raise InvalidArgument(
            "block_hit_tokens",
            f"{len(items)} per-block flags for a prompt of only {full_blocks} full blocks",
        )
    run = 0
    for flag in items:
        if not flag:
            break
        run += 1
    return run


def _lookup_swa(available: SwaAvailability, position: int) -> tuple[bool, str | None]:
    """(found, machine) for the state at ``position``."""
    if available is None:
        return False, None
    if isinstance(available, Mapping):
        if position not in available:
            return False, None
        where = available[position]
        return True, where if isinstance(where, str) and where else None
    if callable(available):
        answer = available(position)
        if answer is None or answer is False:
            return False, None
        if answer is True:
            return True, None
        if isinstance(answer, str) and answer:
            return True, answer
        raise InvalidArgument(
            "swa_available",
            f"callable must return bool, a machine name or None, got {type(answer).__name__}",
        )
    if isinstance(available, str | bytes) or not isinstance(available, Container):
        raise InvalidArgument(
            "swa_available",
            "must be a container of positions, a mapping, a callable or None, "
            f"got {type(available).__name__}",
        )
    return position in available, None


# --- where states are stored (docs/rules.md §6) ---------------------------------------------------


def is_store_position(position: object, *, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> bool:
    """True when §6 may store a state at ``position`` (p > 0 and a multiple of the block).

    Any non-integer (bools included) is simply not a store position.
    """
    if isinstance(position, bool) or not isinstance(position, SupportsIndex):
        return False
    value = operator.index(position)
    block = _positive_int(block_tokens, "block_tokens")
    return value > 0 and value % block == 0


def check_store_position(
    position: object, argument: str = "position", *, block_tokens: int = DEFAULT_BLOCK_TOKENS
) -> int:
    """``position`` as an int if §6 could ever store a state there; InvalidArgument otherwise.

    Tiers call this to refuse SWA puts at positions no hit will ever look up.
    """
    value = _non_negative_int(position, argument)
    if not is_store_position(value, block_tokens=block_tokens):
        raise InvalidArgument(
            argument,
            f"SWA states are stored only at positive multiples of {block_tokens}, got {value}",
        )
    return value


def prefill_store_position(
    prompt_len: int, *, block_tokens: int = DEFAULT_BLOCK_TOKENS
) -> int | None:
    """Where prefill of ``prompt_len`` tokens stores its state: floor((L − 1)/128)·128.

    One token is held back so the anchor is a completed token even when L is a multiple of 128;
    None when that position is 0 (L ≤ 128): there is nothing worth storing.
    """
    length = _positive_int(prompt_len, "prompt_len")
    return _prefill_store(length, _positive_int(block_tokens, "block_tokens"))


def chunked_prefill_store_position(
    chunk_ends: Sequence[int], *, block_tokens: int = DEFAULT_BLOCK_TOKENS
) -> int | None:
    """Store position of a chunked prefill: only after its last chunk, as for the whole prompt.

    ``chunk_ends`` are the cumulative token counts after each chunk (strictly increasing, > 0);
    intermediate chunk ends never store, whatever their alignment.
    """
    if isinstance(chunk_ends, str | bytes) or not isinstance(chunk_ends, Sequence | np.ndarray):
        raise InvalidArgument("chunk_ends", f"must be a sequence, got {type(chunk_ends).__name__}")
    if len(chunk_ends) == 0:
        raise InvalidArgument("chunk_ends", "must name at least one chunk")
    previous = 0
    for index, end in enumerate(chunk_ends):
        value = _positive_int(end, f"chunk_ends[{index}]")
        if value <= previous:
            raise InvalidArgument(
                "chunk_ends",
                f"must be strictly increasing: chunk {index} ends at {value} after {previous}",
            )
        previous = value
    return prefill_store_position(previous, block_tokens=block_tokens)


def decode_boundary_crossed(
    previous_len: int,
    new_len: int,
    *,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    max_backtracking: int = DEFAULT_MAX_BACKTRACKING,
) -> int | None:
    """The block boundary a decode step from ``previous_len`` to ``new_len`` tokens crossed.

    When it returns a boundary b, the engine copies the window into the copy region now, at
    position ``new_len`` (= b + overrun). None when no boundary was reached. A step that lands
    more than ``max_backtracking − 1`` tokens past the boundary raises: the ring's spare slots
    could not absorb that copy (docs/rules.md §3: 6 spare slots, overrun ≤ 5).
    """
    block = _positive_int(block_tokens, "block_tokens")
    before = _non_negative_int(previous_len, "previous_len")
    after = _non_negative_int(new_len, "new_len")
    if after < before:
        raise InvalidArgument("new_len", f"{after} is before previous_len {before}")
    boundary = after // block * block
    if boundary <= before or boundary == 0:
        return None
    _check_overrun(after - boundary, "new_len", after, boundary, max_backtracking)
    return boundary


def decode_snapshot_anchor(
    copy_position: int,
    *,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    max_backtracking: int = DEFAULT_MAX_BACKTRACKING,
) -> int:
    """The boundary a decode copy taken at ``copy_position`` is anchored (stored) at.

    The anchor is the block boundary at or below the copy; the copy may be up to
    ``max_backtracking − 1`` (5) tokens past it, absorbed by the ring's spare slots. More is an
    error, as is a copy before the first boundary (no boundary was crossed, no copy exists).
    """
    block = _positive_int(block_tokens, "block_tokens")
    position = _non_negative_int(copy_position, "copy_position")
    anchor = position // block * block
    if anchor == 0:
        raise InvalidArgument(
            "copy_position", f"{position} is before the first boundary {block}: no copy is taken"
        )
    _check_overrun(position - anchor, "copy_position", position, anchor, max_backtracking)
    return anchor


def decode_store_position(
    last_copy_position: int | None,
    *,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    max_backtracking: int = DEFAULT_MAX_BACKTRACKING,
) -> int | None:
    """Where a request that ends in decode stores its state: the anchor of its last completed copy.

    ``last_copy_position`` is where the last completed boundary copy was taken, or None when the
    request never crossed a boundary while decoding (then decode stores nothing).
    """
    if last_copy_position is None:
        return None
    return decode_snapshot_anchor(
        last_copy_position, block_tokens=block_tokens, max_backtracking=max_backtracking
    )


def _check_overrun(
    overrun: int, argument: str, position: int, boundary: int, max_backtracking: int
) -> None:
    limit = max(_non_negative_int(max_backtracking, "max_backtracking") - 1, 0)
    if overrun > limit:
        raise InvalidArgument(
            argument,
            f"copy at {position} is {overrun} tokens past boundary {boundary}; the ring's "
            f"{max_backtracking} spare slots absorb at most {limit}",
        )


def _prefill_store(length: int, block: int) -> int | None:
    position = (length - 1) // block * block
    return position or None


# --- argument checks -----------------------------------------------------------------------


def _non_negative_int(value: object, argument: str) -> int:
    # A plain int needs none of the checks below (the Protocol isinstance alone costs
    # microseconds, several times per QueryHit); bool's type is not int, so it is not let in.
    if type(value) is int and value >= 0:
        return value
    # bool is an int subclass but never a length; floats and strings have no __index__.
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise InvalidArgument(argument, f"must be an integer, got {type(value).__name__}")
    number = operator.index(value)
    if number < 0:
        raise InvalidArgument(argument, f"must be ≥ 0, got {number}")
    return int(number)


def _positive_int(value: object, argument: str) -> int:
    if type(value) is int and value >= 1:  # fast path: see _non_negative_int
        return value
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise InvalidArgument(argument, f"must be an integer, got {type(value).__name__}")
    number = operator.index(value)
    if number < 1:
        raise InvalidArgument(argument, f"must be ≥ 1, got {number}")
    return int(number)
