"""``query_hit``: the SPEC §5 plan over both tiers, with the SWA owner and the block leases.

1. Block keys come from the caller or from the prompt's token ids (``kvstore.keys``). Only the
   blocks inside the cap (L − 134) are asked about: a block beyond it can never be part of a hit,
   so it is neither looked up nor leased.
2. The block tier answers the leading run of consecutive committed+readable blocks and a lease
   that keeps them from being evicted while the engine reads them.
3. The SWA directory is asked about exactly one key: the block ending at L1 (the state covering
   [L1 − 128, L1]). A directory that cannot answer in time is a miss.
4. ``kvstore.hitplan.plan_hit`` turns that into the plan; when the state was found, the
   fetch-or-replay advice is attached, plus the plan to follow if the fetch fails after all
   (``miss_plan``: back off one block, or bounded replay), so a lost owner is never an error.

Both tiers are reached through small protocols, so this logic is unit-tested with in-process
implementations and wired to the real Ray clients by ``kvstore.swa.client``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvstore.errors import InvalidArgument, StoreError
from kvstore.hitplan import MODES, STANDARD, HasHitGeometry, HitPlan, hit_cap, plan_hit
from kvstore.keys import BlockKey, block_keys, key_words
from kvstore.swa.advice import Advice, FetchReplayAdvisor
from kvstore.swa.directory import StoreRef

log = logging.getLogger(__name__)


class BlockLookup(Protocol):
    """The block tier as the hit query needs it."""

    def lookup(self, keys: np.ndarray) -> tuple[int, Any]:
        """(number of leading consecutive committed+readable blocks, lease on them). ``keys``
        come as (n, 4) uint64 words (``kvstore.keys.key_words``; ``words_to_keys`` inverts)."""
        ...

    def release(self, lease: Any) -> None: ...


class StateLocator(Protocol):
    """The SWA directory as the hit query needs it: who holds the state of ``key``, or None."""

    def locate(self, key: BlockKey, prefer_machine: str | None = None) -> StoreRef | None: ...


class HitGeometry(HasHitGeometry, Protocol):
    """What the hit query needs of ``kvstore.geometry.GeometryConfig``: the hit rule's three
    numbers plus the model fingerprint its block keys are made with."""

    def fingerprint(self) -> bytes: ...


class BlockClientLookup:
    """``BlockLookup`` over the block tier's client (``kvstore.blockstore.client``), whose
    ``lookup(keys, traffic_class)`` answers a result with ``hit_blocks`` and ``lease``."""

    def __init__(self, client: Any, traffic_class: str | None = None) -> None:
        self._client = client
        self._traffic_class = traffic_class

    def lookup(self, keys: np.ndarray) -> tuple[int, Any]:
        result = self._client.lookup(keys, self._traffic_class)
        return int(result.hit_blocks), result.lease

    def release(self, lease: Any) -> None:
        self._client.release(lease)


@dataclass(frozen=True)
class HitResult:
    """The answer of ``query_hit``. The caller owns ``lease`` and releases it through the block
    client when it has read the blocks (or gives up)."""

    plan: HitPlan
    #: Key of the SWA state looked for (the block ending at L1); None when L1 = 0.
    swa_key: BlockKey | None
    swa_owner: StoreRef | None
    #: Fetch-or-replay estimates; present when the state was found.
    advice: Advice | None
    #: The plan to follow if the state cannot be fetched after all (present when found).
    miss_plan: HitPlan | None
    #: Blocks leased (the leading run within the cap) and the lease itself.
    leased_blocks: int
    lease: Any

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
    """Plans prefix hits for one engine (``local_machine`` is where it runs, if known)."""

    def __init__(
        self,
        *,
        blocks: BlockLookup,
        states: StateLocator,
        advisor: FetchReplayAdvisor,
        geometry: HitGeometry,
        local_machine: str | None = None,
    ) -> None:
        self._blocks = blocks
        self._states = states
        self._advisor = advisor
        self._geometry = geometry
        self._fingerprint = geometry.fingerprint()
        self.local_machine = local_machine

    def query_hit(
        self,
        keys_or_tokens: Sequence[BlockKey] | Sequence[int] | np.ndarray,
        prompt_len: int,
        mode: str = STANDARD,
    ) -> HitResult:
        """The SPEC §5 plan for a prompt of ``prompt_len`` tokens given its block keys (one per
        full block, from the start) or its token ids (exactly ``prompt_len`` of them)."""
        # Validate everything before taking a lease: a bad request acquires nothing.
        cap = hit_cap(prompt_len, geometry=self._geometry)
        block = self._geometry.block_tokens
        within_cap = cap // block
        keys = self._keys(keys_or_tokens, prompt_len, within_cap)
        if mode not in MODES:
            raise InvalidArgument("mode", f"must be one of {', '.join(MODES)}, got {mode!r}")

        run, lease = self._lookup_blocks(keys)
        try:
            return self._plan(keys, run, lease, prompt_len, mode)
        except BaseException:
            if lease is not None:
                self._blocks.release(lease)
            raise

    def _plan(
        self, keys: np.ndarray, run: int, lease: Any, prompt_len: int, mode: str
    ) -> HitResult:
        block = self._geometry.block_tokens
        l1_plan = plan_hit(prompt_len, run * block, None, mode=mode, geometry=self._geometry)
        position = l1_plan.swa_position
        if position is None:
            return HitResult(l1_plan, None, None, None, None, run, lease)
        swa_key = BlockKey(keys[position // block - 1].tobytes())
        owner = self._locate(swa_key)
        if owner is None:
            return HitResult(l1_plan, swa_key, None, None, None, run, lease)
        plan = plan_hit(
            prompt_len,
            run * block,
            {position: owner.machine_id},
            mode=mode,
            geometry=self._geometry,
        )
        advice = self._advisor.advise(owner.machine_id, self.local_machine)
        return HitResult(plan, swa_key, owner, advice, l1_plan, run, lease)

    def _keys(
        self,
        keys_or_tokens: Sequence[BlockKey] | Sequence[int] | np.ndarray,
        prompt_len: int,
        within_cap: int,
    ) -> np.ndarray:
        """The keys to look up, as (n, 4) uint64 words (``kvstore.keys.key_words``)."""
        block = self._geometry.block_tokens
        if _looks_like_tokens(keys_or_tokens):
            tokens = np.asarray(keys_or_tokens)
            if tokens.ndim != 1 or tokens.size != prompt_len:
                raise InvalidArgument(
                    "token_ids", f"must hold exactly prompt_len={prompt_len} ids, got {tokens.size}"
                )
            # Blocks past the cap can never hit: do not hash them.
            return key_words(block_keys(self._fingerprint, tokens[: within_cap * block]))
        keys = key_words(keys_or_tokens, "block_keys")
        full_blocks = prompt_len // block
        if keys.shape[0] > full_blocks:
            raise InvalidArgument(
                "block_keys",
                f"{keys.shape[0]} keys for a prompt of {prompt_len} tokens "
                f"({full_blocks} full blocks)",
            )
        return keys[:within_cap]

    def _lookup_blocks(self, keys: np.ndarray) -> tuple[int, Any]:
        if not keys.shape[0]:
            return 0, None
        try:
            run, lease = self._blocks.lookup(keys)
        except StoreError as error:
            # The block tier could not answer: nothing is reused, nothing is leased.
            log.warning("block lookup failed, planning a miss: %s", error)
            return 0, None
        if isinstance(run, bool) or not isinstance(run, int) or not 0 <= run <= len(keys):
            if lease is not None:
                self._blocks.release(lease)
            raise StoreError(f"block lookup answered {run!r} blocks for {len(keys)} keys")
        return run, lease

    def _locate(self, key: BlockKey) -> StoreRef | None:
        return self._states.locate(key, self.local_machine)


def _looks_like_tokens(value: object) -> bool:
    if isinstance(value, np.ndarray):  # token ids are 1-D; keys as words are (n, 4) / (n, 32)
        return value.ndim == 1 and bool(np.issubdtype(value.dtype, np.integer))
    if isinstance(value, str | bytes | bytearray):
        raise InvalidArgument(
            "keys_or_tokens", f"must be block keys or token ids, got {type(value).__name__}"
        )
    if not isinstance(value, Sequence):
        raise InvalidArgument(
            "keys_or_tokens", f"must be a sequence or an array, got {type(value).__name__}"
        )
    if len(value) == 0:
        return False
    first = value[0]
    return isinstance(first, int | np.integer) and not isinstance(first, bool)
