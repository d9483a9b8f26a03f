"""kvstore as a vLLM KV connector: ``KVStoreConnector`` (vLLM's ``KVConnectorBase_V1``).

    python -m vllm.entrypoints.openai.api_server --model MODEL --block-size 128 \\
        --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                               "kv_connector_module_path": "kvstore.integrations.vllm",
                               "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                               "kv_connector_extra_config": {"address": "127.0.0.1:50051"}}'

vLLM builds the connector twice: the SCHEDULER role (in the engine core) plans, the WORKER role
(next to the model) moves bytes. Both are thin maps of vLLM's objects onto the engine-neutral
core, ``kvstore.integrations.paged`` (``PagedScheduler`` / ``PagedWorker``); the extra config is
``kvstore.integrations.settings.ConnectorSettings``. This is the only module of kvstore that
imports vLLM.

- Hits are whole 128-token blocks (vLLM must run with ``block_size=128``), at most prompt − 1
  tokens, loaded synchronously layer by layer within the step (``wait_for_layer_load`` waits for
  one layer; the fetcher process reads the next ones meanwhile).
- A block that does not arrive, or arrives corrupt (the tier checks every shard), is reported
  by ``get_block_ids_with_load_errors``; with ``kv_load_failure_policy="recompute"`` vLLM
  recomputes it and discards what the step computed from it. With vLLM's default ("fail") such
  a request fails instead, so the connector warns at start-up.
- A tier that is down makes lookups misses after ``lookup_timeout_s`` (then misses without
  asking for ``retry_after_s``); saves to it fail in the background; the engine serves on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstore.api.client import ClientFactory
from kvstore.errors import ConfigError
from kvstore.integrations.paged import PagedScheduler, PagedWorker, StepPlan, describe
from kvstore.integrations.settings import ConnectorSettings, EngineLayout, engine_fingerprint
from kvstore.keys import BLOCK_TOKENS

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class KVStoreMetadata(KVConnectorMetadata):
    """One step's plan, scheduler → worker."""

    plan: StepPlan


def _settings(vllm_config: VllmConfig) -> ConnectorSettings:
    transfer = vllm_config.kv_transfer_config
    extra = dict(transfer.kv_connector_extra_config or {}) if transfer is not None else {}
    try:
        return ConnectorSettings.from_extra_config(extra)
    except ConfigError as error:
        raise ConfigError(f"kv_connector_extra_config.{error.field}", error.detail) from None


def engine_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> EngineLayout:
    """What shapes this engine's block bytes, from what both roles are given."""
    from vllm.platforms import current_platform

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            "kv_cache_groups",
            f"kvstore loads models with one KV cache group, this one has {len(groups)} "
            "(hybrid or sliding-window attention)",
        )
    spec = groups[0].kv_cache_spec
    if type(spec).__name__ != "FullAttentionSpec":
        raise ConfigError(
            "kv_cache_spec",
            f"kvstore loads full attention only, this model has {type(spec).__name__}",
        )
    block_size = int(vllm_config.cache_config.block_size)
    if block_size != BLOCK_TOKENS:
        raise ConfigError(
            "block_size",
            f"kvstore blocks are {BLOCK_TOKENS} tokens; run vLLM with block_size={BLOCK_TOKENS} "
            f"(--block-size {BLOCK_TOKENS}), not {block_size}",
        )
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
    layers = tuple(
        (name, int(spec.num_kv_heads), int(spec.head_size)) for name in groups[0].layer_names
    )
    return EngineLayout(
        model=settings.model_id or str(model.model),
        revision=model.revision,
        dtype=str(spec.dtype),
        block_tokens=block_size,
        layers=layers,
        backend=f"{current_platform.device_type}:page={spec.page_size_bytes}",
        tp_rank=0,
        tp_size=1,
        extra={"cache_dtype": str(vllm_config.cache_config.cache_dtype)},
    )


class KVStoreConnector(KVConnectorBase_V1):
    """kvstore's vLLM connector (both roles; vLLM makes one object per role)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = _settings(vllm_config)
        self.layout = engine_layout(vllm_config, kv_cache_config)
        self._layer_names = [name for name, _, _ in self.layout.layers]
        self._layer_index = {name: i for i, name in enumerate(self._layer_names)}
        self.scheduler: PagedScheduler | None = None
        self.worker: PagedWorker | None = None
        self._live: dict[str, Request] = {}
        self._seen_finished: set[str] = set()
        self._deferred: set[str] = set()
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail")
        if role == KVConnectorRole.SCHEDULER:
            if policy != "recompute":
                log.warning(
                    'kvstore: kv_load_failure_policy is %r; set it to "recompute" so a block '
                    "that fails to load is recomputed instead of failing its request",
                    policy,
                )
            client = self._client(self.settings.lookup_timeout_s)()
            self.scheduler = PagedScheduler(
                client,
                engine_fingerprint(self.layout),
                mode=self.settings.hit_mode,
                traffic_class=self.settings.traffic_class,
                retry_after_s=self.settings.retry_after_s,
                load=self.settings.load,
                save=self.settings.save,
            )
            log.info(
                "kvstore: %s, %s, %d layers; tier %s",
                self.layout.model,
                self.layout.dtype,
                len(self._layer_names),
                self.settings.address,
            )

    def _client(self, timeout_s: float) -> ClientFactory:
        s = self.settings
        return ClientFactory(
            s.address, s.token(), s.tls_root_cert, s.tls_client_cert, s.tls_client_key, timeout_s
        )

    # === worker side ===========================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [name for name in self._layer_names if name not in kv_caches]
        if missing:
            raise ConfigError("kv_caches", f"no KV cache tensor for layers {missing}")
        tensors = [kv_caches[name] for name in self._layer_names]
        page = int(self._kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes)
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
            staging_bytes=self.settings.staging_bytes,
            staging_dir=self.settings.staging_dir,
            layer_timeout_s=self.settings.layer_timeout_s,
            max_pending_save_bytes=self.settings.max_pending_save_bytes,
        )
        self._check_block_size(writer, self.worker.block_bytes)

    def _check_block_size(self, client: Any, engine_bytes: int) -> None:
        try:
            tier_bytes = client.stats().extra.get("block_bytes")
        except Exception as error:  # noqa: BLE001 - a tier down at start-up is a miss later
            log.warning(
                "kvstore: tier %s not reachable at start-up (%s)",
                self.settings.address,
                describe(error),
            )
            return
        if tier_bytes is not None and int(tier_bytes) != engine_bytes:
            raise ConfigError(
                "block_bytes",
                f"the tier at {self.settings.address} stores blocks of {tier_bytes} B; this "
                f"engine's blocks are {engine_bytes} B: start it with "
                f"`kvstore up --block-bytes {engine_bytes}`",
            )
        log.info("kvstore: engine blocks of %d B, tier agrees", engine_bytes)

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

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        # vLLM accepts only ids it has passed here: one whose report comes first waits for it.
        self._seen_finished.update(finished_req_ids)
        ready = self.worker.finished_saving() | self._deferred
        sending = ready & self._seen_finished
        self._deferred = ready - sending
        self._seen_finished -= sending
        return (sending or None), None

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
        return tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        (block_ids,) = blocks.get_block_ids()
        self.scheduler.allocated(request.request_id, block_ids, num_external_tokens)

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
                table=new.block_ids[0],
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            live = self._live.get(req_id)
            if live is None:
                continue
            new_ids = cached.new_block_ids[i]
            appended = new_ids[0] if new_ids is not None else []
            resumed = req_id in cached.resumed_req_ids
            self.scheduler.step(
                req_id,
                live.all_token_ids,
                cached.num_computed_tokens[i] + scheduled.get(req_id, 0),
                table=appended if resumed else None,
                appended=() if resumed else appended,
            )
        return KVStoreMetadata(self.scheduler.build())

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._live.pop(request.request_id, None)
        if self.scheduler is None:
            return False, None
        return self.scheduler.finished(request.request_id), None
