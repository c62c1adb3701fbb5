"""One request's token loop: fused prefill → decode cache → sampling → streamed text.

The prefill runs through the chunk-cache service (:meth:`ChunkCache.fuse`), which looks
the caches up, verifies them and retries on damage; with ``recompute_ratio="auto"`` the
loading controller picks the ratio for the tier the caches come from (paper §5.2).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..blend.fusor import FusionReport, Segment, check_deadline
from ..cache.chunks import LookupCounter
from ..cache.segments import prompt_segments
from ..config import BlendConfig, RequestOptions
from ..prompt import PromptIds
from ..results import BlendStats, ChunkHandle, Result
from ..store import ChunkKV
from ..store.entry import LayerSource, PrefixView
from .decode import KVCache
from .sampling import Sampler, TextStream

if TYPE_CHECKING:
    from ..engine import Engine


@dataclass
class Request:
    """A validated request: the prompt's ids, its chunks' handles (in prompt order), the
    options, and when it arrived (TTFT counts from there)."""

    prompt: PromptIds
    handles: Sequence[ChunkHandle]
    options: RequestOptions
    t0: float
    defer: frozenset[str] = frozenset()  # keys of learned chunks: computed in place if not stored yet


def _lazy(segments: list[Segment]) -> list[Segment]:
    """Segments whose cache is read from a tier layer by layer (not just computed)."""
    def lazy(src: LayerSource) -> bool:
        return not isinstance(src.source if isinstance(src, PrefixView) else src, ChunkKV)

    return [s for s in segments if s.cached is not None and lazy(s.cached)]


class Generation:
    """One request: fused prefill, then decode, yielding text pieces from ``pieces``;
    ``result`` once the pieces are exhausted (``stats`` is filled in as it runs)."""

    def __init__(self, engine: Engine, request: Request) -> None:
        self.engine = engine
        self.request = request
        opts = request.options
        self.method = opts.method
        self.blend: BlendConfig = opts.blend(engine.decoder.shape.num_layers)
        self.sampling = opts.sampling()
        self.stats = BlendStats(method=opts.method, recompute_ratio=self.blend.recompute_ratio,
                                chunks=len(request.handles))
        self.stats.seconds["tokenize"] = time.perf_counter() - request.t0
        self.deadline = None if opts.timeout is None else request.t0 + opts.timeout
        self.result: Result | None = None
        self.pieces: Generator[str, None, None] = self._pieces()

    # -- the loading controller ---------------------------------------------------------
    def _layer_bytes(self, segments: list[Segment]) -> int:
        shape = self.engine.decoder.shape
        per_token = 2 * shape.num_kv_heads * shape.head_dim * shape.dtype.itemsize
        return per_token * sum(len(s.token_ids) for s in segments)

    def _control(self, segments: list[Segment]) -> None:
        """Let the loading controller pick the ratio for where these caches come from."""
        floor = self.request.options.quality_floor
        reused = [s for s in segments if s.cached is not None and not s.exact]
        lazy = _lazy(segments)
        tier = lazy[0].cached.tier if lazy else "memory"  # type: ignore[union-attr]
        fixed = sum(len(s.token_ids) for s in segments if s.cached is None)
        d = self.engine.controller.decide(sum(len(s.token_ids) for s in reused), fixed,
                                          self._layer_bytes(lazy), tier, floor=floor)
        self.blend = replace(self.blend, recompute_ratio=d.ratio)
        self.stats.recompute_ratio = d.ratio
        self.stats.controller = d.as_dict() | {"floor": floor}

    def _observe(self, segments: list[Segment], report: FusionReport) -> None:
        ctl = self.engine.controller
        if not report.escalated:  # an escalated report's compute_s counts every pass, its tokens the last one's
            ctl.observe_compute(report.compute_s, sum(report.active_per_layer))
        lazy = _lazy(segments)
        tiers = {s.cached.tier for s in lazy}  # type: ignore[union-attr]
        if len(tiers) == 1 and report.load_s > 0:
            ctl.observe_load(tiers.pop(), self._layer_bytes(lazy) * self.engine.decoder.shape.num_layers,
                             report.load_s)

    # -- prefill -------------------------------------------------------------------------
    def _prefill(self, kv: KVCache, counter: LookupCounter) -> FusionReport:
        """Look the caches up (timed; the controller picks an ``auto`` ratio for them) and
        run the fused prefill through the chunk-cache service."""
        cache, stats = self.engine.chunks, self.stats

        def lookup(counter: LookupCounter) -> tuple[list[Segment], BlendConfig]:
            t = time.perf_counter()
            segments = prompt_segments(cache, self.request.prompt, self.request.handles, self.method, counter,
                                        defer=self.request.defer)
            stats.seconds["lookup"] = stats.seconds.get("lookup", 0.0) + time.perf_counter() - t
            if self.request.options.auto:
                self._control(segments)
            return segments, self.blend

        return cache.fuse(lookup, kv, counter, observe=self._observe, deadline=self.deadline)

    def _record_prefill(self, report: FusionReport, counter: LookupCounter, prefill_start: float) -> None:
        s = self.stats
        s.seconds["lookup"] -= counter.precompute_s
        s.seconds["precompute"] = counter.precompute_s
        s.seconds["load"] = report.load_s
        s.seconds["load_exposed"] = report.load_exposed_s
        s.seconds["load_hidden"] = max(0.0, report.load_s - report.load_exposed_s)
        s.seconds["prefill"] = time.perf_counter() - prefill_start - counter.precompute_s - s.seconds["lookup"]
        s.store_hits, s.store_misses, s.store_rejected = counter.hits, counter.misses, counter.rejected
        s.take_prefill(report)

    # -- the token loop ------------------------------------------------------------------
    def _pieces(self) -> Generator[str, None, None]:
        eng = self.engine
        n = len(self.request.prompt.all_ids)
        budget = min(self.sampling.max_new_tokens, eng.context_length - n)
        kv = eng.kv_pool.take(eng.decoder.shape, n + budget, eng.device)
        try:
            yield from self._run(kv, budget)
        finally:  # also when the consumer stops early: the buffer goes to the next request
            eng.kv_pool.give_back(kv)

    def _run(self, kv: KVCache, budget: int) -> Generator[str, None, None]:
        eng = self.engine
        # Inference mode is entered per step, not around the generator: a consumer may
        # pull each piece on another thread (async adapters do), and the mode is per thread.
        with torch.inference_mode():
            counter = LookupCounter()
            t = time.perf_counter()
            report = self._prefill(kv, counter)
            sampler = Sampler(self.sampling)
            token = sampler(report.logits)
            self._record_prefill(report, counter, t)
            ttft = time.perf_counter() - self.request.t0
        eng.chunks.learn_later(counter.deferred)  # off the critical path: the first token is out

        text = TextStream(eng.tokenizer, self.sampling.stop)
        tokens: list[int] = []
        finish = "length"
        eos: set[int] = set() if self.sampling.ignore_eos else eng.eos_ids
        # the engine's own decode time: the consumer's, while it holds a piece, is not counted
        decode_s, t = 0.0, time.perf_counter()
        while token not in eos:
            tokens.append(token)
            piece = text.push(token)
            if piece:
                decode_s += time.perf_counter() - t
                yield piece
                t = time.perf_counter()
            if text.stopped or len(tokens) >= budget:
                break
            check_deadline(self.deadline, f"decoding, after {len(tokens)} tokens")
            with torch.inference_mode():
                token = sampler(eng.decode_step(eng.decoder, kv, token))
        if token in eos or text.stopped:
            finish = "stop"
        tail = text.flush()
        self.stats.seconds["decode"] = decode_s + time.perf_counter() - t
        if tail:
            yield tail
        self.stats.new_tokens = len(tokens)
        self.result = Result(text=text.text, token_ids=tokens, ttft_s=ttft, stats=self.stats, finish_reason=finish,
                             first_token_logits=report.logits, hkvd_positions=report.hkvd_positions.tolist())
