"""``Engine``: the in-process backend, a thin facade over the data flow.

    ingest  → :mod:`cacheblend.cache.chunks`  (chunk keys, precompute, lookup, release)
    store   → :mod:`cacheblend.store`         (memory, disk, Redis tiers)
    fuse    → :mod:`cacheblend.blend.fusor`   (layer-wise fused prefill, HKVD selection)
    decode  → :mod:`cacheblend.generate`      (decode cache, sampling, the token loop)

It implements :class:`cacheblend.backend.Backend`, as :class:`cacheblend.remote.RemoteEngine`
does for a vLLM server, so framework adapters work with either.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from .backend import Answering, check_request
from .blend.controller import LoadingController
from .cache.chunks import ChunkCache
from .chat import HeadMemory, plan_chat
from .config import EngineConfig, RequestOptions, chunk_sink_for
from .errors import CacheBlendError
from .generate.compiled import CompiledStep
from .generate.decode import KVCache, decode_step
from .generate.generation import Generation, Request
from .generate.kv_pool import KVPool
from .models.decoder import Decoder
from .models.loader import LoadedModel, load_model
from .passages import PassageIndex
from .prompt import PromptBuilder, PromptIds
from .results import ChunkHandle
from .store import ChunkKV, Tier, open_store

if TYPE_CHECKING:
    from .explain import Explanation

_SHARED: dict[tuple, Engine] = {}
_SHARED_LOCK = threading.Lock()


class Engine(Answering):
    """Loads a model and answers RAG prompts built from cached chunks.

    >>> engine = Engine.load()
    >>> handles = engine.ingest(["Paris is the capital of France."])
    >>> engine.generate("What is the capital of France?", chunks=handles).text
    """

    def __init__(self, loaded: LoadedModel, store: Tier, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.model_dir = loaded.folder
        self.model_name = loaded.name
        self.fingerprint: str = loaded.fingerprint
        self.tokenizer = loaded.tokenizer
        self.decoder = Decoder(loaded.model, compile=self.config.compile, pack=self.config.pack_weights,
                               onednn=self.config.onednn_weights, native_attention=self.config.native_attention)
        # The token loop's step: one compiled graph, or the eager layer-by-layer step.
        self.decode_step: Callable[[Decoder, KVCache, int], torch.Tensor] = \
            CompiledStep(self.decoder) if self.config.compile_decode else decode_step
        self.device = torch.device(self.config.device)
        self.kv_pool = KVPool(self.config.reuse_kv_buffer)  # one fused KV buffer kept between requests
        # Layers are read beside the fusor or before it, decided per prefill by the tiers
        # read (loader.pipelined); the controller applies the same rule per tier, so its
        # ``auto`` ratio hides loading wherever the loader reads ahead (Redis on any host).
        self.controller = LoadingController(prefetch=self.config.prefetch)
        self.prompts = PromptBuilder(self.tokenizer)
        self.passages = PassageIndex()  # texts of cached chunks, to find them in formatted prompts
        self.heads = HeadMemory()  # system-message openings seen before: the fixed instruction
        self.chunk_sink: str = chunk_sink_for(self.config.chunk_sink, self.decoder.shape.model_type)
        kv_dtype = getattr(torch, self.config.kv_dtype) if self.config.kv_dtype else None
        self.chunks = ChunkCache(self.decoder, store, self.prompts, self.fingerprint,
                                 self.prompts.sink_ids(self.chunk_sink), self.device, self.config.prefetch,
                                 kv_dtype)
        eos = self.tokenizer.eos_token_id
        gen_eos = getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None)
        self.eos_ids = {t for t in ([eos] + (gen_eos if isinstance(gen_eos, list) else [gen_eos])) if t is not None}

    @classmethod
    def load(
        cls,
        model: str | os.PathLike | None = None,
        *,
        store: str | Tier | None = None,
        config: EngineConfig | None = None,
        **settings: Any,
    ) -> Engine:
        """Load ``model`` (None: the default SmolLM2-135M-Instruct; or an HF folder or
        ``.gguf`` file) with a KV ``store`` (spec string or store object).  ``settings``
        are :class:`EngineConfig` fields (``device``, ``dtype``, ``chunk_sink``, ...)."""
        config = _engine_config(config, settings)
        loaded = load_model(model, device=config.device, dtype=config.dtype)
        return cls(loaded, open_store(store), config)

    @classmethod
    def shared(cls, model: str | os.PathLike | None = None, *, store: str | None = None, **settings: Any) -> Engine:
        """One engine per (model, store spec, settings) in this process, so that every
        framework object built on the same model shares its weights, store and the
        passages it knows.  ``store`` must be a spec string (or None, the default)."""
        if store is not None and not isinstance(store, str):
            raise CacheBlendError("Engine.shared takes a store spec string; pass a store object to Engine.load")
        options = tuple(sorted((k, str(v)) for k, v in settings.items()))
        key = (str(model) if model is not None else None, store, options)
        with _SHARED_LOCK:
            engine = _SHARED.get(key)
            if engine is None:
                engine = _SHARED[key] = cls.load(model, store=store, **settings)
        return engine

    @property
    def store(self) -> Tier:
        """The KV store the chunk caches live in (assigning one switches the engine to it)."""
        return self.chunks.store

    @store.setter
    def store(self, store: Tier) -> None:
        self.chunks.store = store

    @property
    def context_length(self) -> int:
        return self.decoder.shape.max_positions

    @property
    def learn_min_chars(self) -> int:
        """Paragraphs at least this long in a chat prompt become chunks (:class:`EngineConfig`)."""
        return self.config.learn_min_chars

    @learn_min_chars.setter
    def learn_min_chars(self, chars: int) -> None:
        self.config = replace(self.config, learn_min_chars=chars)

    # -- ingestion -------------------------------------------------------------------
    def ingest(self, texts: Iterable[str] | str) -> list[ChunkHandle]:
        """Precompute and store each chunk's KV; chunks already stored cost nothing."""
        return [handle for handle, _ in self.ingest_status(texts)]

    def ingest_status(self, texts: Iterable[str] | str) -> list[tuple[ChunkHandle, bool]]:
        """As :meth:`ingest`, with whether each chunk was computed now (False: it was
        already stored)."""
        if isinstance(texts, str):
            texts = [texts]
        out = []
        for text in texts:
            handle = self.chunks.handle_of(text)
            out.append((handle, self.chunks.ingest(handle)))
            self.passages.add(text)
        return out

    def handle(self, text: str) -> ChunkHandle:
        """The handle ``ingest(text)`` returns, without computing or storing anything."""
        return self.chunks.handle_of(text)

    def precompute_chunk(self, ids: Sequence[int]) -> ChunkKV:
        """A chunk's K (pre-RoPE) and V computed now, not stored (see :class:`ChunkCache`)."""
        return self.chunks.precompute(ids)

    def release(self, chunks: Iterable[ChunkHandle | str] | ChunkHandle | str) -> int:
        """Forget chunks (texts or handles) and delete their caches from every tier, e.g.
        when the documents they came from leave an index.  Returns how many were stored."""
        if isinstance(chunks, (str, ChunkHandle)):
            chunks = [chunks]
        removed = 0
        for c in chunks:
            if isinstance(c, str):
                self.passages.discard(c)
                c = self.chunks.handle_of(c)
            if not isinstance(c, ChunkHandle):
                raise CacheBlendError(f"release takes ChunkHandle or str, got {type(c).__name__}")
            removed += self.chunks.release(c)
        return removed

    # -- answering (generate and stream: :class:`Answering`) ----------------------------
    def start(
        self,
        query: str,
        chunks: Sequence[ChunkHandle | str] | ChunkHandle | str = (),
        *,
        system: str | None = None,
        preamble: str = "",
        **options: Any,
    ) -> Generation:
        """Validate a request now and return its :class:`Generation`, which runs lazily:
        iterate ``.pieces`` for text, then read ``.result`` (stats, TTFT).

        ``system``: system message (None keeps the chat template's default);
        ``preamble``: text before the chunks in the user turn; ``options``:
        :class:`RequestOptions` (``method``, ``recompute_ratio`` — a share or ``"auto"`` —,
        ``check_layers``, ``deviation``, ``gradual``, ``max_new_tokens``, ``temperature``,
        ``top_p``, ``stop``, ``seed``)."""
        t0 = time.perf_counter()
        check_request(query, system, preamble)
        if isinstance(chunks, (str, ChunkHandle)):
            chunks = [chunks]
        handles = [self.chunks.resolve(c) for c in chunks]
        prompt = self.prompts.build(query, [list(h.token_ids) for h in handles], system, preamble)
        return self._begin(prompt, handles, t0, options)

    def start_chat(
        self,
        messages: Sequence[dict[str, str]],
        documents: Sequence[str] = (),
        **options: Any,
    ) -> Generation:
        """Answer a chat whose messages may already hold the passages, formatted any way.

        Known passages (ingested, given as ``documents``, or learned before) are found in
        the message contents by their text and reused wherever they sit; with ``learn``
        (an option, default on), long paragraphs of system and user contents that are not
        known yet become chunks (cached now, reused next time), except the last paragraph
        of the last message and the system message's first (the application's instruction:
        it stays in the prefix, reused exactly).  ``documents`` not already in the messages
        go in front of the last user message.  Options: :class:`RequestOptions`."""
        t0 = time.perf_counter()
        opts = RequestOptions.parse(options)
        plan = plan_chat(self.prompts, self.passages, messages, documents, learn=opts.learn,
                         learn_min_chars=self.config.learn_min_chars, heads=self.heads)
        handles = [self.chunks.handle(ids) for ids in plan.prompt.chunks]
        # A passage found in the prompt by its text but not stored (learned now, or its cache
        # evicted) is computed in place, as full prefill would, and stored in the background
        # afterwards; ``documents`` are chunks as in :meth:`start` (precomputed if missing).
        docs = [documents] if isinstance(documents, str) else documents
        given = {tuple(ids) for d in docs for ids in (self.prompts.encode(d), self.prompts.chunk_ids(d))}
        defer = frozenset(h.key for h in handles if h.token_ids not in given)
        run = self._begin(plan.prompt, handles, t0, opts, defer)
        run.stats.chunks_learned = len(plan.learned)
        return run

    def explain(self, query: str, chunks: Sequence[ChunkHandle | str] = (), *, system: str | None = None,
                preamble: str = "", attention_layer: int | None = None, answers: bool = True,
                **options: Any) -> Explanation:
        """What CacheBlend does to this prompt (:mod:`cacheblend.explain`): per-token KV
        deviation at the check layer, the recompute set (``.recomputed(ratio)`` for any
        ratio), attention maps at ``attention_layer`` under full prefill, full reuse and
        blend (None: not computed), and, with ``answers``, full prefill's answer and the
        answer under ``options`` (:class:`RequestOptions`)."""
        from .explain import explain

        check_request(query, system, preamble)
        return explain(self, query, list(chunks), system=system, preamble=preamble,
                       attention_layer=attention_layer, answers=answers, **options)

    def check_fits(self, prompt: PromptIds) -> None:
        """Refuse a prompt the model's context cannot hold (one position is left for the answer)."""
        n = len(prompt.all_ids)
        if n >= self.context_length:
            raise CacheBlendError(
                f"prompt of {n} tokens does not fit the model's context of {self.context_length} tokens"
            )

    def _begin(self, prompt: PromptIds, handles: list[ChunkHandle], t0: float,
               options: RequestOptions | dict[str, Any], defer: frozenset[str] = frozenset()) -> Generation:
        opts = options if isinstance(options, RequestOptions) else RequestOptions.parse(options)
        self.check_fits(prompt)
        return Generation(self, Request(prompt, handles, opts, t0, defer))


def _engine_config(config: EngineConfig | None, settings: dict[str, Any]) -> EngineConfig:
    """``config`` with ``settings`` (EngineConfig field names) applied; a dtype may be a
    torch dtype (it is kept by name)."""
    if "dtype" in settings and isinstance(settings["dtype"], torch.dtype):
        settings = {**settings, "dtype": str(settings["dtype"]).removeprefix("torch.")}
    known = {f for f in EngineConfig.__dataclass_fields__}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise CacheBlendError(f"unknown engine setting(s) {unknown}; known: {', '.join(sorted(known))}")
    return replace(config or EngineConfig(), **settings)
