"""CacheBlend as a vLLM (0.32, V1) KV connector: blended chunk caches written into vLLM's blocks.

Loaded by ``--kv-transfer-config`` (``cacheblend serve`` writes it; user guide: docs/vllm.md).

* vLLM runs the connector's two halves in different processes (scheduler side in
  EngineCore, worker side in VllmWorker), so they share state through files: chunk caches
  through the core's KV store (``"store"``), the texts of known passages through a
  registry (``"passages"``: a JSON-lines file, or a ``redis://`` set shared by servers).
* Scheduler side (:mod:`.vllm_scheduler`): chunks are found in a request's token ids
  (client-given ``"chunks"`` spans, else registered passages tokenized as the core
  tokenizes a chunk); a prompt of at least ``min_tokens`` holding one has
  ``len(prompt) - 1`` tokens loaded: vLLM computes the last.
* Worker side (:mod:`.vllm_worker`): a core :class:`~cacheblend.engine.Engine` on the same
  folder and dtype, its products on vLLM's own layers when vLLM loads with ``load_format="cacheblend"``
  (:mod:`.vllm_model`), runs the fused prefill through its chunk-cache service (store
  lookups, verification, retries); the fused K/V are written into the request's paged blocks
  (:mod:`.paged`); on failure the blocks are reported as load errors, which vLLM recomputes
  (``kv_load_failure_policy="recompute"``) or fails the request over, never decoding zeroes.

Per request, ``kv_transfer_params`` may carry ``"chunks"`` (``[start, end)`` token spans),
any selection option of :class:`~cacheblend.config.RequestOptions` (``method``:
``"blend"``, ``"reuse"`` or ``"full"``; ``recompute_ratio``, ``check_layers``,
``deviation``, ``gradual``, ...), ``"receipt"`` (a tag a streaming client fetches the
answer's marker by, :mod:`.vllm_receipts`), or an operation: ``{"cacheblend": "ingest", "sink": s}``
stores vLLM's own K/V of the chunk after ``s`` sink ids; ``{"cacheblend": "release",
"ids": [...]}`` deletes a chunk's entry; ``{"cacheblend": "ping"}`` asks who is there.
They are checked by :func:`.kv_params.parse_kv_params`: the OpenAI server answers a bad
one with HTTP 400 (:mod:`.vllm_http`), and here a request with a bad one runs as plain
vLLM, with the reason in the log (the scheduler must never raise).  Run vLLM with
``enable_prefix_caching=False``: blended blocks must not enter vLLM's prefix cache as if
exact, so with it on, blending is off (every request plain vLLM, said in the log).  K/V
are written through the attention backend's own cache-update op; at start-up the worker
checks its caches are on the CPU, the layout (:mod:`.paged`) and vLLM's attention reading
a reference chunk back (:mod:`.readback`); a failure makes every request plain vLLM.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..config import ConnectorConfig, chunk_sink_for
from .paged import paged_views
from .registry import REDIS_PASSAGES_KEY, ChunkMatcher, read_passages, register_passages
from .vllm_meta import BlendReceipts, CacheBlendMeta, LayoutReport
from .vllm_receipts import ReceiptBox, receipt_dir
from .vllm_scheduler import SchedulerSide
from .vllm_worker import WorkerSide

__all__ = ["REDIS_PASSAGES_KEY", "CacheBlendConnector", "ChunkMatcher", "paged_views", "read_passages",
           "register_passages"]


class CacheBlendConnector(KVConnectorBase_V1):
    """Reports known-chunk prompts as loaded and writes their CacheBlend-fused K/V.

    vLLM's interface, translated: each call goes to the side of the connector that vLLM runs
    it on, :class:`.vllm_scheduler.SchedulerSide` or :class:`.vllm_worker.WorkerSide`.
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = ConnectorConfig.parse(self._kv_transfer_config.kv_connector_extra_config)
        model = vllm_config.model_config
        block_size: int = vllm_config.cache_config.block_size
        # both sides resolve it alike, and every answer names it (a RemoteEngine adopts it)
        chunk_sink = chunk_sink_for(config.chunk_sink, model.hf_config.model_type)
        # a chunk right behind the sink is reused exactly unless chunks are stored at another
        # precision (cache/segments.py); the marker says so, for RemoteEngine's receipt
        exact_behind_sink = config.kv_dtype is None or getattr(torch, config.kv_dtype) == model.dtype
        # streamed answers' receipts, fetched through the API server's guard (vllm_receipts.py)
        engine_id = getattr(self._kv_transfer_config, "engine_id", None)
        receipts = ReceiptBox(receipt_dir(engine_id)) if role == KVConnectorRole.SCHEDULER and engine_id else None
        self.scheduler = SchedulerSide(config, model_dir=model.model, block_size=block_size,
                                       num_layers=model.get_total_num_hidden_layers(), chunk_sink=chunk_sink,
                                       connector=type(self).__name__,
                                       prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
                                       exact_behind_sink=exact_behind_sink, receipts=receipts,
                                       unsupported=_unsupported(vllm_config))
        self.worker = WorkerSide(config, model_dir=model.model, dtype=model.dtype, chunk_sink=chunk_sink,
                                 block_size=block_size, vllm_config=vllm_config, kv_cache_config=kv_cache_config)

    # ---- scheduler side ------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self.scheduler.take_layout_reports(metadata)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """None: the request waits for a later step (this step's blend budget is spent)."""
        return self.scheduler.loaded_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.scheduler.build_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Blocks are freed at once; the answer carries the connector's marker."""
        return False, self.scheduler.finished(request)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        self.scheduler.take_receipts(getattr(meta, "receipts", {}))

    def shutdown(self) -> None:
        """vLLM is stopping: the receipts nobody fetched go with their folder."""
        if self.scheduler.receipts is not None:
            self.scheduler.receipts.close()

    # ---- worker side ---------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> LayoutReport:
        return self.worker.layout_report()

    def build_connector_worker_meta(self) -> BlendReceipts | None:
        receipts = self.worker.take_receipts()
        return BlendReceipts(receipts) if receipts else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, CacheBlendMeta):
            self.worker.start_load(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        """After the forward: store the chunks of this step's ingest requests."""
        meta = self._get_connector_metadata()
        if isinstance(meta, CacheBlendMeta):
            self.worker.save_all(meta)


def _unsupported(vllm_config: Any) -> str | None:
    """A server feature the worker's fused prefill cannot follow, or None.  With LoRA on,
    the model's layers the worker adopts are LoRA wrappers that apply the step's adapter
    mapping to whatever rows pass through them; a pooling model scores whole prompts."""
    if getattr(vllm_config, "lora_config", None) is not None:
        return "LoRA is enabled (the worker's prefill would run through vLLM's LoRA layers)"
    if getattr(vllm_config.model_config, "runner_type", None) == "pooling":
        return "the model runs as a pooling model (embed, classify, score)"
    return None

