"""The connector's scheduler side: what to load and save, decided; never a byte touched.

One ``PagedScheduler`` per engine asks the tier once per request how much of its prompt is
cached (one QueryHit with the prompt's chained block keys and the model's hit mode, a lease
taken), records which engine blocks a load must fill and which newly computed blocks a step
must save, and hands both to the worker side as a picklable ``StepPlan``
(``kvstore.engine.plan``). A tier that does not answer within ``lookup_timeout_s`` is a
miss, and for ``retry_after_s`` after that every lookup is a miss without asking, so a dead tier
costs one timeout, not one per request.

A hybrid model (``EngineGroups.hybrid``) adds the window state (docs/rules.md §6, §11):

- hits use the ``exact-window`` mode: the hit is the longest prefix whose window the tier has;
- a load fills every full-attention block of the hit and, in each sliding group, only the
  ``window_blocks`` blocks that end at the hit (the rest of a sliding group's table is vLLM's
  null block); it is asynchronous, because vLLM has no per-block recompute path for a failed
  load when a model has several KV-cache groups (the whole request is recomputed instead);
- the state is saved at the prefill store position ``floor((L − 1) / 128) · 128`` in the step
  that computes it, and at every boundary the request crosses after that; of those, only the
  last is stored, when the request ends (the decode store of docs/rules.md §6). Each save reads its
  rows in the step that completes them: vLLM frees a sliding block once it leaves the window.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.engine.groups import EngineGroups
from kvstore.engine.plan import PagedLoad, PagedSave, StateSave, StepPlan, describe
from kvstore.engine.worth import LoadWorth, Verdict
from kvstore.errors import InvalidArgument
from kvstore.keys import BLOCK_TOKENS, BlockKey, block_keys
from kvstore.tier.protocols import HitSource
from kvstore.tier.records import HitAnswer, HitRequest

log = logging.getLogger(__name__)

#: Block ids per KV-cache group, or one table (a model with one group).
Tables = Sequence[Sequence[int]] | Sequence[int]


def _per_group(tables: Tables, groups: int) -> list[list[int]]:
    """``tables`` as one list per group (a bare list of ids is the one group's table)."""
    items: list[Any] = list(tables)
    if not items or not isinstance(items[0], Sequence):
        if groups != 1:
            raise InvalidArgument("block_ids", f"give one table per KV-cache group ({groups})")
        return [[int(b) for b in items]]
    if len(items) != groups:
        raise InvalidArgument("block_ids", f"{len(items)} tables for {groups} KV-cache groups")
    return [[int(b) for b in table] for table in items]


@dataclass
class _Tracked:
    """Scheduler-side facts about one request."""

    answer: HitAnswer | None
    prompt_len: int = 0
    computed: int = 0  # tokens the engine had (its own prefix cache) when the load was planned
    tables: list[list[int]] = field(default_factory=list)
    saved_blocks: int = -1  # blocks known to be in the tier or handed to a save; -1: not yet
    #: The prompt's leading full blocks the tier said it holds (past the hit's cap too): the
    #: engine computes those it does not load, and saves none of them again. Kept apart from
    #: ``saved_blocks``, which also says from where a hybrid model's window states are due.
    stored_blocks: int = 0
    stepped_to: int = -1  # tokens of KV after the last planned step; -1: none planned yet
    saves_emitted: int = 0
    loading: PagedLoad | None = None
    #: A load of this request went to the worker already.
    load_sent: bool = False
    #: Load or recompute, once judged (``LoadWorth``).
    verdict: Verdict | None = None


class PagedScheduler:
    """The deciding half (one per engine; not thread-safe: the engine's scheduler loop calls
    it from one thread). ``fingerprint``: what block keys are chained from (the full-attention
    group's, ``EngineGroups.group_fingerprint``)."""

    def __init__(
        self,
        hits: HitSource,
        fingerprint: bytes,
        *,
        mode: str,
        groups: EngineGroups | None = None,
        traffic_class: str = "",
        retry_after_s: float = 5.0,
        load: bool = True,
        save: bool = True,
        reads_end_leases: bool = True,
        worth: LoadWorth | None = None,
        block_bytes: int = 0,
        probe: Callable[[HitAnswer, float], tuple[int, float] | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``groups``: the engine's KV-cache groups (None: one full-attention group).
        ``reads_end_leases``: the worker's read with a lease ends it (the gRPC gateway
        does); False for a tier whose leases only this process can end (an in-cluster
        ``ClusterTier``: the fetcher reads with the id unknown), so the scheduler ends each
        load's lease when it plans the step after it. ``worth``: judges whether a hit is
        faster to load than to compute (``block_bytes`` a block; None: always load).
        ``probe``: reads part of a hit over the load path within a budget of seconds and says
        (bytes, seconds), or None when it could not (``kvstore.engine.probe``); asked while
        ``worth`` has no load figure (a fresh engine), so its first hit is judged too."""
        self._hits = hits
        self._reads_end_leases = reads_end_leases
        self._sent_leases: list[str] = []
        self.fingerprint = fingerprint
        self.mode = mode
        self.groups = groups
        self._num_groups = 1 if groups is None else len(groups.groups)
        self._full = 0 if groups is None else groups.full_group
        self._sliding = () if groups is None else groups.sliding_groups
        self._window_blocks = 0 if groups is None else groups.window_blocks
        self.traffic_class = traffic_class
        self._retry_after_s = retry_after_s
        self._load, self._save = load, save
        self._clock = clock
        self._down_until = 0.0
        self._requests: dict[str, _Tracked] = {}
        self._next = StepPlan()
        self.worth = worth
        self._block_bytes = block_bytes
        self._probe = probe
        self.lookups = 0
        self.lookup_failures = 0
        #: Hits turned down because computing them was judged faster than loading them.
        self.recomputed = 0
        self._recomputing = False

    @property
    def asynchronous_loads(self) -> bool:
        """Loads complete before the request is scheduled (a hybrid model's)."""
        return bool(self._sliding)

    def keys(self, token_ids: Sequence[int], blocks: int) -> list[BlockKey]:
        """Keys of the first ``blocks`` full blocks of ``token_ids``."""
        return block_keys(self.fingerprint, list(token_ids[: blocks * BLOCK_TOKENS]))

    def _answer(self, request_id: str, prompt: Sequence[int]) -> HitAnswer | None:
        tracked = self._requests.get(request_id)
        if tracked is not None:
            return tracked.answer
        answer = None
        full = (len(prompt) - 1) // BLOCK_TOKENS  # ≥ 1 token is always computed
        # What this engine measured of its prefill: the tier answers it to fresh engines.
        rate = 0.0 if self.worth is None else self.worth.prefill_rate()
        if self._load and full > 0 and self._clock() >= self._down_until:
            self.lookups += 1
            try:
                answer = self._hits.query_hit(
                    HitRequest(
                        # Every full block: those past the cap never hit, but the answer says
                        # which the tier holds (``stored_blocks``), so they are not saved again.
                        block_keys=self.keys(prompt, len(prompt) // BLOCK_TOKENS),
                        prompt_len=len(prompt),
                        mode=self.mode,
                        traffic_class=self.traffic_class,
                        take_lease=True,
                        # The lease's read grant, where the tier gives one: the fetcher reads
                        # the blocks from the storage nodes instead of through the gateway.
                        direct=True,
                        prefill_tokens_per_s=rate,
                    )
                )
            except Exception as error:  # noqa: BLE001 - a tier that does not answer is a miss
                self.lookup_failures += 1
                self._down_until = self._clock() + self._retry_after_s
                log.warning(
                    "kvstore lookup failed (%s); every lookup is a miss for %.0f s",
                    describe(error),
                    self._retry_after_s,
                )
        stored = 0 if answer is None else answer.stored_blocks
        self._requests[request_id] = _Tracked(answer, prompt_len=len(prompt), stored_blocks=stored)
        return answer

    def matched_tokens(
        self, request_id: str, prompt: Sequence[int], num_computed_tokens: int
    ) -> int:
        """Tokens beyond ``num_computed_tokens`` (a whole number of blocks: the engine's own
        prefix cache) that the tier can provide: whole blocks, at most ``len(prompt) − 1``."""
        if num_computed_tokens % BLOCK_TOKENS:
            raise InvalidArgument(
                "num_computed_tokens",
                f"{num_computed_tokens} is not whole {BLOCK_TOKENS}-token blocks",
            )
        answer = self._answer(request_id, prompt)
        hit = 0 if answer is None else answer.plan.hit_tokens
        if self._requests[request_id].load_sent:
            # Asked again after its load was sent: that load failed (the engine recomputes the
            # request from the start) or the request was preempted. Either way it is computed:
            # offering the same hit again could fail the same way, forever.
            hit = 0
        hit = min(hit, (len(prompt) - 1) // BLOCK_TOKENS * BLOCK_TOKENS)
        if self._sliding and hit <= num_computed_tokens:
            # The window at the engine's own hit came with it; a shorter tier hit adds nothing.
            hit = 0
        tracked = self._requests[request_id]
        tracked.computed = num_computed_tokens
        extra = max(hit - num_computed_tokens, 0)
        if extra and not self._worth_loading(request_id, tracked, extra):
            # The engine computes it; ``allocated`` with 0 gives the lease back. The tier has
            # those blocks already: they are not saved again (on a slow link, twice the cost).
            tracked.saved_blocks = max(tracked.saved_blocks, hit // BLOCK_TOKENS)
            return 0
        return extra

    def _worth_loading(self, request_id: str, tracked: _Tracked, tokens: int) -> bool:
        """Whether loading ``tokens`` of hit beats computing them (judged once a request)."""
        worth = self.worth
        if worth is None:
            return True
        if tracked.verdict is None:
            answer = tracked.answer
            prior = 0.0 if answer is None else answer.prefill_tokens_per_s
            budget = worth.probe_budget(prior)
            if self._probe is not None and answer is not None and budget is not None:
                probed = self._probe(answer, budget)
                if probed is not None:
                    worth.probed(*probed)
            nbytes = tokens // BLOCK_TOKENS * self._block_bytes
            tracked.verdict = worth.verdict(tokens, nbytes, prior)
            if not tracked.verdict.load:
                self.recomputed += 1
            if tracked.verdict.load == self._recomputing:
                # The tier just turned slow (or fast again): said once, not per request.
                self._recomputing = not tracked.verdict.load
                log.warning(
                    "kvstore: %s: %d tokens cached in the tier: %s%s",
                    request_id,
                    tokens,
                    tracked.verdict.describe(),
                    "; hits are recomputed instead of loaded while the tier is this slow"
                    if self._recomputing
                    else "",
                )
            elif not tracked.verdict.load:
                log.info(
                    "kvstore: %s: %d tokens recomputed instead of loaded (%s)",
                    request_id,
                    tokens,
                    tracked.verdict.describe(),
                )
        return tracked.verdict.load

    def allocated(self, request_id: str, block_ids: Tables, num_external: int) -> None:
        """The engine gave the request ``block_ids`` (its whole block table, one per KV-cache
        group) and accepted ``num_external`` tokens from the tier: plan the load."""
        tracked = self._requests.get(request_id)
        if tracked is None:
            tracked = self._requests[request_id] = _Tracked(None)
        tracked.tables = _per_group(block_ids, self._num_groups)
        if num_external <= 0:
            self._release(tracked)
            return
        answer = tracked.answer
        if answer is None or num_external % BLOCK_TOKENS:
            raise InvalidArgument(
                "num_external_tokens", f"{num_external} is not whole blocks of a planned hit"
            )
        first = tracked.computed // BLOCK_TOKENS
        last = first + num_external // BLOCK_TOKENS
        keys = answer.hit_block_keys
        full_table = tracked.tables[self._full]
        if last > len(keys) or last > len(full_table):
            raise InvalidArgument(
                "num_external_tokens",
                f"{num_external} tokens from block {first} exceed the hit "
                f"({len(keys)} blocks) or the block table ({len(full_table)})",
            )
        windows: tuple[tuple[int, ...], ...] = ()
        state_key = state_position = None
        if self._sliding:
            windows = self._window_rows(tracked, last)
            state_key, state_position = bytes(keys[last - 1]), last * BLOCK_TOKENS
        load = PagedLoad(
            request_id,
            tuple(full_table[first:last]),
            tuple(bytes(k) for k in keys[first:last]),
            answer.lease_id,
            windows=windows,
            state_key=state_key,
            state_position=state_position,
            asynchronous=bool(self._sliding),
            direct=None if answer.direct is None else answer.direct.part(first, last),
        )
        tracked.loading = load
        tracked.saved_blocks = last  # what was loaded is in the tier already
        self._next.loads.append(load)

    def _window_rows(self, tracked: _Tracked, end_block: int) -> tuple[tuple[int, ...], ...]:
        """Each sliding group's rows of the window that ends at block ``end_block``."""
        start = end_block - self._window_blocks
        rows = []
        for group in self._sliding:
            table = tracked.tables[group]
            if start < 0 or end_block > len(table):
                raise InvalidArgument(
                    "block_ids",
                    f"group {group}'s table ({len(table)} blocks) has no window ending at "
                    f"block {end_block}",
                )
            rows.append(tuple(table[start:end_block]))
        return tuple(rows)

    def step(
        self,
        request_id: str,
        tokens: Sequence[int],
        computed: int,
        *,
        table: Tables | None = None,
        appended: Tables = (),
    ) -> None:
        """The step being planned takes the request to ``computed`` tokens of KV (``tokens``
        holds at least those). ``table``: its whole block table per group (a new or resumed
        request), else ``appended``: blocks that joined each group's. Saves the blocks (and
        the window state) this step completes."""
        tracked = self._requests.get(request_id)
        if tracked is None:
            tracked = self._requests[request_id] = _Tracked(None, prompt_len=len(tokens))
        if table is not None:
            tracked.tables = _per_group(table, self._num_groups)
        elif appended:
            if not tracked.tables:
                tracked.tables = [[] for _ in range(self._num_groups)]
            for mine, more in zip(
                tracked.tables, _per_group(appended, self._num_groups), strict=True
            ):
                mine.extend(more)
        if not tracked.tables:
            tracked.tables = [[] for _ in range(self._num_groups)]
        if tracked.saved_blocks < 0:
            # Blocks the engine had cached itself were saved when it computed them.
            tracked.saved_blocks = tracked.computed // BLOCK_TOKENS
        before = tracked.stepped_to
        if before < 0:
            before = tracked.saved_blocks * BLOCK_TOKENS
        tracked.stepped_to = max(before, computed)
        if not self._save:
            return
        full = min(computed, len(tokens)) // BLOCK_TOKENS
        full = min(full, len(tracked.tables[self._full]))
        first = max(tracked.saved_blocks, tracked.stored_blocks)
        state = self._state_to_save(request_id, tracked, tokens, before, full)
        if full <= first and state is None:
            return
        first = min(first, full)
        keys = self.keys(tokens, full)[first:]
        self._next.saves.append(
            PagedSave(
                request_id,
                tuple(tracked.tables[self._full][first:full]),
                tuple(bytes(k) for k in keys),
                self.traffic_class,
                state,
            )
        )
        tracked.saved_blocks = max(tracked.saved_blocks, full)
        tracked.saves_emitted += 1

    def _state_to_save(
        self, request_id: str, tracked: _Tracked, tokens: Sequence[int], before: int, full: int
    ) -> StateSave | None:
        """The window state this step completes, if one is due (a hybrid model's): the state
        at the prefill store position is saved, one past it is held until the request ends."""
        boundary = full * BLOCK_TOKENS
        if not self._sliding or boundary <= before:
            return None
        store_at = (tracked.prompt_len - 1) // BLOCK_TOKENS * BLOCK_TOKENS
        if before < store_at < boundary:
            # This step crossed the prefill store position and went on past it (a prompt of
            # whole blocks, or chunks that skipped it): that state is saved on its own.
            prefill = self._state(tracked, tokens, store_at, hold=False)
            if prefill is not None:
                tracked.saves_emitted += 1
                self._next.saves.append(PagedSave(request_id, (), (), self.traffic_class, prefill))
        if boundary < store_at:
            return None  # a chunk of the prefill: its state is not one the tier keeps
        return self._state(tracked, tokens, boundary, hold=boundary > store_at)

    def _state(
        self, tracked: _Tracked, tokens: Sequence[int], position: int, *, hold: bool
    ) -> StateSave | None:
        end = position // BLOCK_TOKENS
        if end < self._window_blocks or end == 0:
            return None  # the window does not fit before the position
        try:
            windows = self._window_rows(tracked, end)
        except InvalidArgument:
            return None  # the engine did not give the rows (a table shorter than the blocks)
        return StateSave(bytes(self.keys(tokens, end)[-1]), position, windows, hold=hold)

    def build(self) -> StepPlan:
        """Everything decided since the last call (a load goes out once)."""
        plan, self._next = self._next, StepPlan()
        # The loads sent with the last plan have run (a late one reads without its lease: at
        # worst a miss, recomputed).
        for lease in self._sent_leases:
            self._release_id(lease)
        self._sent_leases = []
        for load in plan.loads:
            if load.lease_id is not None and not self._reads_end_leases:
                self._sent_leases.append(load.lease_id)
            tracked = self._requests.get(load.request_id)
            if tracked is not None:
                tracked.loading = None
                tracked.load_sent = True
                if tracked.answer is not None:  # the load's read ends the lease
                    tracked.answer = dataclasses.replace(tracked.answer, lease_id=None)
        return plan

    def finished(self, request_id: str) -> bool:
        """The request is done: True when its blocks must stay allocated until the worker
        reports it (it has saves whose rows are read during a step)."""
        tracked = self._requests.pop(request_id, None)
        if tracked is None:
            return False
        self._next.ended.append(request_id)
        if tracked.loading is not None:  # planned, never sent: drop it, give the lease back
            self._next.loads = [x for x in self._next.loads if x is not tracked.loading]
            self._release(tracked)
        if tracked.saves_emitted:
            self._next.finished[request_id] = tracked.saves_emitted
            return True
        return False

    def _release(self, tracked: _Tracked) -> None:
        answer = tracked.answer
        if answer is None or answer.lease_id is None:
            return
        tracked.answer = dataclasses.replace(answer, lease_id=None)
        self._release_id(answer.lease_id)

    def _release_id(self, lease: str) -> None:
        try:
            self._hits.release_lease(lease)
        except Exception:  # noqa: BLE001 - an unreleased lease only expires later
            log.info("lease %s not released", lease, exc_info=True)
