"""The connector's scheduler side (vLLM's EngineCore process): which prompts hold known
chunks, what each step's workers must blend, save or release, and the fidelity receipt
sent back with each answer.

It never raises over a request: a request whose hints are invalid, or whose chunks cannot
be found, runs as plain vLLM with the reason in the log.  What it decides reaches the
worker side (:mod:`.vllm_worker`) as :class:`.vllm_meta.CacheBlendMeta`, once per step.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import AutoTokenizer

from ..config import ConnectorConfig
from ..errors import CacheBlendError
from ..prompt import PromptBuilder
from ..store.spec import split_spec
from .kv_params import KVParams, fit_prefix, fit_spans, parse_kv_params
from .registry import ChunkMatcher
from .vllm_meta import BlendLoad, CacheBlendMeta, ChunkSave, LayoutReport, request_params
from .vllm_receipts import ReceiptBox

log = logging.getLogger("vllm.cacheblend")  # under "vllm", so vLLM's log handler shows it


class SchedulerSide:
    """Per-request state of the scheduler side, keyed by vLLM's request id."""

    def __init__(self, config: ConnectorConfig, *, model_dir: str, block_size: int, num_layers: int,
                 chunk_sink: str, connector: str, prefix_caching: bool = False,
                 exact_behind_sink: bool = True, receipts: ReceiptBox | None = None,
                 unsupported: str | None = None) -> None:
        self.config = config
        self.model_dir = model_dir
        self.min_tokens = config.min_tokens if config.min_tokens is not None else 2 * block_size
        self.max_blend_tokens = config.max_blend_tokens  # blended prompt tokens one step may run (None: any)
        self._step_blended = 0  # blended prompt tokens admitted in the step being scheduled
        self.num_layers = num_layers
        self.chunk_sink = chunk_sink  # every answer's marker names it (a RemoteEngine adopts it)
        self.exact_behind_sink = exact_behind_sink  # and whether a chunk right behind it is reused exactly
        self.connector = connector  # the class name clients look for in the marker
        self.receipts = receipts  # where a streamed request's marker waits for its client
        self._matcher: ChunkMatcher | None = None
        self._spans: dict[str, list[tuple[int, int]]] = {}  # req_id -> matched spans (a pure cache)
        self._prefixes: dict[str, int] = {}  # req_id -> a chunkless prompt's prefix read from the prefix cache
        self._pending: dict[str, BlendLoad] = {}
        self._ops: dict[str, tuple[str, Any]] = {}  # req_id -> ("ingest", sink) | ("release", ids)
        self._prefilling: dict[str, ChunkSave] = {}  # ingest requests vLLM prefills over several steps
        self._hints: dict[str, KVParams | None] = {}  # req_id -> its checked hints (None: invalid)
        self._receipts: dict[str, dict] = {}  # req_id -> fidelity receipt from the worker
        # req_id -> marker returned before its receipt came, and the request's receipt tag
        self._awaiting: dict[str, tuple[dict, str | None]] = {}
        self.blending_off: str | None = None  # why, when a worker's layout self-check failed
        if prefix_caching:  # vLLM would keep blended blocks in its prefix cache and reuse them as exact
            self.blending_off = "vLLM's prefix caching is on (start vLLM with enable_prefix_caching=False)"
        elif unsupported:  # a server feature the worker's fused prefill cannot follow (vllm.py says which)
            self.blending_off = unsupported
        if self.blending_off is not None:
            log.warning("CacheBlend: blending is OFF, every request runs as plain vLLM: %s", self.blending_off)

    def _get_matcher(self) -> ChunkMatcher:
        if self._matcher is None:
            prompts = PromptBuilder(AutoTokenizer.from_pretrained(self.model_dir))
            store = self.config.store
            namespace = split_spec(store)[1].namespace if store else None  # a tenant's own registry
            self._matcher = ChunkMatcher(prompts.encode, prompts.chunk_separator, self.config.passages, namespace)
        self._matcher.refresh()
        return self._matcher

    def match(self, request: Any) -> list[tuple[int, int]]:
        """The request's chunk spans: the client's (``"chunks"``), else those of registered
        passages found in its ids; none for an operation or ``method="full"``."""
        spans = self._spans.get(request.request_id)
        if spans is None:
            ids = list(request.prompt_token_ids or [])
            hints = self.params(request)
            spans = []
            if hints is not None and hints.blends:
                if hints.chunks is not None:
                    try:
                        spans = fit_spans(hints.chunks, len(ids))
                        if hints.prefix:
                            self._prefixes[request.request_id] = fit_prefix(hints.prefix, len(ids))
                    except CacheBlendError as e:
                        log.warning("CacheBlend: running %s as plain vLLM: %s", request.request_id, e)
                elif len(ids) >= self.min_tokens and self.config.passages is not None:
                    spans = self._registered_spans(request.request_id, ids)
            self._spans[request.request_id] = spans
        return spans

    def _registered_spans(self, req_id: str, ids: list[int]) -> list[tuple[int, int]]:
        """Spans of registered passages in ``ids``; none (plain vLLM, the reason logged) when
        the matcher cannot be built: an exception here would stop vLLM's engine."""
        try:
            return self._get_matcher().find(ids, end_limit=len(ids) - 1)
        except Exception as e:  # noqa: BLE001 - never fatal in the scheduler
            log.warning("CacheBlend: running %s as plain vLLM: passages cannot be matched (%s: %s)",
                        req_id, type(e).__name__, e)
            return []

    def params(self, request: Any) -> KVParams | None:
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

    def take_layout_reports(self, metadata: dict[int, Any]) -> None:
        """The workers' layout self-checks, before the first request: one failure turns
        blending off for this server (requests run as plain vLLM)."""
        failed = [m for m in metadata.values() if isinstance(m, LayoutReport) and not m.ok]
        if failed:
            self.blending_off = f"{failed[0].backend}: {failed[0].reason}"
            log.warning("CacheBlend: blending is OFF, every request runs as plain vLLM (KV layout self-check "
                        "failed on %s)", self.blending_off)

    def loaded_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens the connector provides: all but the last of a prompt holding known chunks
        (vLLM computes at least one token itself), none otherwise, and none for a request that
        needs every prompt position computed (prompt logprobs, ``echo`` scoring, pooling):
        vLLM skips its own prefix cache for those, and a blend would leave them incomplete.
        None ("ask again next step": vLLM leaves it waiting) for a blend past this step's
        ``max_blend_tokens``, so a burst of blends does not stall the running decodes."""
        n = len(request.prompt_token_ids or [])
        if self.blending_off is not None or _every_position(request) or _not_base_tokens(request) \
                or not self._engaged(request):
            return 0
        loaded = max(0, n - 1 - num_computed_tokens)
        if loaded and self._step_blended and self.max_blend_tokens is not None \
                and self._step_blended + n > self.max_blend_tokens:
            return None
        return loaded

    def _engaged(self, request: Any) -> bool:
        """Whether the connector provides this request's K/V: it holds chunks, or a prefix."""
        return bool(self.match(request)) or request.request_id in self._prefixes

    def after_alloc(self, request: Any, num_external_tokens: int) -> None:
        """Note what the request's step must do: an operation, or a blend into its blocks."""
        ids = list(request.prompt_token_ids or [])
        hints = self.params(request)
        if hints is not None and hints.op == "ingest" and (why := _not_base_tokens(request)):
            log.warning("CacheBlend: ingest request %s is not saved: %s", request.request_id, why)
        elif hints is not None and hints.op == "ingest" and hints.sink is not None and hints.sink < len(ids):
            self._ops[request.request_id] = ("ingest", hints.sink)
        elif hints is not None and hints.op == "release" and hints.ids is not None:
            self._ops[request.request_id] = ("release", list(hints.ids))
        elif hints is not None and hints.op == "ingest":
            log.warning("CacheBlend: ingest request %s has a sink of %s ids in a %d-token prompt; not saved",
                        request.request_id, hints.sink, len(ids))
        if num_external_tokens <= 0:
            return
        assert hints is not None  # external tokens are reported only for valid hints
        self._step_blended += len(ids)
        self._pending[request.request_id] = BlendLoad(request.request_id, ids, [], len(ids) - 1 - num_external_tokens,
                                                      self.match(request), hints.blend,
                                                      self._prefixes.get(request.request_id, 0))

    def build_meta(self, scheduler_output: Any) -> CacheBlendMeta:
        """Loads for this step's new requests, and for requests resumed after preemption
        (their blocks were freed, so the connector reported and must write them again)."""
        self._step_blended = 0  # vLLM builds the metadata once per step, after scheduling it
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

    def finished(self, request: Any) -> dict | None:
        """Forget the request; one that came with ``kv_transfer_params`` gets
        ``{"cacheblend": {...}}`` back in its response, so a client knows the connector ran."""
        spans = self._spans.pop(request.request_id, None) or []
        prefix = self._prefixes.pop(request.request_id, 0)
        self._pending.pop(request.request_id, None)
        self._ops.pop(request.request_id, None)
        self._prefilling.pop(request.request_id, None)
        hints = self._hints.pop(request.request_id, None)
        tag = hints.receipt if hints is not None else None
        receipt = self._receipts.pop(request.request_id, None)
        if not request_params(request):
            return None
        keeps = self.receipts is not None and self.receipts.usable  # streamed answers' receipts
        marker = {"connector": self.connector, "chunk_sink": self.chunk_sink,
                  "exact_behind_sink": self.exact_behind_sink, "receipts": keeps,
                  "chunks": len(spans), "fidelity": receipt}
        if receipt is None and (spans or prefix):  # blended in this very step: vLLM reads the receipt after this
            self._awaiting[request.request_id] = (marker, tag)
        else:
            self._keep(tag, marker)
        return {"cacheblend": marker}

    def _keep(self, tag: str | None, marker: dict) -> None:
        """A streamed request's marker, for its client to fetch (:mod:`.vllm_receipts`)."""
        if tag is not None and self.receipts is not None:
            self.receipts.put(tag, {"cacheblend": marker})

    def live_requests(self) -> int:
        """How many requests this side holds state for: every table is emptied as its
        requests finish (vLLM calls ``request_finished`` for aborted ones too)."""
        tables = (self._spans, self._prefixes, self._pending, self._ops, self._prefilling, self._hints,
                  self._receipts, self._awaiting)
        return len(set().union(*tables))

    def take_receipts(self, receipts: dict[str, dict]) -> None:
        """The workers' fidelity receipts of this step, kept until their requests finish.
        vLLM finishes a one-token request before it hands the connector that step's output,
        so a marker already returned is completed in place (it is sent after this call)."""
        for req_id, receipt in receipts.items():
            if req_id in self._awaiting:
                marker, tag = self._awaiting.pop(req_id)
                marker["fidelity"] = receipt
                self._keep(tag, marker)
            elif req_id in self._hints:  # still running: kept until it finishes
                self._receipts[req_id] = receipt
            # else finished already, without a marker to fill (no kv_transfer_params): dropped,
            # where it used to stay in _receipts for good
        for marker, tag in self._awaiting.values():  # a receipt comes in the step that blended it, or never
            self._keep(tag, marker)
        self._awaiting.clear()


def _not_base_tokens(request: Any) -> str | None:
    """Why the base model's K/V of ``request``'s token ids are not what vLLM computes for
    it, or None.  A LoRA adapter changes them (a chunk cache holds the base model's, and an
    ingest would store the adapter's under the base model's key); embeddings given in the
    prompt sit where its token ids hold placeholders; a pooling request (embed, classify)
    is scored over its whole prompt by vLLM, which cannot pool one computed token."""
    if getattr(request, "lora_request", None) is not None:
        return "it runs a LoRA adapter"
    if getattr(request, "prompt_embeds", None) is not None:
        return "its prompt holds embeddings"
    if getattr(request, "pooling_params", None) is not None:
        return "it is a pooling request"
    return None


def _every_position(request: Any) -> bool:
    """Whether vLLM must compute every prompt position of ``request`` itself (it then skips
    reading its prefix cache: ``Request.skip_reading_prefix_cache``)."""
    if getattr(request, "skip_reading_prefix_cache", False):
        return True
    sampling = getattr(request, "sampling_params", None)
    return getattr(sampling, "prompt_logprobs", None) is not None
