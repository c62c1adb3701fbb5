"""The engine: ingestion, prompt assembly, store lookups, fused prefill, decode, stats."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from .blend.controller import LoadingController
from .blend.fusor import FusionReport, KVCache, Segment, decode_step, fused_prefill
from .blend.selection import BlendConfig
from .chat import ROLES, plan_chat  # noqa: F401 - ROLES re-exported
from .decode import Sampler, TextStream
from .errors import CacheBlendError, UnknownChunkError  # noqa: F401 - re-exported
from .models.decoder import Decoder
from .models.loader import LoadedModel, load_model
from .options import METHODS, RequestOptions  # noqa: F401 - METHODS re-exported
from .passages import PassageIndex
from .prompt import PromptBuilder, PromptIds
from .store import ChunkKV, CorruptEntry, LayerSource, Tier, chunk_key, open_store, tier_total
from .store.entry import PrefixView

_ATTEMPTS = 3


_SHARED: dict[tuple, Engine] = {}
_SHARED_LOCK = threading.Lock()


@dataclass(frozen=True)
class ChunkHandle:
    """A stored chunk: ``key`` identifies its cache; the token ids let an evicted cache be
    recomputed instead of failing."""

    key: str
    num_tokens: int
    token_ids: tuple[int, ...] = field(default=(), repr=False)
    model_fingerprint: str = field(default="", repr=False)


@dataclass
class BlendStats:
    method: str
    recompute_ratio: float
    prompt_tokens: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    computed_tokens: int = 0
    store_hits: int = 0
    store_misses: int = 0
    store_rejected: int = 0  # entries found but not trusted (corrupt, foreign): recomputed
    chunks: int = 0  # chunks in the prompt (given, or found in its text)
    chunks_learned: int = 0  # of those, paragraphs not known before, now cached
    new_tokens: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    controller: dict | None = None  # what the loading controller chose and why

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Result:
    text: str
    token_ids: list[int]
    ttft_s: float
    stats: BlendStats
    finish_reason: str = "length"
    first_token_logits: torch.Tensor | None = field(default=None, repr=False)
    hkvd_positions: list[int] = field(default_factory=list, repr=False)

    @property
    def usage(self) -> dict[str, int]:
        """Token counts as OpenAI-style APIs report them; ``cached_tokens`` are prompt
        tokens whose K/V came from a cache (reused chunks not recomputed, exact prefix)."""
        s = self.stats
        return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.new_tokens,
                "total_tokens": s.prompt_tokens + s.new_tokens, "cached_tokens": s.reused_tokens}

    def metadata(self) -> dict:
        """TTFT, finish reason and the blend stats, for a framework's response metadata."""
        return {"ttft_s": self.ttft_s, "finish_reason": self.finish_reason, **self.stats.as_dict()}


class Engine:
    """Loads a model and answers RAG prompts built from cached chunks.

    >>> engine = Engine.load()
    >>> handles = engine.ingest(["Paris is the capital of France."])
    >>> engine.generate("What is the capital of France?", chunks=handles).text
    """

    def __init__(self, loaded: LoadedModel, store: Tier, device: str = "cpu", chunk_sink: str = "bos") -> None:
        self.model_dir = loaded.folder
        self.model_name = loaded.name
        self.fingerprint: str = loaded.fingerprint
        self.tokenizer = loaded.tokenizer
        self.decoder = Decoder(loaded.model)
        self.store = store
        self.prefetch = True  # pipelined layer loading; off only to measure its effect
        self.controller = LoadingController()
        self.device = torch.device(device)
        self.prompts = PromptBuilder(self.tokenizer)
        self._separator = self.prompts.encode(self.prompts.chunk_separator)
        self.passages = PassageIndex()  # texts of cached chunks, to find them in formatted prompts
        self.learn_min_chars = 200  # paragraphs this long in a prompt become chunks (start_chat)
        self._prefill_lock = threading.Lock()  # store and controller are shared; decode is not
        self._sink = self.prompts.sink_ids(chunk_sink)
        self.chunk_policy = "chunk:sink=" + ",".join(map(str, self._sink))
        eos = self.tokenizer.eos_token_id
        gen_eos = getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None)
        self.eos_ids = {t for t in ([eos] + (gen_eos if isinstance(gen_eos, list) else [gen_eos])) if t is not None}

    @classmethod
    def load(
        cls,
        model: str | os.PathLike | None = None,
        *,
        store: str | Tier | None = None,
        device: str = "cpu",
        dtype: torch.dtype | str | None = None,
        chunk_sink: str = "bos",
    ) -> Engine:
        """Load ``model`` (None: the default SmolLM2-135M-Instruct; or an HF folder or
        ``.gguf`` file) with a KV ``store`` (spec string or store object).
        ``chunk_sink`` is the precompute policy, see :meth:`PromptBuilder.sink_ids`."""
        loaded = load_model(model, device=device, dtype=dtype)
        return cls(loaded, open_store(store), device=device, chunk_sink=chunk_sink)

    @classmethod
    def shared(cls, model: str | os.PathLike | None = None, *, store: str | None = None, **options) -> Engine:
        """One engine per (model, store spec, options) in this process, so that every
        framework object built on the same model shares its weights, store and the
        passages it knows.  ``store`` must be a spec string (or None, the default)."""
        if store is not None and not isinstance(store, str):
            raise CacheBlendError("Engine.shared takes a store spec string; pass a store object to Engine.load")
        key = (str(model) if model is not None else None, store, tuple(sorted((k, str(v)) for k, v in options.items())))
        with _SHARED_LOCK:
            engine = _SHARED.get(key)
            if engine is None:
                engine = _SHARED[key] = cls.load(model, store=store, **options)
        return engine

    @property
    def context_length(self) -> int:
        return self.decoder.shape.max_positions

    # -- ingestion -------------------------------------------------------------------
    def ingest(self, texts: Iterable[str] | str) -> list[ChunkHandle]:
        """Precompute and store each chunk's KV; chunks already stored cost nothing."""
        if isinstance(texts, str):
            texts = [texts]
        handles = []
        for text in texts:
            ids = self.prompts.chunk_ids(text)
            handles.append(self._handle(ids))
            with self._prefill_lock:
                self._chunk_kv(handles[-1], _Counter())
            self.passages.add(text)
        return handles

    def release(self, chunks: Iterable[ChunkHandle | str] | str) -> int:
        """Forget chunks (texts or handles) and delete their caches from every tier, e.g.
        when the documents they came from leave an index.  Returns how many were stored."""
        if isinstance(chunks, (str, ChunkHandle)):
            chunks = [chunks]
        removed = 0
        for c in chunks:
            if isinstance(c, str):
                self.passages.discard(c)
                c = self._handle(self.prompts.chunk_ids(c))
            if not isinstance(c, ChunkHandle):
                raise CacheBlendError(f"release takes ChunkHandle or str, got {type(c).__name__}")
            removed += bool(self.store.delete(c.key))
        return removed

    def _handle(self, ids: list[int]) -> ChunkHandle:
        return ChunkHandle(
            key=chunk_key(self.fingerprint, ids, self.chunk_policy),
            num_tokens=len(ids),
            token_ids=tuple(ids),
            model_fingerprint=self.fingerprint,
        )

    def precompute_chunk(self, ids: Sequence[int]) -> ChunkKV:
        """K (pre-RoPE) and V of ``ids`` run behind the sink token at position 0, with the
        sink's own K/V dropped (DESIGN.md, chunk precompute)."""
        kv = self._prefill_kv(list(self._sink) + list(ids), keep_from=len(self._sink))
        return ChunkKV(kv.k, kv.v, self._meta(ids, self.chunk_policy))

    def _prefix_cache(self, ids: Sequence[int]) -> ChunkKV:
        kv = self._prefill_kv(list(ids))
        return ChunkKV(kv.k, kv.v, self._meta(ids, "prefix"))

    def _meta(self, ids: Sequence[int], policy: str) -> dict[str, str]:
        """Who made a cache: stored in its header and checked when it is read."""
        return {"model": self.fingerprint, "policy": policy,
                "tokens_sha256": chunk_key("", ids, ""), "num_tokens": str(len(ids))}

    def _prefill_kv(self, ids: list[int], keep_from: int = 0) -> ChunkKV:
        shape = self.decoder.shape
        n = len(ids)
        if n > shape.max_positions:
            raise CacheBlendError(f"chunk of {n} tokens exceeds the model's context of {shape.max_positions}")
        out_k = torch.empty((shape.num_layers, shape.num_kv_heads, n - keep_from, shape.head_dim), dtype=shape.dtype)
        out_v = torch.empty_like(out_k)

        def capture(layer, positions, k, v):
            out_k[layer] = k[:, keep_from:]
            out_v[layer] = v[:, keep_from:]

        kv = KVCache(shape, n, self.device)
        with torch.inference_mode():
            fused_prefill(self.decoder, [Segment(ids)], kv, BlendConfig(), capture=capture)
        return ChunkKV(out_k, out_v)

    def _chunk_kv(self, handle: ChunkHandle, counter: _Counter) -> LayerSource:
        """A chunk is stored followed by the chunk separator; one that a template puts
        elsewhere (not followed by a blank line) is served from that same entry's first
        tokens (:class:`PrefixView`), so each passage is computed and stored once."""
        ids = list(handle.token_ids)
        sep = self._separator
        if not sep or ids[-len(sep):] == sep:
            return self._lookup(handle.key, ids, self.precompute_chunk, counter)
        full = ids + sep
        source = self._lookup(chunk_key(self.fingerprint, full, self.chunk_policy), full, self.precompute_chunk,
                              counter)
        return PrefixView(source, len(ids))

    def _prefix_kv(self, ids: list[int], counter: _Counter) -> LayerSource:
        """Exact K/V of a prompt prefix computed at position 0 (prefix caching)."""
        return self._lookup(chunk_key(self.fingerprint, ids, "prefix"), ids, self._prefix_cache, counter)

    def _lookup(self, key: str, ids: Sequence[int], compute, counter: _Counter) -> LayerSource:
        """The stored cache for ``key`` (read lazily, layer by layer), else ``compute(ids)``
        stored under it.  An entry made by another model is dropped, never served."""
        source = None if counter.bypass_store else self.store.open(key)
        if source is not None:
            model = source.meta.get("model")
            if source.num_tokens == len(ids) and model in (None, self.fingerprint):
                counter.hits += 1
                return source
            counter.foreign += 1
            self.store.delete(key)
        counter.misses += 1
        t = time.perf_counter()
        kv = compute(list(ids))
        self.store.put(key, kv)
        counter.precompute_s += time.perf_counter() - t
        return kv

    # -- answering -------------------------------------------------------------------
    def generate(
        self,
        query: str,
        chunks: Sequence[ChunkHandle | str] = (),
        *,
        system: str | None = None,
        method: str = "blend",
        recompute_ratio: float = 0.15,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        **options,
    ) -> Result:
        """Answer ``query`` over ``chunks`` (handles or raw texts, in prompt order) with
        ``method``: ``"full"``, ``"prefix"``, ``"reuse"`` or ``"blend"``.  Further options
        are those of :meth:`start`."""
        run = self.start(query, chunks, system=system, method=method, recompute_ratio=recompute_ratio,
                         max_new_tokens=max_new_tokens, temperature=temperature, **options)
        for _ in run.pieces:
            pass
        assert run.result is not None
        return run.result

    def stream(self, query: str, chunks: Sequence[ChunkHandle | str] = (), **options) -> Iterator[str]:
        """Yield the answer's text pieces as they are decoded (options as :meth:`start`);
        bad input raises here, before the first piece."""
        return self.start(query, chunks, **options).pieces

    def start(
        self,
        query: str,
        chunks: Sequence[ChunkHandle | str] = (),
        *,
        system: str | None = None,
        preamble: str = "",
        **options,
    ) -> Generation:
        """Validate a request now and return its :class:`Generation`, which runs lazily:
        iterate ``.pieces`` for text, then read ``.result`` (stats, TTFT).

        ``system``: system message (None keeps the chat template's default);
        ``preamble``: text before the chunks in the user turn; ``method``;
        ``recompute_ratio`` (a share, or ``"auto"``: the loading controller picks it, never
        below ``quality_floor``), ``check_layers``, ``deviation`` (``"v"``, ``"k"``, ``"kv"``),
        ``gradual``: the HKVD selection (see :class:`BlendConfig`); ``max_new_tokens``,
        ``temperature``, ``top_p``, ``stop``, ``seed``: decoding (defaults: :class:`RequestOptions`)."""
        t0 = time.perf_counter()
        if not isinstance(query, str) or not query.strip():
            raise CacheBlendError("query must be a non-empty string")
        if isinstance(chunks, (str, ChunkHandle)):
            chunks = [chunks]
        handles = [self._resolve(c) for c in chunks]
        prompt = self.prompts.build(query, [list(h.token_ids) for h in handles], system, preamble)
        return self._begin(prompt, handles, t0, **options)

    def start_chat(
        self,
        messages: Sequence[dict[str, str]],
        documents: Sequence[str] = (),
        *,
        learn: bool = True,
        **options,
    ) -> Generation:
        """Answer a chat whose messages may already hold the passages, formatted any way.

        Known passages (ingested, given as ``documents``, or learned before) are found in
        the message contents by their text and reused wherever they sit; with ``learn``,
        long paragraphs of system and user contents that are not known yet become chunks
        (cached now, reused next time), except the last paragraph of the last message.
        ``documents`` not already in the messages go in front of the last user message.
        Options are those of :meth:`start` except ``system``/``preamble``/``chunks``."""
        t0 = time.perf_counter()
        plan = plan_chat(self.prompts, self.passages, messages, documents, learn=learn,
                         learn_min_chars=self.learn_min_chars)
        handles = [self._handle(ids) for ids in plan.prompt.chunks]
        run = self._begin(plan.prompt, handles, t0, **options)
        run.stats.chunks_learned = len(plan.learned)
        return run

    def _begin(self, prompt: PromptIds, handles: list[ChunkHandle], t0: float, **options) -> Generation:
        opts = RequestOptions.parse(options)
        blend, sampling = opts.blend(self.decoder.shape.num_layers), opts.sampling()
        n = len(prompt.all_ids)
        if n >= self.context_length:
            raise CacheBlendError(
                f"prompt of {n} tokens does not fit the model's context of {self.context_length} tokens"
            )
        stats = BlendStats(method=opts.method, recompute_ratio=blend.recompute_ratio, chunks=len(handles))
        stats.seconds["tokenize"] = time.perf_counter() - t0
        run = Generation(self, prompt, handles, opts.method, blend, sampling, stats, t0)
        run.auto_ratio = opts.auto
        return run

    def _resolve(self, chunk: ChunkHandle | str) -> ChunkHandle:
        if isinstance(chunk, str):
            if not chunk.strip():
                raise CacheBlendError("a chunk must be a non-empty string")
            return self._handle(self.prompts.chunk_ids(chunk))
        if not isinstance(chunk, ChunkHandle):
            raise CacheBlendError(f"chunks take ChunkHandle or str, got {type(chunk).__name__}")
        if chunk.model_fingerprint and chunk.model_fingerprint != self.fingerprint:
            raise UnknownChunkError(f"chunk {chunk.key[:12]}… was made by another model")
        if not chunk.token_ids or chunk_key(self.fingerprint, chunk.token_ids, self.chunk_policy) != chunk.key:
            raise UnknownChunkError(
                f"unknown chunk handle {chunk.key[:12]}…: not made by Engine.ingest of this engine"
            )
        return chunk

    def fuse(
        self,
        lookup: Callable[[_Counter], tuple[list[Segment], BlendConfig]],
        kv: KVCache,
        counter: _Counter,
        observe: Callable[[list[Segment], FusionReport], None] | None = None,
    ) -> FusionReport:
        """Run ``lookup`` (the prompt's segments with their caches, and the selection to
        use) and the fused prefill into ``kv``, one request at a time: the store and the
        controller are shared (decoding, with its own KV cache, runs unlocked).  A cache
        that fails verification mid-read was dropped by its tier, so look up again (it is
        recomputed and replaced), bypassing the store on the last attempt.  The in-process
        engine and the vLLM connector's worker both prefill through here."""
        with self._prefill_lock:
            dropped = tier_total(self.store, "corrupt")
            for attempt in range(_ATTEMPTS):
                counter.bypass_store = attempt == _ATTEMPTS - 1
                segments, blend = lookup(counter)
                try:
                    report = fused_prefill(self.decoder, segments, kv, blend, prefetch=self.prefetch)
                except CorruptEntry:
                    counter.corrupt += 1
                    if counter.bypass_store:
                        raise
                    continue
                if observe is not None:
                    observe(segments, report)
                break
            # Damage found at open is a miss to the lookup but was counted by its tier.
            counter.corrupt = max(counter.corrupt, tier_total(self.store, "corrupt") - dropped)
        return report

    def segments(self, prompt: PromptIds, handles: list[ChunkHandle], method: str, counter: _Counter) -> list[Segment]:
        """The prompt as segments with the caches ``method`` may use."""
        if method == "full":
            return [Segment(prompt.all_ids)]
        body = prompt.body()
        if method == "prefix":
            first = next((i for i, (_, chunk) in enumerate(body) if chunk), None)
            head = prompt.prefix + (body[first][0] if first is not None else [])
            rest = [t for ids, _ in body[(first + 1 if first is not None else 0):] for t in ids]
            return [Segment(head, self._prefix_kv(head, counter), exact=True), Segment(rest)]
        segs = [Segment(prompt.prefix, self._prefix_kv(prompt.prefix, counter), exact=True)] if prompt.prefix else []
        chunk_handles = iter(handles)
        for ids, chunk in body:
            segs.append(Segment(ids, self._chunk_kv(next(chunk_handles), counter)) if chunk else Segment(ids))
        return segs


@dataclass
class _Counter:
    hits: int = 0
    misses: int = 0
    foreign: int = 0
    corrupt: int = 0
    precompute_s: float = 0.0
    bypass_store: bool = False


class Generation:
    """One request: fused prefill, then decode, yielding text pieces; ``result`` once the
    pieces are exhausted."""

    def __init__(self, engine: Engine, prompt: PromptIds, handles, method, blend, sampling, stats, t0) -> None:
        self.engine, self.prompt, self.handles = engine, prompt, handles
        self.method, self.blend, self.sampling, self.stats, self.t0 = method, blend, sampling, stats, t0
        self.result: Result | None = None
        self.auto_ratio = False  # let the loading controller pick the ratio ...
        self.floor = blend.recompute_ratio  # ... never below this
        self.pieces = self._pieces()

    def _lazy(self, segments: list[Segment]) -> list[Segment]:
        def lazy(src) -> bool:
            return not isinstance(src.source if isinstance(src, PrefixView) else src, ChunkKV)

        return [s for s in segments if s.cached is not None and lazy(s.cached)]

    def _layer_bytes(self, segments: list[Segment]) -> int:
        shape = self.engine.decoder.shape
        per_token = 2 * shape.num_kv_heads * shape.head_dim * shape.dtype.itemsize
        return per_token * sum(len(s.token_ids) for s in segments)

    def _control(self, segments: list[Segment]) -> None:
        """Let the loading controller pick the ratio for where these caches come from."""
        reused = [s for s in segments if s.cached is not None and not s.exact]
        lazy = self._lazy(segments)
        tier = lazy[0].cached.tier if lazy else "memory"  # type: ignore[union-attr]
        fixed = sum(len(s.token_ids) for s in segments if s.cached is None)
        d = self.engine.controller.decide(sum(len(s.token_ids) for s in reused), fixed,
                                          self._layer_bytes(lazy), tier, floor=self.floor)
        self.blend = replace(self.blend, recompute_ratio=d.ratio)
        self.stats.recompute_ratio = d.ratio
        self.stats.controller = d.as_dict() | {"floor": self.floor}

    def _observe(self, segments: list[Segment], report: FusionReport) -> None:
        ctl = self.engine.controller
        ctl.observe_compute(report.compute_s, sum(report.active_per_layer))
        lazy = self._lazy(segments)
        tiers = {s.cached.tier for s in lazy}  # type: ignore[union-attr]
        if len(tiers) == 1 and report.load_s > 0:
            ctl.observe_load(tiers.pop(), self._layer_bytes(lazy) * self.engine.decoder.shape.num_layers,
                             report.load_s)

    def _prefill(self, kv: KVCache, counter: _Counter) -> FusionReport:
        """Look the caches up (timed; the controller picks an ``auto`` ratio for them) and
        run the fused prefill through :meth:`Engine.fuse`."""
        eng, stats = self.engine, self.stats

        def lookup(counter: _Counter) -> tuple[list[Segment], BlendConfig]:
            t = time.perf_counter()
            segments = eng.segments(self.prompt, self.handles, self.method, counter)
            stats.seconds["lookup"] = stats.seconds.get("lookup", 0.0) + time.perf_counter() - t
            if self.auto_ratio:
                self._control(segments)
            return segments, self.blend

        return eng.fuse(lookup, kv, counter, observe=self._observe)

    def _pieces(self) -> Iterator[str]:
        eng, stats = self.engine, self.stats
        counter = _Counter()
        # Inference mode is entered per step, not around the generator: a consumer may
        # pull each piece on another thread (async adapters do), and the mode is per thread.
        with torch.inference_mode():
            n = len(self.prompt.all_ids)
            budget = min(self.sampling.max_new_tokens, eng.context_length - n)
            kv = KVCache(eng.decoder.shape, n + budget, eng.device)
            t = time.perf_counter()
            report = self._prefill(kv, counter)
            stats.seconds["lookup"] -= counter.precompute_s
            stats.seconds["precompute"] = counter.precompute_s
            stats.seconds["load"] = report.load_s
            stats.seconds["load_exposed"] = report.load_exposed_s
            stats.seconds["load_hidden"] = max(0.0, report.load_s - report.load_exposed_s)
            stats.store_hits, stats.store_misses = counter.hits, counter.misses
            stats.store_rejected = counter.foreign + counter.corrupt
            sampler = Sampler(self.sampling)
            token = sampler(report.logits)
            now = time.perf_counter()
            stats.seconds["prefill"] = now - t - counter.precompute_s - stats.seconds["lookup"]
            ttft = now - self.t0
            stats.prompt_tokens = report.prompt_tokens
            stats.reused_tokens = report.reused_tokens
            stats.recomputed_tokens = report.recomputed_tokens
            stats.computed_tokens = report.computed_tokens

        text = TextStream(eng.tokenizer, self.sampling.stop)
        tokens: list[int] = []
        finish = "length"
        t = time.perf_counter()
        while True:
            if token in eng.eos_ids:
                finish = "stop"
                break
            tokens.append(token)
            piece = text.push(token)
            if piece:
                yield piece
            if text.stopped:
                finish = "stop"
                break
            if len(tokens) >= budget:
                break
            with torch.inference_mode():
                logits = decode_step(eng.decoder, kv, token)
            token = sampler(logits)
        tail = text.flush()
        if tail:
            yield tail
        stats.seconds["decode"] = time.perf_counter() - t
        stats.new_tokens = len(tokens)
        self.result = Result(
            text=text.text,
            token_ids=tokens,
            ttft_s=ttft,
            stats=stats,
            finish_reason=finish,
            first_token_logits=report.logits,
            hkvd_positions=report.hkvd_positions.tolist(),
        )
