"""kvstore as a vLLM KV connector: ``KVStoreConnector`` (vLLM's ``KVConnectorBase_V1``).

    python -m vllm.entrypoints.openai.api_server --model MODEL --block-size 128 \\
        --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                               "kv_connector_module_path": "kvstore.engine.vllm",
                               "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                               "kv_connector_extra_config": {"address": "127.0.0.1:50051"}}'

vLLM builds the connector twice: the SCHEDULER role (in the engine core) plans, the WORKER role
(next to the model) moves bytes. Both are thin maps of vLLM's objects onto the engine-neutral
core: ``kvstore.engine.scheduler`` (``PagedScheduler``), ``kvstore.engine.worker``
(``PagedWorker``) and ``kvstore.engine.groups`` (``EngineGroups``: what goes to which tier);
the extra config is ``kvstore.engine.settings.ConnectorSettings``. This is the only module
of kvstore that imports vLLM.

- Dense models (one full-attention group) and hybrid models (full attention plus sliding-window
  layers, e.g. Gemma-3, with vLLM's hybrid KV-cache manager on: the connector is ``SupportsHMA``).
  Full-attention blocks go to the block tier, a sliding window's state to the SWA tier; the tier
  keeps each model's layout (``kvstore.tier.records.Layout``) apart, so one ``kvstore up``
  serves many models. Other groups (Mamba state, ...) are refused at start-up.
- Hits are whole 128-token blocks (vLLM must run with ``block_size=128``), at most prompt − 1
  tokens (a hybrid model's: the longest prefix whose window the tier has). A dense model's load
  runs layer by layer within the step (``wait_for_layer_load`` waits for one layer; the fetcher
  process reads the next ones meanwhile); a hybrid model's is asynchronous (the request waits).
- A block that does not arrive, or arrives corrupt (the tier checks every shard), is recomputed
  with ``kv_load_failure_policy="recompute"``: a dense model's block through
  ``get_block_ids_with_load_errors``, a hybrid model's whole request through
  ``failed_recving`` (vLLM has no per-block path with several groups). With vLLM's default
  ("fail") such a request fails instead, so the connector warns at start-up.
- A tier that is down makes lookups misses after ``lookup_timeout_s`` (then misses without
  asking for ``retry_after_s``); saves to it fail in the background; the engine serves on.
- A hit is accepted only when loading it is faster than computing it, by this engine's
  measured rates (``kvstore.engine.worth``: loads timed by the worker side and reported with
  each step's output, prefill steps timed by the scheduler side); a fresh engine, until it has
  its own, weighs one block of the hit read over its load path (``kvstore.engine.probe``)
  against the prefill rate the tier's answer carries for its model (what this tenant's other
  engines reported with their lookups). A slow tier's hits are recomputed, and the log says
  so. ``load_only_if_faster: false`` always loads.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvstore.api.client import ClientFactory
from kvstore.engine.directfetch import DirectBlocks
from kvstore.engine.groups import FULL, SLIDING, CacheGroup, EngineGroups
from kvstore.engine.plan import StepPlan, describe
from kvstore.engine.probe import LoadProbe
from kvstore.engine.scheduler import PagedScheduler
from kvstore.engine.settings import ConnectorSettings, EngineLayout, engine_fingerprint
from kvstore.engine.worker import PagedWorker
from kvstore.engine.worth import LoadWorth
from kvstore.errors import ConfigError
from kvstore.keys import BLOCK_TOKENS

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class KVStoreMetadata(KVConnectorMetadata):
    """One step's plan, scheduler → worker."""

    plan: StepPlan


@dataclass
class KVStoreWorkerMeta(KVConnectorWorkerMetadata):
    """Worker → scheduler, with a step's output: (bytes, seconds) of each load finished."""

    loads: list[tuple[int, float]]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVStoreWorkerMeta)
        return KVStoreWorkerMeta(self.loads + other.loads)


def _settings(vllm_config: VllmConfig) -> ConnectorSettings:
    transfer = vllm_config.kv_transfer_config
    extra = dict(transfer.kv_connector_extra_config or {}) if transfer is not None else {}
    try:
        return ConnectorSettings.from_extra_config(extra)
    except ConfigError as error:
        raise ConfigError(f"kv_connector_extra_config.{error.field}", error.detail) from None


_SPEC_KINDS = {"FullAttentionSpec": FULL, "SlidingWindowSpec": SLIDING}


def _layer_order(name: str) -> tuple[Any, ...]:
    """Model order of vLLM layer names (``model.layers.10...`` after ``model.layers.9...``)."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def engine_groups(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> EngineGroups:
    """The engine's KV-cache groups as kvstore serves them (refused, with the reason, when it
    cannot serve them exactly)."""
    block_size = int(vllm_config.cache_config.block_size)
    if block_size != BLOCK_TOKENS:
        raise ConfigError(
            "block_size",
            f"kvstore blocks are {BLOCK_TOKENS} tokens; run vLLM with block_size={BLOCK_TOKENS} "
            f"(--block-size {BLOCK_TOKENS}), not {block_size}",
        )
    specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
    for spec in specs:
        kind = type(spec).__name__
        if kind not in _SPEC_KINDS:
            raise ConfigError(
                "kv_cache_spec",
                f"kvstore serves full and sliding-window attention, this model has {kind} "
                "(its state could not be restored exactly)",
            )
        if int(spec.block_size) != BLOCK_TOKENS:
            raise ConfigError("block_size", f"a {kind} group has {spec.block_size}-token blocks")
    pages = {int(spec.page_size_bytes) for spec in specs}
    if len(pages) != 1:
        raise ConfigError("page_size_bytes", f"KV-cache groups differ in page size: {pages}")
    names = sorted(
        (name for group in kv_cache_config.kv_cache_groups for name in group.layer_names),
        key=_layer_order,
    )
    index = {name: i for i, name in enumerate(names)}
    groups = tuple(
        CacheGroup(
            _SPEC_KINDS[type(group.kv_cache_spec).__name__],
            tuple(sorted(index[name] for name in group.layer_names)),
            getattr(group.kv_cache_spec, "sliding_window", None),
        )
        for group in kv_cache_config.kv_cache_groups
    )
    return EngineGroups(BLOCK_TOKENS, pages.pop(), tuple(names), groups)


def engine_layout(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, groups: EngineGroups
) -> EngineLayout:
    """What shapes this engine's block bytes, from what both roles are given."""
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if int(getattr(parallel, name, 1)) != 1:
            # Each rank holds a slice of every block (or some layers of it): the keys would need
            # the rank, and the scheduler's lookup every rank's answer. Refused, not guessed.
            raise ConfigError(
                name, f"kvstore's connector runs with {name} 1, got {getattr(parallel, name)}"
            )
    settings = _settings(vllm_config)
    spec_of = {
        name: group.kv_cache_spec
        for group in kv_cache_config.kv_cache_groups
        for name in group.layer_names
    }
    layers = tuple(
        (name, int(spec_of[name].num_kv_heads), int(spec_of[name].head_size))
        for name in groups.layer_names
    )
    first = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    return EngineLayout(
        model=settings.model_id or str(model.model),
        revision=model.revision,
        dtype=str(first.dtype),
        block_tokens=groups.block_tokens,
        layers=layers,
        backend=f"{current_platform.device_type}:page={groups.page_bytes}",
        tp_rank=0,
        tp_size=1,
        extra={
            "cache_dtype": str(vllm_config.cache_config.cache_dtype),
            "groups": [[g.kind, list(g.layers), g.window] for g in groups.groups],
        },
    )


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """kvstore's vLLM connector (both roles; vLLM makes one object per role)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = _settings(vllm_config)
        self.groups = engine_groups(vllm_config, kv_cache_config)
        self.layout = engine_layout(vllm_config, kv_cache_config, self.groups)
        fingerprint = engine_fingerprint(self.layout)
        self.tier_layout = self.groups.layout(fingerprint)
        self._layer_names = list(self.groups.layer_names)
        self._layer_index = {name: i for i, name in enumerate(self._layer_names)}
        self.scheduler: PagedScheduler | None = None
        self.worker: PagedWorker | None = None
        self._live: dict[str, Request] = {}
        self._seen_finished: set[str] = set()
        self._deferred: set[str] = set()
        mode = self.groups.hit_mode
        if self.settings.hit_mode is not None and self.settings.hit_mode != mode:
            raise ConfigError(
                "hit_mode",
                f"this model needs {mode!r} hits (its attention is computed exactly"
                f"{' over a sliding window' if self.groups.hybrid else ''}), not "
                f"{self.settings.hit_mode!r}; leave hit_mode out",
            )
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail")
        if role == KVConnectorRole.SCHEDULER:
            if policy != "recompute":
                log.warning(
                    'kvstore: kv_load_failure_policy is %r; set it to "recompute" so a block '
                    "that fails to load is recomputed instead of failing its request",
                    policy,
                )
            client = self._client(self.settings.lookup_timeout_s)()
            worth = LoadWorth() if self.settings.load_only_if_faster else None
            self.scheduler = PagedScheduler(
                client,
                self.groups.group_fingerprint(fingerprint),
                mode=mode,
                groups=self.groups,
                traffic_class=self.settings.traffic_class,
                retry_after_s=self.settings.retry_after_s,
                load=self.settings.load,
                save=self.settings.save,
                worth=worth,
                block_bytes=self.tier_layout.block_bytes,
                # A fresh engine's first hit: one block read over the load path, timed (the
                # fetcher's own direct reader, a short timeout: it holds the scheduler loop).
                probe=None
                if worth is None
                else LoadProbe(
                    client, self.tier_layout.block_bytes, direct=DirectBlocks(timeout_s=1.0)
                ),
            )
            log.info(
                "kvstore: %s, %s, %d layers (%s), %s hits; blocks of %d B%s; tier %s",
                self.layout.model,
                self.layout.dtype,
                len(self._layer_names),
                ", ".join(f"{g.kind}×{len(g.layers)}" for g in self.groups.groups),
                mode,
                self.tier_layout.block_bytes,
                f", window states of {self.tier_layout.state_bytes} B"
                if self.groups.hybrid
                else "",
                self.settings.address,
            )

    def _client(self, timeout_s: float) -> ClientFactory:
        s = self.settings
        return ClientFactory(
            s.address,
            s.token(),
            s.tls_root_cert,
            s.tls_client_cert,
            s.tls_client_key,
            timeout_s,
            layout=self.tier_layout,
        )

    # === worker side ===========================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [name for name in self._layer_names if name not in kv_caches]
        if missing:
            raise ConfigError("kv_caches", f"no KV cache tensor for layers {missing}")
        tensors = [kv_caches[name] for name in self._layer_names]
        page = self.groups.page_bytes
        for name, tensor in zip(self._layer_names, tensors, strict=True):
            row = tensor[0].numel() * tensor.element_size()
            if row != page:
                # The fingerprint says one block is one row of ``page`` bytes; anything else
                # is a layout the keys do not name.
                raise ConfigError(
                    "kv_caches", f"{name}: a block row is {row} B, the KV cache spec says {page} B"
                )
        factory = self._client(self.settings.call_timeout_s)
        writer = factory()
        self.worker = PagedWorker(
            tensors,
            factory,
            writer,
            groups=self.groups,
            staging_bytes=self.settings.staging_bytes,
            staging_dir=self.settings.staging_dir,
            layer_timeout_s=self.settings.layer_timeout_s,
            max_pending_save_bytes=self.settings.max_pending_save_bytes,
            loads_in_place=self.settings.loads_in_place,
            views=self._bound_views(),
        )
        try:
            serving = writer.serving()
        except Exception as error:  # noqa: BLE001 - a tier down at start-up is a miss later
            serving, why = False, describe(error)
        else:
            why = "not serving"
        if not serving:
            log.warning(
                "kvstore: tier %s not reachable at start-up (%s)", self.settings.address, why
            )

    def _bound_views(self) -> list[torch.Tensor]:
        """The tensors vLLM's attention layers compute on for our layers (``layer.kv_cache``,
        bound before the connector is handed the cache): the same tensors, or views of their
        own (kernel blocks) that a cache moved into shared memory must move with."""
        import torch

        context = self._vllm_config.compilation_config.static_forward_context
        views = []
        for name in self._layer_names:
            held = getattr(context.get(name), "kv_cache", None)
            for tensor in held if isinstance(held, list | tuple) else (held,):
                if isinstance(tensor, torch.Tensor):
                    views.append(tensor)
        return views

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # The step starts here, before the forward: vLLM calls ``start_load_kv`` after the
        # forward when the step has no synchronous load, but this step's saves are gathered
        # during it.
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None:
            assert isinstance(connector_metadata, KVStoreMetadata)
            self.worker.start(connector_metadata.plan)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Nothing more to start: the loads went to the fetcher when the step was bound."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_layer(self._layer_index[layer_name])

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        if self.worker is not None:
            self.worker.save_layer(self._layer_index[layer_name])

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.finish_step()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.worker is None:
            return KVConnectorTransferResults()
        # vLLM accepts only ids it has passed here: one whose report comes first waits for it.
        self._seen_finished.update(finished_req_ids)
        ready = self.worker.finished_saving() | self._deferred
        sending = ready & self._seen_finished
        self._deferred = ready - sending
        self._seen_finished -= sending
        loaded, failed = self.worker.finished_loading()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=loaded, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return (results.finished_sending or None), (results.finished_recving or None)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        figures = self.worker.take_load_figures() if self.worker is not None else []
        return KVStoreWorkerMeta(figures) if figures else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors() if self.worker is not None else set()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    # === scheduler side ========================================================================

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        self._live[request.request_id] = request
        prompt = request.prompt_token_ids or []
        if not prompt:
            return 0, False
        tokens = self.scheduler.matched_tokens(request.request_id, prompt, num_computed_tokens)
        return tokens, bool(tokens) and self.scheduler.asynchronous_loads

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        tables = blocks.get_block_ids()
        self.scheduler.allocated(request.request_id, tables, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            live = self._live.get(new.req_id)
            tokens = live.all_token_ids if live is not None else (new.prompt_token_ids or [])
            self.scheduler.step(
                new.req_id,
                tokens,
                new.num_computed_tokens + scheduled.get(new.req_id, 0),
                table=new.block_ids,
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            live = self._live.get(req_id)
            if live is None:
                continue
            new_ids = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            self.scheduler.step(
                req_id,
                live.all_token_ids,
                cached.num_computed_tokens[i] + scheduled.get(req_id, 0),
                table=new_ids if resumed and new_ids is not None else None,
                appended=() if resumed or new_ids is None else new_ids,
            )
        plan = self.scheduler.build()
        worth = self.scheduler.worth
        if worth is not None:
            worth.step_planned(scheduler_output.total_num_scheduled_tokens, bool(plan.loads))
        return KVStoreMetadata(plan)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        worth = self.scheduler.worth if self.scheduler is not None else None
        if worth is not None and isinstance(meta, KVStoreWorkerMeta):
            for nbytes, seconds in meta.loads:
                worth.loaded(nbytes, seconds)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._live.pop(request.request_id, None)
        if self.scheduler is None:
            return False, None
        return self.scheduler.finished(request.request_id), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])
