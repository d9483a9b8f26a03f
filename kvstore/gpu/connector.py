"""An engine-facing facade shaped like vLLM's KV connector v1, with no vLLM dependency.

An engine team meets the surface it knows. Scheduler side (decides, never touches bytes):

- ``get_num_new_matched_tokens(request, num_computed_tokens) -> (tokens, load_async)``: asks the
  tier for the hit plan (SPEC §5; cached per request, so asking twice costs one query);
- ``update_state_after_alloc(request, block_ids, slot, num_external_tokens)``: the engine has
  allocated the block table and state slot; the fetch into staging **starts now**, before the
  step, in the fetcher process;
- ``schedule_prefill_save`` / ``schedule_decode_snapshot``: what this step saves (SPEC §6);
- ``build_connector_meta()``: everything decided since the last step, for the worker side;
- ``request_finished(request, block_ids, slot) -> bool``: True when the connector still reads
  the request's blocks or slot (the engine frees them once ``get_finished`` says so).

Worker side (one forward pass): ``bind_connector_metadata``, ``start_load_kv`` (swap-in begins),
``wait_for_layer_load(layer)`` before each layer, ``save_kv_layer(layer)`` after it,
``wait_for_save()`` at the end; then ``get_finished(finished_req_ids)`` and
``get_block_ids_with_load_errors()``. Layers are model layer indices (ints), not names.

Load errors: a block whose bytes did not arrive is reported so the engine recomputes it, and its
pool row is never marked loaded. A missing SWA state in standard mode reports the last hit block
(SPEC §5: back off one block and recompute it; those 128 tokens rebuild the window).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.errors import ConfigError, InvalidArgument, KVStoreError
from kvstore.gpu.fetcher import Fetcher, LayerGate, StagedFetch
from kvstore.gpu.pools import DevicePools
from kvstore.gpu.save import SaveBatch, Saver, SaveResult, SaveSpec, SaveTicket, StateSave
from kvstore.gpu.staging import StagingArea
from kvstore.gpu.swapin import LayerLoad, LoadResult, LoadTarget, SwapIn
from kvstore.hitplan import MODES, STANDARD, decode_snapshot_anchor, prefill_store_position
from kvstore.keys import BLOCK_TOKENS, BlockKey, block_keys
from kvstore.tier.protocols import HitSource, ReaderFactory, TierWriter
from kvstore.tier.records import HitAnswer, HitRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineRequest:
    """What the connector needs to know about a request: its id and its tokens so far."""

    request_id: str
    token_ids: tuple[int, ...]
    traffic_class: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidArgument("request_id", "must be a non-empty string")
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class ConnectorConfig:
    """Knobs of the engine side (validated; ``from_env`` is the only env read)."""

    staging_bytes: int = 256 * 1024 * 1024
    staging_dir: str = "/dev/shm"
    #: Hit mode asked of the tier: ``standard`` or ``bounded-replay``.
    mode: str = STANDARD
    #: How long ``wait_for_layer_load`` waits for one layer before raising ``LoadTimeout``.
    layer_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if isinstance(self.staging_bytes, bool) or not isinstance(self.staging_bytes, int):
            raise ConfigError("staging_bytes", "must be an integer")
        if self.staging_bytes < 1 << 20:
            raise ConfigError("staging_bytes", f"must be at least 1 MiB, got {self.staging_bytes}")
        if self.mode not in MODES:
            raise ConfigError("mode", f"must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.layer_timeout_s > 0:
            raise ConfigError("layer_timeout_s", f"must be > 0, got {self.layer_timeout_s}")

    @classmethod
    def from_env(
        cls, environ: dict[str, str] | None = None, prefix: str = "KVSTORE_GPU_"
    ) -> ConnectorConfig:
        from kvstore.config import from_env  # the one environment loader

        return from_env(cls, prefix, environ)


@dataclass(frozen=True)
class LoadPlan:
    """One request's load, decided by the scheduler side."""

    request_id: str
    block_ids: tuple[int, ...]
    keys: tuple[BlockKey, ...]
    slot: int | None
    anchor: int | None
    #: Block to report when the state does not arrive (standard mode), else None.
    backoff_block: int | None
    #: Lease the hit query took on the blocks; released once they are read.
    lease_id: str | None = None


@dataclass(frozen=True)
class Snapshot:
    request_id: str
    slot: int
    position: int


@dataclass
class ConnectorMetadata:
    """What the scheduler side decided for one step."""

    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)


class KVConnector:
    """Scheduler and worker halves in one object (one process, one device)."""

    def __init__(
        self,
        pools: DevicePools,
        *,
        reader_factory: ReaderFactory,
        writer: TierWriter,
        hit_source: HitSource,
        config: ConnectorConfig | None = None,
        gate: LayerGate | None = None,
    ) -> None:
        self.pools = pools
        self.geometry = pools.geometry
        self.config = config or ConnectorConfig()
        self._fingerprint = self.geometry.fingerprint()
        self._hits = hit_source
        self.area = StagingArea(self.config.staging_bytes, self.config.staging_dir)
        try:
            self.fetcher = Fetcher(reader_factory, self.area, self.geometry, gate=gate)
            self.swapin = SwapIn(pools, area=self.area)
            self.saver = Saver(pools, writer)
        except BaseException:
            self.area.close()
            raise
        self._lock = threading.Lock()
        # Scheduler side.
        self._answers: dict[str, HitAnswer] = {}
        self._next = ConnectorMetadata()
        self._staged: dict[str, tuple[StagedFetch, LoadTarget]] = {}
        self._early_errors: set[int] = set()
        # Worker side.
        self._meta: ConnectorMetadata | None = None
        self._loads: list[tuple[LoadPlan, LayerLoad]] = []
        self._batch: SaveBatch | None = None
        self._tickets: dict[str, list[SaveTicket]] = {}
        self._finishing: set[str] = set()
        self._load_errors: set[int] = set()
        self._state_errors: set[str] = set()
        self._loaded: set[str] = set()
        self._snapshotted: dict[str, int] = {}
        self._slots: dict[str, int] = {}
        self.load_results: list[LoadResult] = []
        self.save_results: list[SaveResult] = []

    # === scheduler side ========================================================================

    def _answer(self, request: EngineRequest) -> HitAnswer:
        answer = self._answers.get(request.request_id)
        if answer is None:
            answer = self._hits.query_hit(
                HitRequest(
                    token_ids=list(request.token_ids),
                    mode=self.config.mode,
                    traffic_class=request.traffic_class,
                    take_lease=True,
                )
            )
            self._answers[request.request_id] = answer
        return answer

    def _keys(self, request: EngineRequest) -> list[BlockKey]:
        return block_keys(self._fingerprint, request.token_ids)

    def get_num_new_matched_tokens(
        self, request: EngineRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` the tier can provide, and False: loads are
        layer-wise within the step, not asynchronous across steps."""
        hit = self._answer(request).plan.hit_tokens
        first = -(-int(num_computed_tokens) // BLOCK_TOKENS) * BLOCK_TOKENS
        return max(hit - first, 0), False

    def update_state_after_alloc(
        self,
        request: EngineRequest,
        block_ids: Sequence[int],
        slot: int | None,
        num_external_tokens: int,
    ) -> None:
        """Start fetching the ``num_external_tokens`` the engine accepted into ``block_ids``.

        ``block_ids`` is the request's block table (logical order); the loaded blocks are the
        last ``num_external_tokens / 128`` of the hit.
        """
        if num_external_tokens <= 0:
            return
        answer = self._answer(request)
        plan = answer.plan
        if num_external_tokens % BLOCK_TOKENS or num_external_tokens > plan.hit_tokens:
            raise InvalidArgument(
                "num_external_tokens",
                f"{num_external_tokens} is not whole blocks of the hit ({plan.hit_tokens})",
            )
        hit_blocks = plan.hit_tokens // BLOCK_TOKENS
        first = hit_blocks - num_external_tokens // BLOCK_TOKENS
        if len(block_ids) < hit_blocks:
            raise InvalidArgument(
                "block_ids", f"{len(block_ids)} blocks, the hit needs {hit_blocks}"
            )
        keys = list(answer.hit_block_keys)
        if len(keys) < hit_blocks:  # the tier did not name them: they are the prompt's own
            keys = self._keys(request)
        keys = keys[:hit_blocks]
        with_state = plan.swa_hit and slot is not None and plan.swa_position is not None
        load = LoadPlan(
            request_id=request.request_id,
            block_ids=tuple(int(b) for b in block_ids[first:hit_blocks]),
            keys=tuple(keys[first:hit_blocks]),
            slot=slot if with_state else None,
            anchor=plan.swa_position if with_state else None,
            backoff_block=(
                int(block_ids[hit_blocks - 1])
                if with_state and self.config.mode == STANDARD
                else None
            ),
            lease_id=answer.lease_id,
        )
        # The swap-in target (keys validated) is built now, off the step's critical path.
        target = LoadTarget(load.request_id, load.block_ids, load.keys, load.slot, load.anchor)
        try:
            staged = self.fetcher.submit(
                load.keys,
                lease_id=answer.lease_id,
                state_key=keys[hit_blocks - 1] if with_state else None,
                state_position=load.anchor,
            )
        except KVStoreError as error:
            # No room or no fetcher: the engine recomputes these blocks; nothing was written.
            log.warning("load of %s not started: %s", request.request_id, error)
            with self._lock:
                self._early_errors.update(load.block_ids)
            self._release(load.lease_id)
            return
        with self._lock:
            self._staged[request.request_id] = (staged, target)
            self._next.loads.append(load)

    def schedule_prefill_save(
        self, request: EngineRequest, block_ids: Sequence[int], slot: int | None
    ) -> None:
        """This step finishes the prompt: save its new full blocks and the aligned state."""
        keys = self._keys(request)
        if len(block_ids) < len(keys):
            raise InvalidArgument("block_ids", f"{len(block_ids)} blocks for {len(keys)} full")
        answer = self._answers.get(request.request_id)
        first = answer.plan.block_hit_tokens // BLOCK_TOKENS if answer else 0
        state = None
        position = prefill_store_position(request.num_tokens)
        if slot is not None and position is not None:
            state = StateSave(
                slot=slot,
                key=keys[position // BLOCK_TOKENS - 1],
                position=position,
                written=request.num_tokens,
            )
        spec = SaveSpec(
            request_id=request.request_id,
            block_ids=tuple(int(b) for b in block_ids[first : len(keys)]),
            keys=tuple(keys[first:]),
            state=state,
            traffic_class=request.traffic_class,
        )
        with self._lock:
            self._next.saves.append(spec)

    def schedule_decode_snapshot(
        self, request: EngineRequest, block_ids: Sequence[int], slot: int
    ) -> None:
        """This step takes the request across a 128-token boundary (its length is now
        ``len(request.token_ids)``, ≤ 5 past the boundary): save the completed block and copy
        the ring into the copy region; the state is stored from that copy at request end."""
        position = request.num_tokens
        boundary = decode_snapshot_anchor(position, max_backtracking=self.geometry.max_backtracking)
        index = boundary // BLOCK_TOKENS - 1
        key = self._keys(request)[index]
        spec = SaveSpec(
            request_id=request.request_id,
            block_ids=(int(block_ids[index]),),
            keys=(key,),
            traffic_class=request.traffic_class,
        )
        with self._lock:
            self._next.saves.append(spec)
            self._next.snapshots.append(Snapshot(request.request_id, slot, position))

    def build_connector_meta(self) -> ConnectorMetadata:
        with self._lock:
            meta, self._next = self._next, ConnectorMetadata()
        return meta

    def request_finished(
        self, request: EngineRequest, block_ids: Sequence[int], slot: int | None
    ) -> bool:
        """The request is done. Returns True while the connector still reads its blocks or slot
        (free them when ``get_finished`` lists it)."""
        self._answers.pop(request.request_id, None)
        with self._lock:
            snapshotted = self._snapshotted.pop(request.request_id, None)
            # Preempted or aborted before its step ran: drop the fetch, give its region back.
            pair = self._staged.pop(request.request_id, None)
            dropped = [x for x in self._next.loads if x.request_id == request.request_id]
            self._next.loads = [x for x in self._next.loads if x.request_id != request.request_id]
        if pair is not None:
            pair[0].release()
        for load in dropped:
            self._release(load.lease_id)
        if slot is not None and snapshotted == slot:
            copy_at = self.pools.snapshot_position(slot)
            assert copy_at is not None
            anchor = decode_snapshot_anchor(
                copy_at, max_backtracking=self.geometry.max_backtracking
            )
            key = self._keys(request)[anchor // BLOCK_TOKENS - 1]
            state = StateSave(slot=slot, key=key, position=anchor, from_snapshot=True)
            ticket = self.saver.save(
                SaveSpec(request.request_id, state=state, traffic_class=request.traffic_class)
            )
            with self._lock:
                self._tickets.setdefault(request.request_id, []).append(ticket)
        with self._lock:
            pending = any(not t.done() for t in self._tickets.get(request.request_id, []))
            if slot is not None:
                self._slots[request.request_id] = slot
            if pending:
                self._finishing.add(request.request_id)
            else:
                self._collect_saves(request.request_id)
        return pending

    # === worker side ===========================================================================

    def bind_connector_metadata(self, meta: ConnectorMetadata) -> None:
        self._meta = meta

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self) -> None:
        """Begin this step's swap-ins (their fetches started at ``update_state_after_alloc``)
        and open this step's save batch."""
        meta = self._meta or ConnectorMetadata()
        for plan in meta.loads:
            with self._lock:
                staged, target = self._staged.pop(plan.request_id)
            self._loads.append((plan, self.swapin.submit(staged, target)))
        self._batch = self.saver.begin(meta.saves) if meta.saves else None

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until ``layer`` of every load of this step is usable (CUDA: stream-ordered)."""
        for _, load in self._loads:
            load.wait(layer, timeout=self.config.layer_timeout_s)

    def save_kv_layer(self, layer: int) -> None:
        """``layer`` is computed: start reading its rows for this step's saves."""
        if self._batch is not None:
            self._batch.gather_layer(layer)

    def wait_for_save(self) -> None:
        """End of the forward pass: take decode snapshots, finish this step's gathers (CUDA: the
        compute stream waits on them), and collect the loads' outcomes."""
        meta = self._meta or ConnectorMetadata()
        for snap in meta.snapshots:
            self.pools.snapshot_window(snap.slot, snap.position)
            with self._lock:
                self._snapshotted[snap.request_id] = snap.slot
        if self._batch is not None:
            tickets = self._batch.seal()
            with self._lock:
                for ticket in tickets:
                    self._tickets.setdefault(ticket.request_id, []).append(ticket)
            self._batch = None
        for plan, load in self._loads:
            result = load.result(timeout=self.config.layer_timeout_s)
            self._release(plan.lease_id)
            self.load_results.append(result)
            with self._lock:
                self._load_errors.update(result.failed_block_ids)
                if result.state_failed:
                    self._state_errors.add(plan.request_id)
                    if plan.backoff_block is not None:
                        self._load_errors.add(plan.backoff_block)
                self._loaded.add(plan.request_id)
        self._loads = []

    def _release(self, lease_id: str | None) -> None:
        if lease_id is None:
            return
        try:
            self._hits.release_lease(lease_id)
        except Exception:  # noqa: BLE001 - an unreleased lease only expires later
            log.warning("lease %s not released", lease_id, exc_info=True)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests whose saves are all in the tier — free their blocks now, requests whose
        loads completed since the last call)."""
        with self._lock:
            self._finishing.update(r for r in finished_req_ids if r in self._tickets)
            sending = {
                request
                for request in self._finishing
                if all(t.done() for t in self._tickets.get(request, []))
            }
            for request in sending:
                self._finishing.discard(request)
                self._collect_saves(request)
            received, self._loaded = self._loaded, set()
        return sending, received

    def _collect_saves(self, request_id: str) -> None:
        for ticket in self._tickets.pop(request_id, []):
            self.save_results.append(ticket.result())
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            # Nothing reads the slot any more: its next sequence starts from a clean origin.
            self.pools.reset_slot(slot)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks that failed to load since the last call: recompute them."""
        with self._lock:
            errors = self._load_errors | self._early_errors
            self._load_errors, self._early_errors = set(), set()
        return errors

    def get_requests_with_state_errors(self) -> set[str]:
        """Requests whose SWA state was found by the plan but did not arrive."""
        with self._lock:
            errors, self._state_errors = self._state_errors, set()
        return errors

    def wait_saves(self, timeout: float | None = None) -> list[SaveResult]:
        """Wait for every save handed out so far (shutdown, tests)."""
        with self._lock:
            tickets = [t for group in self._tickets.values() for t in group]
        return [t.result(timeout) for t in tickets]

    def shutdown(self) -> None:
        self.saver.close()
        self.swapin.close()
        self.fetcher.close()
        self.area.close()

    def __enter__(self) -> KVConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
