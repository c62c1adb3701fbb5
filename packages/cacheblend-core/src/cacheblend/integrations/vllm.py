"""CacheBlend as a vLLM (0.32, V1) KV connector: blended chunk caches written into vLLM's blocks.

Loaded by ``--kv-transfer-config`` (``cacheblend serve`` writes it; user guide: docs/vllm.md).

* vLLM runs the connector's two halves in different processes (scheduler side in
  EngineCore, worker side in VllmWorker), so they share state through files: chunk caches
  through the core's KV store (``"store"``), the texts of known passages through a
  registry (``"passages"``: a JSON-lines file, or a ``redis://`` set shared by servers).
* Scheduler side: chunks are found in a request's token ids (client-given ``"chunks"``
  spans, else registered passages tokenized as the core tokenizes a chunk); a prompt of
  at least ``min_tokens`` holding one has ``len(prompt) - 1`` tokens loaded: vLLM computes the last.
* Worker side: a core :class:`~cacheblend.engine.Engine` on the same folder and dtype, its
  products on vLLM's own layers when vLLM loads with ``load_format="cacheblend"``
  (:mod:`.vllm_model`), runs the fused prefill through its chunk-cache service (store
  lookups, verification, retries); the fused K/V are written into the request's paged blocks
  (:mod:`.paged`); on failure the blocks are reported as load errors, which vLLM recomputes
  (``kv_load_failure_policy="recompute"``) or fails the request over, never decoding zeroes.

Per request, ``kv_transfer_params`` may carry ``"chunks"`` (``[start, end)`` token spans),
any selection option of :class:`~cacheblend.config.RequestOptions` (``method``:
``"blend"``, ``"reuse"`` or ``"full"``; ``recompute_ratio``, ``check_layers``,
``deviation``, ``gradual``, ...), or an operation: ``{"cacheblend": "ingest", "sink": s}``
stores vLLM's own K/V of the chunk after ``s`` sink ids; ``{"cacheblend": "release",
"ids": [...]}`` deletes a chunk's entry; ``{"cacheblend": "ping"}`` asks who is there.
They are checked by :func:`.kv_params.parse_kv_params`: the OpenAI server answers a bad
one with HTTP 400 (:mod:`.vllm_http`), and here a request with a bad one runs as plain
vLLM, with the reason in the log (the scheduler must never raise).  Run vLLM with
``enable_prefix_caching=False`` (blended blocks must not enter vLLM's prefix cache as if
exact).  K/V are written through the attention backend's own cache-update op; at start-up
the worker checks its caches are on the CPU, the layout (:mod:`.paged`) and vLLM's attention
reading a reference chunk back (:mod:`.readback`); a failure makes every request plain vLLM.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import torch
from transformers import AutoTokenizer
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..cache.chunks import LookupCounter
from ..config import ConnectorConfig, chunk_sink_for
from ..engine import Engine
from ..errors import CacheBlendError
from ..generate.decode import KVCache
from ..models.decoder import apply_rope
from ..prompt import PromptBuilder
from ..results import BlendStats
from ..store import ChunkKV, tier_total
from ..store.spec import split_spec
from .kv_params import KVParams, fit_spans, parse_kv_params
from .paged import LayoutCheck, PagedKV, layer_order, paged_views
from .readback import start_up_check
from .registry import REDIS_PASSAGES_KEY, ChunkMatcher, read_passages, register_passages
from .vllm_meta import BlendLoad, BlendReceipts, CacheBlendMeta, ChunkSave, LayoutReport, request_params
from .vllm_model import worker_engine

__all__ = ["REDIS_PASSAGES_KEY", "CacheBlendConnector", "ChunkMatcher", "paged_views", "read_passages",
           "register_passages"]

log = logging.getLogger("vllm.cacheblend")  # under "vllm", so vLLM's log handler shows it

_LOCK = threading.Lock()  # one stats line at a time


# ---------------------------------------------------------------- the connector

class CacheBlendConnector(KVConnectorBase_V1):
    """Reports known-chunk prompts as loaded and writes their CacheBlend-fused K/V."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = ConnectorConfig.parse(self._kv_transfer_config.kv_connector_extra_config)
        self.block_size: int = vllm_config.cache_config.block_size
        self.min_tokens = self.config.min_tokens if self.config.min_tokens is not None else 2 * self.block_size
        self.model_dir: str = vllm_config.model_config.model
        self.dtype: torch.dtype = vllm_config.model_config.dtype
        self.num_layers: int = vllm_config.model_config.get_total_num_hidden_layers()
        # both sides resolve it alike, and every answer names it (a RemoteEngine adopts it)
        self.chunk_sink: str = chunk_sink_for(self.config.chunk_sink, vllm_config.model_config.hf_config.model_type)
        self.kv_cache_config = kv_cache_config  # its groups' specs build the self-check's attention metadata
        # scheduler side
        self._matcher: ChunkMatcher | None = None
        self._spans: dict[str, list[tuple[int, int]]] = {}  # req_id -> matched spans (a pure cache)
        self._pending: dict[str, BlendLoad] = {}
        self._ops: dict[str, tuple[str, Any]] = {}  # req_id -> ("ingest", sink) | ("release", ids)
        self._prefilling: dict[str, ChunkSave] = {}  # ingest requests vLLM prefills over several steps
        self._hints: dict[str, KVParams | None] = {}  # req_id -> its checked hints (None: invalid)
        self._receipts: dict[str, dict] = {}  # req_id -> fidelity receipt from the worker (scheduler side)
        self._awaiting: dict[str, dict] = {}  # req_id -> marker returned before its receipt came
        self._blending_off: str | None = None  # why, when a worker's layout self-check failed
        # worker side
        self._engine: Engine | None = None
        self._paged: PagedKV | None = None
        self._layout = LayoutCheck(False, "?", "no KV caches registered yet")
        self._failed_blocks: set[int] = set()
        self._step_receipts: dict[str, dict] = {}  # this step's receipts, for the scheduler side
        self.last_stats: dict[str, Any] = {}

    # ---- scheduler side ------------------------------------------------------------
    def _get_matcher(self) -> ChunkMatcher:
        if self._matcher is None:
            prompts = PromptBuilder(AutoTokenizer.from_pretrained(self.model_dir))
            store = self.config.store
            namespace = split_spec(store)[1].namespace if store else None  # a tenant's own registry
            self._matcher = ChunkMatcher(prompts.encode, prompts.chunk_separator, self.config.passages, namespace)
        self._matcher.refresh()
        return self._matcher

    def _match(self, request: Any) -> list[tuple[int, int]]:
        """The request's chunk spans: the client's (``"chunks"``), else those of registered
        passages found in its ids; none for an operation or ``method="full"``."""
        spans = self._spans.get(request.request_id)
        if spans is None:
            ids = list(request.prompt_token_ids or [])
            hints = self._params(request)
            spans = []
            if hints is not None and hints.blends:
                if hints.chunks is not None:
                    try:
                        spans = fit_spans(hints.chunks, len(ids))
                    except CacheBlendError as e:
                        log.warning("CacheBlend: running %s as plain vLLM: %s", request.request_id, e)
                elif len(ids) >= self.min_tokens:
                    spans = self._get_matcher().find(ids, end_limit=len(ids) - 1)
            self._spans[request.request_id] = spans
        return spans

    def _params(self, request: Any) -> KVParams | None:
        """The request's hints over the server's defaults, checked once; None (the request
        then runs as plain vLLM, the reason logged) if any is invalid: the scheduler must
        never fail a request over its hints."""
        req_id = request.request_id
        if req_id not in self._hints:
            try:
                self._hints[req_id] = parse_kv_params(getattr(request, "kv_transfer_params", None),
                                                      base=self.config.defaults, num_layers=self.num_layers)
            except Exception as e:  # noqa: BLE001 - CacheBlendError, or anything else: never fatal here
                log.warning("CacheBlend: running %s as plain vLLM: %s", req_id, e)
                self._hints[req_id] = None
        return self._hints[req_id]

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """The workers' layout self-checks, before the first request: one failure turns
        blending off for this server (requests run as plain vLLM)."""
        failed = [m for m in metadata.values() if isinstance(m, LayoutReport) and not m.ok]
        if failed:
            self._blending_off = f"{failed[0].backend}: {failed[0].reason}"
            log.warning("CacheBlend: blending is OFF, every request runs as plain vLLM (KV layout self-check "
                        "failed on %s)", self._blending_off)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        n = len(request.prompt_token_ids or [])
        if self._blending_off is not None or not self._match(request):
            return 0, False
        return max(0, n - 1 - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        ids = list(request.prompt_token_ids or [])
        hints = self._params(request)
        if hints is not None and hints.op == "ingest" and hints.sink is not None and hints.sink < len(ids):
            self._ops[request.request_id] = ("ingest", hints.sink)
        elif hints is not None and hints.op == "release" and hints.ids is not None:
            self._ops[request.request_id] = ("release", list(hints.ids))
        elif hints is not None and hints.op == "ingest":
            log.warning("CacheBlend: ingest request %s has a sink of %s ids in a %d-token prompt; not saved",
                        request.request_id, hints.sink, len(ids))
        if num_external_tokens <= 0:
            return
        assert hints is not None  # external tokens are reported only for valid hints
        self._pending[request.request_id] = BlendLoad(request.request_id, ids, [], len(ids) - 1 - num_external_tokens,
                                                      self._match(request), hints.blend)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Loads for this step's new requests, and for requests resumed after preemption
        (their blocks were freed, so the connector reported and must write them again)."""
        blocks = {req.req_id: req.block_ids[0] for req in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                blocks[req_id] = cached.new_block_ids[i][0]
        meta = CacheBlendMeta()
        for req_id, block_ids in blocks.items():
            load = self._pending.pop(req_id, None)
            if load is not None:
                load.block_ids = list(block_ids)
                meta.loads.append(load)
        for new in scheduler_output.scheduled_new_reqs:
            op = self._ops.pop(new.req_id, None)
            if op is None:
                continue
            kind, arg = op
            if kind == "release":
                meta.releases.append(arg)
                continue
            save = ChunkSave(new.req_id, list(new.prompt_token_ids or []), list(new.block_ids[0]), arg)
            scheduled = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            if new.num_computed_tokens + scheduled >= len(save.token_ids):
                meta.saves.append(save)
            else:  # chunked prefill: saved after the step that computes its last token
                self._prefilling[new.req_id] = save
        self._continue_ingests(scheduler_output, meta)
        return meta

    def _continue_ingests(self, scheduler_output: Any, meta: CacheBlendMeta) -> None:
        """Follow ingest requests prefilled over several steps (a chunk longer than
        ``max_num_batched_tokens``): collect their blocks, and save once the last step runs."""
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            save = self._prefilling.get(req_id)
            if save is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted: its blocks were replaced
                save.block_ids = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                save.block_ids += list(new_blocks[0])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if done >= len(save.token_ids):
                meta.saves.append(self._prefilling.pop(req_id))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Blocks are freed at once; a request that came with ``kv_transfer_params`` gets
        ``{"cacheblend": {...}}`` back in its response, so a client knows the connector ran."""
        spans = self._spans.pop(request.request_id, None) or []
        self._pending.pop(request.request_id, None)
        self._ops.pop(request.request_id, None)
        self._prefilling.pop(request.request_id, None)
        self._hints.pop(request.request_id, None)
        receipt = self._receipts.pop(request.request_id, None)
        if not request_params(request):
            return False, None
        marker = {"connector": type(self).__name__, "chunk_sink": self.chunk_sink, "chunks": len(spans),
                  "fidelity": receipt}
        if receipt is None and spans:  # blended in this very step: vLLM reads the receipt after this
            self._awaiting[request.request_id] = marker
        return False, {"cacheblend": marker}

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' fidelity receipts of this step, kept until their requests finish.
        vLLM finishes a one-token request before it hands the connector that step's output,
        so a marker already returned is completed in place (it is sent after this call)."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        for req_id, receipt in getattr(meta, "receipts", {}).items():
            if req_id in self._awaiting:
                self._awaiting.pop(req_id)["fidelity"] = receipt
            else:
                self._receipts[req_id] = receipt
        self._awaiting.clear()  # a receipt comes in the step that blended it, or never

    def build_connector_worker_meta(self) -> BlendReceipts | None:
        receipts, self._step_receipts = self._step_receipts, {}
        return BlendReceipts(receipts) if receipts else None

    # ---- worker side ---------------------------------------------------------------
    def engine(self) -> Engine:
        """The core engine, once per worker (:func:`.vllm_model.worker_engine`)."""
        if self._engine is None:
            c = self.config
            self._engine = worker_engine(self.model_dir, c.store, self.dtype, self.chunk_sink, c.kv_dtype)
        return self._engine

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the caches with their attention layers and self-check the layout, at
        start-up: not inside the first request's TTFT, and before any request is blended."""
        names = layer_order(kv_caches)
        attention = self._vllm_config.compilation_config.static_forward_context
        self._paged = PagedKV([kv_caches[n] for n in names], [attention.get(n) for n in names], self.block_size)
        self._layout = start_up_check(self._paged, names, self._vllm_config, self.kv_cache_config, self._reference)
        (log.info if self._layout.ok else log.warning)("CacheBlend KV layout self-check %s on %s: %s",
                                                       "passed" if self._layout.ok else "FAILED (blending is off)",
                                                       self._layout.backend, self._layout.reason)

    def _reference(self) -> ChunkKV:
        """The self-check's reference: a known chunk's K/V as the core precomputes it."""
        eng = self.engine()
        return eng.chunks.precompute(eng.prompts.chunk_ids("CacheBlend layout self-check: a known chunk.")
                                     [: self.block_size - len(eng.chunks.sink)])

    def get_handshake_metadata(self) -> LayoutReport:
        return LayoutReport(self._layout.ok, self._layout.backend, self._layout.reason)

    def _blend(self, load: BlendLoad) -> KVCache:
        """Fused K (post-RoPE) and V ``[layers, heads, tokens, head_dim]`` of the whole prompt,
        through the chunk-cache service (store lookups, retries on damaged entries), in a
        buffer of the engine's pool (its pages already mapped): give it back when written."""
        eng, (counter, prefix) = self.engine(), (LookupCounter(), LookupCounter())  # chunks; the prompt's prefix
        cache, ids = eng.chunks, load.token_ids
        load.blend.validate_for(eng.decoder.shape.num_layers)
        kv = eng.kv_pool.take(eng.decoder.shape, len(ids), eng.device)
        unreachable = tier_total(eng.store, "unreachable")
        report = cache.fuse(lambda c: (cache.span_segments(ids, load.spans, c, prefix), load.blend), kv, counter)
        stats = BlendStats(method="blend" if load.blend.recompute_ratio > 0 else "reuse",
                           recompute_ratio=load.blend.recompute_ratio)
        stats.take_prefill(report)
        self._step_receipts[load.req_id] = stats.receipt()
        self.last_stats = {"req_id": load.req_id, "op": "load", "prompt_tokens": report.prompt_tokens,
                           "chunks": len(load.spans), "recompute_ratio": load.blend.recompute_ratio,
                           "reused": report.reused_tokens, "recomputed": report.recomputed_tokens,
                           "checked": report.active_per_layer[0], "computed": report.computed_tokens,
                           "store_hits": counter.hits, "store_misses": counter.misses,
                           "store_rejected": counter.rejected, "products": eng.decoder.products,
                           "store_unreachable": tier_total(eng.store, "unreachable") - unreachable,
                           "prefix_cached": prefix.hits > 0 and not prefix.misses,
                           "fidelity": self._step_receipts[load.req_id],  # blend_s = compute + load_exposed + lookups
                           "compute_s": round(report.compute_s, 3), "load_exposed_s": round(report.load_exposed_s, 3)}
        return kv

    def _write(self, load: BlendLoad, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._paged is None or not self._layout.ok:
            raise RuntimeError(f"blending is off: {self._layout.reason}")
        end = len(load.token_ids) - 1
        self._paged.write(load.block_ids, load.start, k[:, :, load.start:end], v[:, :, load.start:end])

    def _record(self, stats: dict[str, Any]) -> None:
        log.info("CacheBlend %s", stats)
        if self.config.stats:
            with _LOCK, open(self.config.stats, "a", encoding="utf-8") as f:
                f.write(json.dumps(stats) + "\n")

    def _save(self, save: ChunkSave) -> None:
        """Store vLLM's K/V of an ingest request's chunk as the core's entry: keys rotated
        back to no position (vLLM stores them after RoPE at positions ``sink, sink+1, …``)."""
        eng = self.engine()
        cache = eng.chunks
        sink, chunk = save.token_ids[: save.sink], save.token_ids[save.sink :]
        if tuple(sink) != cache.sink:
            raise ValueError(f"ingest sink {sink} is not the engine's chunk sink {list(cache.sink)}")
        key = cache.handle(chunk).key
        if eng.store.open(key) is not None:  # already stored: skip reading the blocks
            self._record({"req_id": save.req_id, "op": "ingest", "key": key[:16], "stored": False})
            return
        if self._paged is None:
            raise RuntimeError("no KV caches registered")
        k, v = self._paged.read(save.block_ids, save.sink, len(save.token_ids))
        cos, sin = eng.decoder.rope_tables(torch.arange(save.sink, len(save.token_ids)))
        k = apply_rope(k.float(), cos[None, None].float(), -sin[None, None].float()).to(eng.decoder.shape.dtype)
        stored = cache.save(chunk, ChunkKV(k.contiguous(), v.to(k.dtype).contiguous()))
        self._record({"req_id": save.req_id, "op": "ingest", "key": key[:16], "stored": stored, "tokens": len(chunk)})

    def _release(self, ids: list[int]) -> None:
        cache = self.engine().chunks
        self._record({"op": "release", "tokens": len(ids), "removed": cache.release(cache.handle(ids))})

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, CacheBlendMeta):
            return
        for ids in meta.releases:
            try:
                self._release(ids)
            except Exception:  # noqa: BLE001 - a failed delete must not fail the step
                log.exception("CacheBlend release failed")
        if not meta.loads:
            return
        for load in meta.loads:
            t0 = time.perf_counter()
            try:
                with torch.inference_mode():
                    kv = self._blend(load)
                    t1 = time.perf_counter()
                    self._write(load, kv.k, kv.v)
                    self.engine().kv_pool.give_back(kv)
                self.last_stats.update(blend_s=round(t1 - t0, 3), write_s=round(time.perf_counter() - t1, 3))
            except Exception:  # noqa: BLE001 - vLLM recomputes what we could not load
                log.exception("CacheBlend load failed for %s; vLLM recomputes its blocks", load.req_id)
                self._failed_blocks.update(load.block_ids[load.start // self.block_size :])
                continue
            self._record(self.last_stats)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        """After the forward: store the chunks of this step's ingest requests."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, CacheBlendMeta):
            return
        for save in meta.saves:
            try:
                with torch.inference_mode():
                    self._save(save)
            except Exception:  # noqa: BLE001 - the chunk is then computed by the core on first use
                log.exception("CacheBlend save failed for %s", save.req_id)
