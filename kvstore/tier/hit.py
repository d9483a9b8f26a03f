"""The docs/rules.md §5 plan over both tiers: the block run, the one SWA state it needs,
the lease, advice.

1. Block keys come from the caller or from the prompt's token ids (``kvstore.keys``). A block
   beyond the cap (L − 134) can never be part of a hit; the prompt's full blocks past it are
   looked up in the same call all the same, so the answer can say how many the tier holds
   (``stored_blocks``): the engine computes them and need not save them again.
2. The block tier answers the leading run of consecutive committed+readable blocks and a lease
   that keeps them from being evicted while the engine reads them.
3. The SWA directory is asked about exactly one key: the block ending at L1 (the state covering
   [L1 − 128, L1]). A directory that cannot answer in time is a miss.
4. ``kvstore.hitplan.plan_hit`` turns that into the plan; when the state was found, the
   fetch-or-replay advice is attached, plus the plan to follow if the fetch fails after all
   (``miss_plan``: back off one block, or bounded replay), so a lost owner is never an error.

Exact-window mode (an engine with exact sliding-window attention) asks about L1 first too; when
that state is missing it asks about every block boundary below L1 at once (one round: the
directory answers them together) and takes the highest one found, or plans a miss.

Both tiers are reached through two small protocols (``BlockLookup``, ``StateLocator``), so every
tier implementation — the cluster, files in a directory, the unit tests' stand-ins — composes
them here, and ``HitResult.answer`` is the one translation into the seam's ``HitAnswer``.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvstore.errors import InvalidArgument, StoreError
from kvstore.hitplan import (
    EXACT_WINDOW,
    HasHitGeometry,
    HitPlan,
    hit_cap,
    plan_hit,
)
from kvstore.keys import BlockKey, repeated_key
from kvstore.pending import Pending
from kvstore.swa.advice import FETCH, Advice, FetchReplayAdvisor
from kvstore.swa.directory import StoreRef
from kvstore.tier.records import HitAnswer, HitRequest

log = logging.getLogger(__name__)


class BlockLookup(Protocol):
    """The block tier as the hit query needs it, waited for from a thread or from an asyncio
    loop (``kvstore.pending``)."""

    def lookup(self, keys: np.ndarray) -> Pending[tuple[int, Any]]:
        """(number of leading consecutive committed+readable blocks, lease on them or None).
        ``keys`` come as (n, 4) uint64 words (``kvstore.keys.key_words``)."""
        ...

    def release(self, lease: Any) -> None:
        """Never blocks (a release needs no answer)."""
        ...


class StateLocator(Protocol):
    """The SWA directory as the hit query needs it: who holds the state of ``key`` taken at
    ``position``, or None."""

    def locate(
        self, key: BlockKey, position: int, prefer_machine: str | None = None
    ) -> Pending[StoreRef | None]: ...


class NoStates:
    """A ``StateLocator`` that holds no state: a tier without an SWA tier, or a trace replay
    (a trace carries no states, so bounded replay keeps the block hit)."""

    def locate(
        self, key: BlockKey, position: int, prefer_machine: str | None = None
    ) -> Pending[StoreRef | None]:
        return _NOWHERE


_NOWHERE: Pending[StoreRef | None] = Pending.done(None)

#: What the plan asks of the tiers between its steps: ("blocks", keys), ("state", (key,
#: position)) or ("states", [(key, position), ...]: every one answered, in order).
_Need = tuple[str, Any]


class HitGeometry(HasHitGeometry, Protocol):
    """What the hit query needs of ``kvstore.geometry.GeometryConfig``: the hit rule's three
    numbers plus the model fingerprint its block keys are made with."""

    def fingerprint(self) -> bytes: ...


@dataclass(frozen=True)
class HitResult:
    """The answer of ``query_hit``. The caller owns ``lease`` and releases it through the block
    tier when it has read the blocks (or gives up)."""

    plan: HitPlan
    #: The keys looked up (the prompt's full blocks), as (n, 4) uint64 words.
    keys: np.ndarray
    #: Key of the SWA state looked for (the block ending at L1); None when L1 = 0.
    swa_key: BlockKey | None
    swa_owner: StoreRef | None
    #: Fetch-or-replay estimates; present when the state was found and an advisor is known.
    advice: Advice | None
    #: The plan to follow if the state cannot be fetched after all (present when found).
    miss_plan: HitPlan | None
    #: Blocks leased (the leading run of stored blocks, past the cap too) and the lease.
    leased_blocks: int
    lease: Any

    @property
    def hit_words(self) -> np.ndarray:
        """Keys of the blocks the engine loads (``plan.hit_tokens`` worth), as words."""
        return self.keys[: self.plan.hit_tokens // self.plan.block_tokens]

    def answer(self, lease_id: str | None) -> HitAnswer:
        """This result as the tier seam's ``HitAnswer`` (the one place that translates)."""
        advice, owner = self.advice, self.swa_owner
        return HitAnswer(
            plan=self.plan,
            swa_owner=None if owner is None else owner.machine_id,
            advice=advice.choice if advice is not None else (None if owner is None else FETCH),
            fetch_seconds=advice.fetch_s if advice is not None else 0.0,
            replay_seconds=advice.replay_s if advice is not None else 0.0,
            lease_id=lease_id,
            hit_keys=self.hit_words,
            stored_blocks=self.leased_blocks,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan.to_dict(),
            "swa_key": None if self.swa_key is None else self.swa_key.hex(),
            "swa_owner": None
            if self.swa_owner is None
            else {"machine_id": self.swa_owner.machine_id, "store": self.swa_owner.store_name},
            "advice": None if self.advice is None else self.advice.to_dict(),
            "miss_plan": None if self.miss_plan is None else self.miss_plan.to_dict(),
            "leased_blocks": self.leased_blocks,
        }


class HitQuery:
    """Plans prefix hits over ``blocks`` and ``states`` (``local_machine``: where the engine
    runs, if known; its own store is preferred and fetches from it count as local).
    ``advisor`` estimates fetch against replay; without one a found state is simply fetched."""

    def __init__(
        self,
        *,
        blocks: BlockLookup,
        states: StateLocator,
        geometry: HitGeometry,
        advisor: FetchReplayAdvisor | None = None,
        local_machine: str | None = None,
    ) -> None:
        self._blocks = blocks
        self._states = states
        self._advisor = advisor
        self._geometry = geometry
        self._fingerprint = geometry.fingerprint()
        self.local_machine = local_machine

    def query_hit(self, request: HitRequest) -> HitResult:
        """The docs/rules.md §5 plan for the prompt of ``request`` (checked when it was made)."""
        steps = self._steps(request)
        need = _advance(steps, None, None)
        while not isinstance(need, HitResult):
            try:
                reply, error = self._ask(need).result(), None
            except BaseException as raised:  # handed to the plan, which gives back its lease
                reply, error = None, raised
            need = _advance(steps, reply, error)
        return need

    async def query_hit_async(self, request: HitRequest) -> HitResult:
        """``query_hit`` for a caller on an asyncio loop (the gateway): the same plan, the
        tiers asked without parking a thread."""
        steps = self._steps(request)
        need = _advance(steps, None, None)
        while not isinstance(need, HitResult):
            try:
                reply, error = await self._ask(need), None
            except BaseException as raised:  # handed to the plan, which gives back its lease
                reply, error = None, raised
            need = _advance(steps, reply, error)
        return need

    def _ask(self, need: _Need) -> Pending[Any]:
        """What ``need`` asks of the tiers, as one ``Pending`` (an unreachable block tier is a
        miss: nothing reused, nothing leased)."""
        if need[0] == "blocks":
            asked: Pending[Any] = self._blocks.lookup(need[1]).recover(StoreError, _block_tier_down)
        elif need[0] == "state":
            key, position = need[1]
            asked = self._states.locate(key, position, self.local_machine)
        else:
            asked = Pending.all(
                [self._states.locate(key, at, self.local_machine) for key, at in need[1]]
            )
        return asked

    def _steps(self, request: HitRequest) -> Generator[_Need, Any, HitResult]:
        """The plan, one step at a time: it yields what it needs of the tiers and is sent the
        answer, so the same rule runs from a thread and from an asyncio loop."""
        prompt_len, mode = request.prompt_len, request.mode
        cap = hit_cap(prompt_len, geometry=self._geometry, mode=mode)
        # Blocks past the cap can never hit, yet the prompt's full blocks past it are looked up
        # in the same call: the engine computes them, and need not save again what the tier
        # holds (``stored_blocks``). With no block inside the cap nothing is looked up.
        block = self._geometry.block_tokens
        keys = request.words(self._fingerprint, prompt_len // block if cap >= block else 0)
        # Each key would take a lease of its own: a repeated key is refused, not leased twice.
        repeat = repeated_key(keys)
        if repeat is not None:
            raise InvalidArgument(
                f"block_keys[{repeat}]", "repeats an earlier key (a prompt's keys never repeat)"
            )
        run, lease = 0, None
        if keys.shape[0]:
            run, lease = yield ("blocks", keys)
            if isinstance(run, bool) or not isinstance(run, int) or not 0 <= run <= len(keys):
                if lease is not None:
                    self._blocks.release(lease)
                raise StoreError(f"block lookup answered {run!r} blocks for {len(keys)} keys")
        try:
            block = self._geometry.block_tokens
            l1_plan = plan_hit(prompt_len, run * block, None, mode=mode, geometry=self._geometry)
            position = l1_plan.swa_position
            if position is None:
                return HitResult(l1_plan, keys, None, None, None, None, run, lease)
            swa_key = BlockKey(keys[position // block - 1].tobytes())
            owner = yield ("state", (swa_key, position))
            if owner is None and mode == EXACT_WINDOW and position > block:
                below = range(position - block, 0, -block)
                asked = [(BlockKey(keys[p // block - 1].tobytes()), p) for p in below]
                owners = yield ("states", asked)
                found_below = [(k, p, o) for (k, p), o in zip(asked, owners, strict=True) if o]
                if found_below:
                    swa_key, position, owner = found_below[0]
            if owner is None:
                return HitResult(l1_plan, keys, swa_key, None, None, None, run, lease)
            found = {position: owner.machine_id}
            plan = plan_hit(prompt_len, run * block, found, mode=mode, geometry=self._geometry)
            advice = None
            if self._advisor is not None:
                advice = self._advisor.advise(owner.machine_id, self.local_machine)
            return HitResult(plan, keys, swa_key, owner, advice, l1_plan, run, lease)
        except BaseException:
            if lease is not None:
                self._blocks.release(lease)
            raise


def _block_tier_down(error: StoreError) -> tuple[int, None]:
    """The block tier could not answer: nothing is reused, nothing is leased."""
    log.warning("block lookup failed, planning a miss: %s", error)
    return 0, None


def _advance(
    steps: Generator[_Need, Any, HitResult], reply: Any, error: BaseException | None
) -> _Need | HitResult:
    """Give the plan the tier's reply (or throw in the tier's failure, so the plan gives back
    its lease); returns what it needs next, or its result."""
    try:
        return steps.send(reply) if error is None else steps.throw(error)
    except StopIteration as done:
        return done.value
