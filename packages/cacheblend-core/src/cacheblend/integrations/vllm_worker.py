"""The connector's worker side (vLLM's worker process): the fused prefill of each load,
written into the request's paged blocks, and the chunks of ingest requests saved.

A core :class:`~cacheblend.engine.Engine` on the same folder and dtype (its products on
vLLM's own layers when vLLM loads with ``load_format="cacheblend"``, :mod:`.vllm_model`)
runs the fused prefill through its chunk-cache service (store lookups, verification,
retries).  The fused K/V go into vLLM's blocks through the attention backend's own
cache-update op (:mod:`.paged`), after the start-up self-check (:mod:`.readback`) passed.
A load that fails has its blocks reported as load errors, which vLLM recomputes or fails
the request over, never decoding zeroes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import torch

from ..cache.background import StepExecutor
from ..cache.chunks import LookupCounter
from ..cache.segments import span_segments
from ..config import ConnectorConfig
from ..engine import Engine
from ..generate.decode import KVCache
from ..models.decoder import apply_rope
from ..results import BlendStats
from ..store import ChunkKV, tier_total
from .paged import LayoutCheck, PagedKV, layer_order
from .readback import start_up_check
from .rope_check import rope_problem, rotary_for
from .vllm_meta import BlendLoad, CacheBlendMeta, ChunkSave, LayoutReport
from .vllm_model import loaded_model, worker_engine

log = logging.getLogger("vllm.cacheblend")  # under "vllm", so vLLM's log handler shows it

_LOCK = threading.Lock()  # one stats line at a time


def append_stats(path: str, stats: dict[str, Any]) -> None:
    """Append one JSON line to the connector's ``stats`` file.  A file that cannot be written
    is logged, never raised: this runs inside vLLM's step, and an exception would stop the engine."""
    try:
        with _LOCK, open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(stats) + "\n")
    except OSError as e:
        log.warning("CacheBlend: cannot append to the stats file %s (%s)", path, e)


class WorkerSide:
    """The worker's engine, its view of vLLM's paged caches, and this step's receipts."""

    def __init__(self, config: ConnectorConfig, *, model_dir: str, dtype: torch.dtype, chunk_sink: str,
                 block_size: int, vllm_config: Any, kv_cache_config: Any) -> None:
        self.config = config
        self.model_dir = model_dir
        self.dtype = dtype
        self.chunk_sink = chunk_sink
        self.block_size = block_size
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config  # its groups' specs build the self-check's attention metadata
        self._engine: Engine | None = None
        self._paged: PagedKV | None = None
        self._layout = LayoutCheck(False, "?", "no KV caches registered yet")
        self._failed_blocks: set[int] = set()
        self._step_receipts: dict[str, dict] = {}  # this step's receipts, for the scheduler side
        self._between_forwards = StepExecutor()  # the engine's background work, run after each forward
        self.last_stats: dict[str, Any] = {}

    def engine(self) -> Engine:
        """The core engine, once per worker (:func:`.vllm_model.worker_engine`)."""
        if self._engine is None:
            c = self.config
            self._engine = worker_engine(self.model_dir, c.store, self.dtype, self.chunk_sink, c.kv_dtype)
            self._engine.chunks.run_background_on(self._between_forwards)
        return self._engine

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the caches with their attention layers and self-check the layout, at
        start-up: not inside the first request's TTFT, and before any request is blended."""
        names = layer_order(kv_caches)
        attention = self.vllm_config.compilation_config.static_forward_context
        self._paged = PagedKV([kv_caches[n] for n in names], [attention.get(n) for n in names], self.block_size)
        self._layout = start_up_check(self._paged, names, self.vllm_config, self.kv_cache_config, self._reference,
                                      self._rope_problem)
        (log.info if self._layout.ok else log.warning)("CacheBlend KV layout self-check %s on %s: %s",
                                                       "passed" if self._layout.ok else "FAILED (blending is off)",
                                                       self._layout.backend, self._layout.reason)

    def _reference(self) -> ChunkKV:
        """The self-check's reference: a known chunk's K/V as the core precomputes it."""
        eng = self.engine()
        return eng.chunks.precompute(eng.prompts.chunk_ids("CacheBlend layout self-check: a known chunk.")
                                     [: self.block_size - len(eng.chunks.sink)])

    def _rope_problem(self) -> str | None:
        """Why vLLM's RoPE differs from the core's, if it does (:mod:`.rope_check`)."""
        rotary = rotary_for(loaded_model(), self.vllm_config)
        return rope_problem(self.engine().decoder, rotary, self.vllm_config.model_config.max_model_len)

    def layout_report(self) -> LayoutReport:
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
        report = cache.fuse(lambda c: (span_segments(cache, ids, load.spans, c, prefix, load.prefix),
                                            load.blend), kv, counter)
        stats = BlendStats(method="blend" if load.blend.recompute_ratio > 0 else "reuse",
                           recompute_ratio=load.blend.recompute_ratio)
        stats.take_prefill(report)
        self._step_receipts[load.req_id] = stats.receipt(counts=True)
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
            append_stats(self.config.stats, stats)

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

    def start_load(self, meta: CacheBlendMeta) -> None:
        """Before the forward: this step's releases, then each load blended and written."""
        for ids in meta.releases:
            try:
                self._release(ids)
            except Exception:  # noqa: BLE001 - a failed delete must not fail the step
                log.exception("CacheBlend release failed")
        for load in meta.loads:
            t0, kv = time.perf_counter(), None
            try:
                with torch.inference_mode():
                    kv = self._blend(load)
                    t1 = time.perf_counter()
                    self._write(load, kv.k, kv.v)
                self.last_stats.update(blend_s=round(t1 - t0, 3), write_s=round(time.perf_counter() - t1, 3),
                                       step_blends=len(meta.loads))  # blends run before this step's forward
            except Exception:  # noqa: BLE001 - vLLM recomputes what we could not load
                log.exception("CacheBlend load failed for %s; vLLM recomputes its blocks", load.req_id)
                self._failed_blocks.update(load.block_ids[load.start // self.block_size :])
                self._step_receipts.pop(load.req_id, None)  # its answer is vLLM's own, not a blend
                continue
            finally:
                if kv is not None:
                    self.engine().kv_pool.give_back(kv)
            self._record(self.last_stats)

    def take_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def save_all(self, meta: CacheBlendMeta) -> None:
        """After the forward: store the chunks of this step's ingest requests, then run the
        engine's background work (hint backfills) on this thread, while no forward runs:
        the products are vLLM's own layers, which a second thread must not call
        (:class:`~cacheblend.cache.background.StepExecutor`)."""
        for save in meta.saves:
            try:
                with torch.inference_mode():
                    self._save(save)
            except Exception:  # noqa: BLE001 - the chunk is then computed by the core on first use
                log.exception("CacheBlend save failed for %s", save.req_id)
        self._between_forwards.run_pending()  # each job logs its own failure (KeyedJobs)

    def take_receipts(self) -> dict[str, dict]:
        receipts, self._step_receipts = self._step_receipts, {}
        return receipts
