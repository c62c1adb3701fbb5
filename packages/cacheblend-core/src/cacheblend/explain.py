"""What CacheBlend does to one prompt, measured on the real engine (``Engine.explain``).

The figures that explain the paper, for *your* prompt:

- **KV deviation** per token at the check layer: how far each chunk token's reused K/V
  is from what full prefill computes there (paper §4.3).  Every token is computed up to
  the check layer, so the fresh side is full prefill's own K/V.
- **The recompute set**: the chunk-shift sample and the HKVD tokens, the chunk tokens of
  highest deviation; for any ratio (``Explanation.recomputed(ratio)``) without computing
  anything again.
- **Attention maps** (on request) at one layer, averaged over heads, under full prefill,
  full reuse and blend.  Rows of tokens a method computes are its real attention; rows of
  reused tokens are the attention their cache was made with (its own chunk only: the
  cross-attention that reuse loses, paper Fig. 3).
- **Both answers**: full prefill's and the chosen method's, with their stats.
- **Speed** (:func:`speed_sweep`): TTFT against the number of chunks per method, with
  the answer's F1 against full prefill's.

The UI (``cacheblend ui``) only draws these.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor

from .blend.fusor import KVCache, Segment, fused_prefill
from .blend.hint import check_pool
from .blend.selection import Candidates, choose, kv_deviation
from .blend.shift import evenly_spaced
from .cache.chunks import ATTEMPTS, LookupCounter
from .cache.segments import behind_sink, prompt_segments
from .config import BlendConfig, RequestOptions
from .datasets import token_f1
from .errors import CacheBlendError
from .results import ChunkHandle, Result
from .store import CorruptEntry, LayerSource

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["AttentionMaps", "Explanation", "PromptToken", "explain", "speed_sweep"]
T = TypeVar("T")


@dataclass(frozen=True)
class PromptToken:
    """One prompt token: its text, which part of the prompt it is in (``"system"``,
    ``"chunk"``, ``"between"`` or ``"question"``) and its chunk's index."""

    text: str
    part: str
    chunk: int | None = None


@dataclass
class AttentionMaps:
    """``[n, n]`` attention (mean over heads) at ``layer`` under each method; row i is
    what token i attends to.  ``boundaries``: where each chunk and the question start."""

    layer: int
    full: Tensor
    reuse: Tensor
    blend: Tensor
    boundaries: list[int]


@dataclass
class Explanation:
    tokens: list[PromptToken]
    deviation: Tensor  # [n] at check_layer; 0 outside chunks
    check_layer: int
    recompute_ratio: float
    attention: AttentionMaps | None = None
    full: Result | None = None
    blended: Result | None = None
    options: dict[str, Any] = field(default_factory=dict)
    shift_share: float = 0.0  # the request's chunk-shift sample (BlendConfig.shift_share)
    chunk_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each approximate chunk
    check_pool: float = 1.0  # the request's BlendConfig.check_pool
    pool: Tensor | None = None  # [n] bool: the check pool, where one applies (None: every chunk token)

    @property
    def candidates(self) -> Tensor:
        """Positions of the approximately reused chunk tokens (what may be recomputed); a
        chunk reused exactly (right behind its sink) has none."""
        return torch.tensor([i for a, b in self.chunk_spans for i in range(a, b)], dtype=torch.long)

    def recomputed(self, ratio: float | None = None) -> Tensor:
        """``[n]`` bool: the chunk tokens the blend recomputes at ``ratio`` (default: the
        request's): ``round(ratio × chunk tokens)`` in all, the chunk-shift sample
        (:func:`cacheblend.blend.shift.evenly_spaced`) first, then the HKVD tokens, those of
        highest deviation (within the check pool, where one applies), as the fusor chooses them."""
        ratio = self.recompute_ratio if ratio is None else ratio
        if not 0.0 <= ratio <= 1.0:
            raise CacheBlendError(f"ratio must be in [0, 1], got {ratio!r}")
        cand = self.candidates
        keep = round(ratio * cand.numel())
        out = torch.zeros(len(self.tokens), dtype=torch.bool)
        if keep >= cand.numel():
            out[cand] = True
            return out
        if self.shift_share > 0.0 and ratio > 0.0:
            out |= evenly_spaced(self.chunk_spans, min(self.shift_share, ratio), len(self.tokens), out.device)
            keep -= int(out.sum())
        rest = cand[~out[cand]]
        if self.pool is not None and ratio < self.check_pool:  # the check ranks only its pool
            rest = rest[self.pool[rest]]
        if keep > 0:  # the fusor's own choice (its order, its ties), by deviation
            chunk = torch.zeros(len(self.tokens), dtype=torch.long)
            offset = torch.zeros_like(chunk)
            for i, (start, end) in enumerate(self.chunk_spans):
                chunk[start:end], offset[start:end] = i, torch.arange(end - start)
            rows = Candidates(self.deviation[rest], None, chunk[rest], offset[rest])
            out[rest[choose(BlendConfig(), rows, keep)]] = True
        return out

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready); attention maps as nested lists."""
        out: dict[str, Any] = {
            "tokens": [t.__dict__ for t in self.tokens], "deviation": self.deviation.tolist(),
            "check_layer": self.check_layer, "recompute_ratio": self.recompute_ratio,
            "recomputed": self.recomputed().tolist(), "options": self.options,
        }
        for name in ("full", "blended"):
            r = getattr(self, name)
            out[name] = None if r is None else {"text": r.text, "ttft_s": r.ttft_s, "stats": r.stats.as_dict()}
        if self.attention is not None:
            a = self.attention
            out["attention"] = {"layer": a.layer, "boundaries": a.boundaries,
                                **{m: getattr(a, m).tolist() for m in ("full", "reuse", "blend")}}
        return out


def explain(engine: Engine, query: str, chunks: Sequence[ChunkHandle | str], *, system: str | None = None,
            preamble: str = "", attention_layer: int | None = None, answers: bool = True,
            **options: Any) -> Explanation:
    """See :meth:`Engine.explain`."""
    opts = RequestOptions.parse(options)
    shape = engine.decoder.shape
    blend = opts.blend(shape.num_layers)
    if attention_layer is not None and not 0 <= attention_layer < shape.num_layers:
        raise CacheBlendError(f"attention_layer must be in [0, {shape.num_layers - 1}], got {attention_layer!r}")
    handles = engine.ingest([c for c in chunks if isinstance(c, str)]) if chunks else []
    given = iter(handles)
    handles = [c if isinstance(c, ChunkHandle) else next(given) for c in chunks]
    prompt = engine.prompts.build(query, [list(h.token_ids) for h in handles], system, preamble)
    engine.check_fits(prompt)  # as a request is; the attention maps alone would need n x n per head
    tokens, spans = _tokens(engine, prompt)
    check = blend.check_layers[0]
    probe = _Probe(engine, attention_layer)
    # The fresh K/V at the check layer come from the blend's own fused prefill (every token
    # computed up to the check layer, as at any ratio below 1), not from a separate full
    # prefill: the two agree only up to rounding, and where the caches are almost exact (a
    # chunk right behind the frame it was precomputed behind) rounding decides the ranking.

    def read() -> tuple[tuple[Tensor, Tensor], list[LayerSource], list[tuple[Tensor, Tensor]]]:
        segments = prompt_segments(engine.chunks, prompt, handles, "blend", LookupCounter())
        fresh = probe.run(segments, replace(blend, recompute_ratio=1.0), capture_layer=check)
        cached = [engine.chunks.chunk_source(h, LookupCounter()) for h in handles]
        return fresh, cached, [source.layer(check) for source in cached]

    fresh, cached, at_check = _recomputing_damaged(read)
    # A chunk right behind its sink is reused exactly (cache/segments.py): never a candidate.
    approx = [i for i, (start, _) in enumerate(spans) if not behind_sink(engine.chunks, prompt.all_ids[:start])]
    deviation = torch.zeros(len(tokens))
    for i in approx:
        (start, end), (k, v) = spans[i], at_check[i]
        deviation[start:end] = kv_deviation(fresh[0][:, start:end], fresh[1][:, start:end], k, v, blend.deviation)
    pool = check_pool([(*spans[i], cached[i].meta) for i in approx], blend.check_pool,
                      len(tokens), torch.device("cpu")) if blend.check_pool < 1.0 else None
    out = Explanation(tokens, deviation, check, blend.recompute_ratio, options=dict(options),
                      shift_share=blend.shift_share, chunk_spans=[spans[i] for i in approx],
                      check_pool=blend.check_pool, pool=pool)
    if attention_layer is not None:
        out.attention = probe.maps(prompt, handles, spans, tokens, blend)
    if answers:
        out.full = engine.generate(query, handles, system=system, preamble=preamble, **(options | {"method": "full"}))
        out.blended = engine.generate(query, handles, system=system, preamble=preamble, **options)
    return out


def _tokens(engine: Engine, prompt) -> tuple[list[PromptToken], list[tuple[int, int]]]:
    """Every prompt token with its part, and each chunk's ``[start, end)``."""
    decode = engine.prompts.tokenizer.decode
    tokens = [PromptToken(decode([t]), "system") for t in prompt.prefix]
    spans, chunk = [], 0
    body = prompt.body()
    for i, (ids, is_chunk) in enumerate(body):
        part = "chunk" if is_chunk else ("question" if i == len(body) - 1 else "between")
        if is_chunk:
            spans.append((len(tokens), len(tokens) + len(ids)))
        tokens += [PromptToken(decode([t]), part, chunk if is_chunk else None) for t in ids]
        chunk += is_chunk
    return tokens, spans


class _Probe:
    """Runs the fused prefill with hooks: K/V at one layer, attention rows at another."""

    def __init__(self, engine: Engine, layer: int | None) -> None:
        self.engine, self.layer = engine, layer
        self.rows: dict[int, Tensor] = {}

    def _attend(self, layer: int, active: Tensor, q: Tensor, keys: Tensor) -> None:
        if layer != self.layer:
            return
        k = keys.repeat_interleave(self.engine.decoder.shape.groups, dim=0).float()
        scores = (q.float() @ k.transpose(1, 2)) * self.engine.decoder.scaling  # [H, a, n]
        future = torch.arange(keys.shape[1])[None, :] > active[:, None]
        probs = scores.masked_fill(future[None], float("-inf")).softmax(dim=-1).mean(dim=0)
        for row, pos in zip(probs, active.tolist(), strict=True):
            self.rows[pos] = row

    def _run_prompt(self, prompt: Any, handles: list[ChunkHandle], config: BlendConfig) -> None:
        self.run(prompt_segments(self.engine.chunks, prompt, handles, "blend", LookupCounter()), config)

    def run(self, segments: list[Segment], config: BlendConfig, capture_layer: int | None = None):
        """The prefill of ``segments``; returns K (pre-RoPE) and V at ``capture_layer``."""
        eng, shape = self.engine, self.engine.decoder.shape
        n = sum(len(s.token_ids) for s in segments)
        keys = torch.zeros(shape.num_kv_heads, n, shape.head_dim)
        values = torch.zeros_like(keys)

        def capture(layer: int, positions: Tensor, k: Tensor, v: Tensor) -> None:
            if layer == capture_layer:
                keys[:, positions], values[:, positions] = k.float(), v.float()

        self.rows = {}
        with torch.inference_mode(), eng.chunks.lock:
            fused_prefill(eng.decoder, segments, KVCache(shape, n, eng.device), config, capture=capture,
                          attend=self._attend if self.layer is not None else None)
        return keys, values

    def _matrix(self, n: int) -> Tensor:
        out = torch.zeros(n, n)
        for pos, row in self.rows.items():
            out[pos] = row[:n]
        return out

    def maps(self, prompt, handles: list[ChunkHandle], spans: list[tuple[int, int]], tokens: list[PromptToken],
             blend: BlendConfig) -> AttentionMaps:
        eng, n = self.engine, len(tokens)
        assert self.layer is not None
        self.run([Segment(prompt.all_ids)], BlendConfig())
        full = self._matrix(n)
        own = torch.zeros(n, n)  # the rows reused caches were made with: their own chunk only
        sink = len(eng.chunks.sink)
        for h, (start, end) in zip(handles, spans, strict=True):
            self.run([Segment(list(eng.chunks.sink) + list(h.token_ids))], BlendConfig())
            block = self._matrix(sink + end - start)[sink:, sink:]
            own[start:end, start:end] = block
        own[: len(prompt.prefix)] = full[: len(prompt.prefix)]  # the prefix is exact
        for start, end in spans:
            if behind_sink(eng.chunks, prompt.all_ids[:start]):  # so is a chunk right behind its sink
                own[start:end] = full[start:end]
        maps = []
        for ratio in (0.0, blend.recompute_ratio):
            config = BlendConfig(**{**blend.__dict__, "recompute_ratio": ratio})
            _recomputing_damaged(functools.partial(self._run_prompt, prompt, handles, config))
            m = own.clone()
            for pos, row in self.rows.items():
                m[pos] = row[:n]
            maps.append(m)
        bounds = [s for s, _ in spans] + [next(i for i, t in enumerate(tokens) if t.part == "question")]
        return AttentionMaps(self.layer, full, maps[0], maps[1], bounds)


def _recomputing_damaged(read: Callable[[], T]) -> T:
    """``read()``, again when a cache it read turned out damaged: its tier dropped the entry,
    so the next lookup recomputes it (as :meth:`ChunkCache.fuse` does for a request); a
    damaged store must not fail an explanation either."""
    for attempt in range(ATTEMPTS):
        try:
            return read()
        except CorruptEntry:
            if attempt == ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def speed_sweep(engine: Any, query: str, passages: list[str], methods: Sequence[str], ratio: float,
          max_new_tokens: int = 16, progress: Callable[[float, str], None] | None = None,
          repeats: int = 3) -> list[dict[str, Any]]:
    """Median TTFT over ``repeats`` runs of each method for the first 1..k passages (k =
    all), measured now on this engine, with the token F1 of each answer against full
    prefill's (the quality number under each bar).  Caches are ingested first, so TTFT
    is the request's own."""
    engine.ingest(passages)
    steps = [(k, m) for k in range(1, len(passages) + 1) for m in methods]
    records, full_text = [], {}
    for i, (k, method) in enumerate(steps):
        if progress is not None:
            progress(i / len(steps), f"{method}, {k} chunk(s)")
        opts: dict[str, Any] = {"method": method, "max_new_tokens": max_new_tokens}
        if method == "blend":
            opts["recompute_ratio"] = ratio
        runs = [engine.generate(query, passages[:k], **opts) for _ in range(repeats)]
        if method == "full":
            full_text[k] = runs[0].text
        records.append({"chunks": k, "method": method, "text": runs[0].text,
                        "ttft_median_s": statistics.median(r.ttft_s for r in runs)})
    for rec in records:
        ref = full_text.get(rec["chunks"])
        rec["output_f1_vs_full"] = None if ref is None else token_f1(rec["text"], ref)
    return records
