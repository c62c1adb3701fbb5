"""The chunk-cache service: from chunk token ids to trusted, position-free K/V.

Ingest (chunk precompute, DESIGN "the mechanism" 1–2), lookup with verification, the
retry on entries found damaged mid-read, and release live here, behind one public API
that the in-process engine, the vLLM connector's worker and the benchmarks all use, so
that a chunk gets the same key and the same cache whoever asks for it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..blend.fusor import FusionReport, KVCache, Segment, check_deadline, fused_prefill
from ..blend.guard import guarded_prefill
from ..blend.hint import HINT_FIELD, encode_hint
from ..config import BlendConfig
from ..errors import CacheBlendError, UnknownChunkError
from ..models.decoder import Decoder
from ..prompt import PromptBuilder
from ..results import ChunkHandle
from ..store import ChunkKV, CorruptEntry, LayerSource, Tier, tier_total
from ..store.entry import PrefixView, ShapeChecked
from .background import RETRY_AFTER_S, KeyedJobs
from .hint import FILLER, HINT_LAYER, add_hint, deviation_score
from .keys import chunk_key, is_entry_key

ATTEMPTS = 3  # a damaged entry is looked up again; the last attempt bypasses the store
PREFIX_POLICY = "prefix"  # exact K/V of a prompt prefix computed at position 0
LEARNED = "learned"  # meta "origin" of a chunk found in a prompt (not ingested): evicted first


@dataclass
class LookupCounter:
    """Store traffic of one prefill: what was served, computed, rejected and how long
    precomputing missing chunks took (it is not prefill time)."""

    hits: int = 0
    misses: int = 0
    foreign: int = 0  # entries of another model or length: dropped, recomputed
    corrupt: int = 0  # entries found damaged: dropped by their tier, recomputed
    precompute_s: float = 0.0
    bypass_store: bool = False
    deferred: list[ChunkHandle] = field(default_factory=list)  # computed in place now, stored later
    unhinted: list[tuple[str, list[int]]] = field(default_factory=list)  # entries served without a hint

    @property
    def rejected(self) -> int:
        return self.foreign + self.corrupt


# lookup(counter) -> the prompt's segments with their caches, and the selection to use
Lookup = Callable[[LookupCounter], tuple[list[Segment], BlendConfig]]
Observe = Callable[[list[Segment], FusionReport], None]


class ChunkCache:
    """Keys, precompute, lookup and release of chunk caches for one model and store.

    A chunk is precomputed behind the sink ids (``sink``) at position 0, the sink's own
    K/V dropped; its key hashes the model fingerprint, the precompute ``policy`` and the
    chunk's token ids, so a cache is only ever served to the same model, tokens and policy.
    """

    def __init__(self, decoder: Decoder, store: Tier, prompts: PromptBuilder, fingerprint: str,
                 sink: Sequence[int], device: torch.device, prefetch: bool | None = True,
                 kv_dtype: torch.dtype | None = None) -> None:
        self.decoder = decoder
        self.store = store
        self.prompts = prompts
        self.fingerprint = fingerprint
        self.sink: tuple[int, ...] = tuple(sink)
        # Chunk caches are stored in ``kv_dtype`` (the model's by default); another dtype is
        # part of the precompute policy, so entries of different precision never mix.
        self.kv_dtype = kv_dtype or decoder.shape.dtype
        self.policy = "chunk:sink=" + ",".join(map(str, self.sink))
        if self.kv_dtype != decoder.shape.dtype:
            self.policy += ";kv=" + str(self.kv_dtype).removeprefix("torch.")
        # A chunk right behind its sink in a prompt is full prefill's there (segments.py),
        # unless it is stored at another precision.
        self.exact_behind_sink = self.kv_dtype == decoder.shape.dtype
        self.device = device
        self.prefetch = prefetch
        self.separator: list[int] = prompts.encode(prompts.chunk_separator)
        self.filler: list[int] = prompts.chunk_ids(FILLER)  # what the deviation hint is measured behind
        # Texts seen lately, to their handles: a RAG app passes the same passages as strings
        # request after request, and tokenizing and hashing six 600-token passages again took
        # about 5 ms of each TTFT.  256 handles of ~600 ids hold about 5 MB.
        self._text_handles = functools.lru_cache(maxsize=256)(self._handle_of_text)
        self.lock = threading.Lock()  # the store and the controller are shared; decoding is not
        background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cacheblend-learn")
        self._learning = KeyedJobs(background, "precompute")  # by handle key: chunks first seen in a prompt
        self._hinting = KeyedJobs(background, "hint backfill", RETRY_AFTER_S)  # by entry key (background.py)

    def run_background_on(self, executor: Executor) -> None:
        """Run learning and hint backfills on ``executor`` from now on: vLLM's worker gives a
        :class:`~.background.StepExecutor` that it drains between forwards."""
        self._learning.use(executor)
        self._hinting.use(executor)

    # -- identity ----------------------------------------------------------------------
    def handle(self, ids: Sequence[int]) -> ChunkHandle:
        """The handle of the chunk with these token ids (whether it is stored or not)."""
        ids = list(ids)
        return ChunkHandle(key=chunk_key(self.fingerprint, ids, self.policy), num_tokens=len(ids),
                           token_ids=tuple(ids), model_fingerprint=self.fingerprint)

    def handle_of(self, text: str) -> ChunkHandle:
        """The handle of a chunk given as text (tokenized as a chunk: text + separator)."""
        if not isinstance(text, str) or not text.strip():
            raise CacheBlendError("a chunk must be a non-empty string")
        return self._text_handles(text)

    def _handle_of_text(self, text: str) -> ChunkHandle:
        return self.handle(self.prompts.chunk_ids(text))

    def resolve(self, chunk: ChunkHandle | str) -> ChunkHandle:
        """A handle for a text, or a given handle checked to be this cache's own."""
        if isinstance(chunk, str):
            return self.handle_of(chunk)
        if not isinstance(chunk, ChunkHandle):
            raise CacheBlendError(f"chunks take ChunkHandle or str, got {type(chunk).__name__}")
        if chunk.model_fingerprint and chunk.model_fingerprint != self.fingerprint:
            raise UnknownChunkError(f"chunk {chunk.key[:12]}… was made by another model")
        if not chunk.token_ids or chunk_key(self.fingerprint, chunk.token_ids, self.policy) != chunk.key:
            raise UnknownChunkError(
                f"unknown chunk handle {chunk.key[:12]}…: not made by Engine.ingest of this engine"
            )
        return chunk

    def meta(self, ids: Sequence[int], policy: str | None = None) -> dict[str, str]:
        """Who made a cache: stored in its header and checked when it is read."""
        return {"model": self.fingerprint, "policy": self.policy if policy is None else policy,
                "tokens_sha256": chunk_key("", ids, ""), "num_tokens": str(len(ids))}

    # -- ingest ------------------------------------------------------------------------
    def precompute(self, ids: Sequence[int]) -> ChunkKV:
        """K (pre-RoPE) and V of ``ids`` run behind the sink at position 0, with the sink's
        own K/V dropped (DESIGN.md, chunk precompute)."""
        kv = self._prefill_kv(list(self.sink) + list(ids), keep_from=len(self.sink))
        return ChunkKV(kv.k.to(self.kv_dtype), kv.v.to(self.kv_dtype), self.hinted_meta(ids, kv.v[HINT_LAYER]))

    def hinted_meta(self, ids: Sequence[int], values: torch.Tensor) -> dict[str, str]:
        """:meth:`meta`, with the chunk's deviation hint (:mod:`cacheblend.cache.hint`) computed
        from ``values``, its cached values at the hint layer, where the filler fits before it."""
        meta = self.meta(ids)
        if len(self.sink) + len(self.filler) + len(ids) <= self.decoder.shape.max_positions:
            meta[HINT_FIELD] = encode_hint(deviation_score(self.decoder, self.sink, self.filler, ids, values,
                                                           self.device))
        return meta

    def precompute_prefix(self, ids: Sequence[int]) -> ChunkKV:
        """Exact K/V of a prompt prefix at position 0 (what prefix caching reuses)."""
        kv = self._prefill_kv(list(ids))
        return ChunkKV(kv.k, kv.v, self.meta(ids, PREFIX_POLICY))

    def ingest(self, handle: ChunkHandle) -> bool:
        """Precompute and store ``handle``'s chunk unless a trusted entry is stored (one stored
        without a deviation hint gets it now); returns whether it was computed now."""
        counter = LookupCounter()
        with self.lock:
            self.chunk_source(handle, counter)
        self.add_hints_later(counter)
        self._hinting.wait(self._entry(handle)[0])
        return counter.misses > 0

    def save(self, ids: Sequence[int], kv: ChunkKV) -> bool:
        """Store K/V of chunk ``ids`` made elsewhere (vLLM's own, un-rotated) under the
        chunk's key, unless an entry is there; returns whether it was stored."""
        key = self.handle(ids).key
        if self.store.open(key) is not None:
            return False
        return bool(self.store.put(key, ChunkKV(kv.k.to(self.kv_dtype), kv.v.to(self.kv_dtype),
                                                self.hinted_meta(ids, kv.v[HINT_LAYER]))))

    def release(self, handle: ChunkHandle) -> bool:
        """Delete the chunk's entry from every tier (exact key only); whether one was stored.

        A hint backfill of the entry (read, hint computed, written back) or a chunk learned
        from a prompt and stored in the background, running across the delete, used to
        write it back: released chunks came back.  Under the lock no prefill reads the
        entry, so no new backfill is queued between the wait and the delete."""
        if not is_entry_key(handle.key):
            raise CacheBlendError(f"release takes a chunk key (64 hex digits), got {handle.key!r:.80}")
        # the entry that serves a handle without the trailing separator is stored under
        # another key (:meth:`_entry`): both go
        keys = dict.fromkeys([handle.key, self._entry(handle)[0] if handle.token_ids else handle.key])
        with self.lock:
            self._learning.wait(handle.key)
            for key in keys:
                self._hinting.wait(key)  # backfills go by entry
            return any([self.store.delete(key) for key in keys])

    def _prefill_kv(self, ids: list[int], keep_from: int = 0) -> ChunkKV:
        shape = self.decoder.shape
        n = len(ids)
        if n > shape.max_positions:
            raise CacheBlendError(f"chunk of {n} tokens exceeds the model's context of {shape.max_positions}")
        out_k = torch.empty((shape.num_layers, shape.num_kv_heads, n - keep_from, shape.head_dim), dtype=shape.dtype)
        out_v = torch.empty_like(out_k)

        def capture(layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
            out_k[layer] = k[:, keep_from:]
            out_v[layer] = v[:, keep_from:]

        kv = KVCache(shape, n, self.device)
        with torch.inference_mode():
            fused_prefill(self.decoder, [Segment(ids)], kv, BlendConfig(), capture=capture)
        return ChunkKV(out_k, out_v)

    # -- lookup ------------------------------------------------------------------------
    def chunk_source(self, handle: ChunkHandle, counter: LookupCounter) -> LayerSource:
        """The chunk's cache, read lazily layer by layer (computed and stored on a miss).

        A chunk is stored followed by the chunk separator; one that a template puts
        elsewhere (not followed by a blank line) is served from that same entry's first
        tokens (:class:`PrefixView`), so each passage is computed and stored once."""
        self.wait_learning(handle)
        return self._chunk_source(handle, counter)

    def _chunk_source(self, handle: ChunkHandle, counter: LookupCounter, learned: bool = False) -> LayerSource:
        key, ids = self._entry(handle)
        compute = self.precompute
        if learned:  # marked, so that a store evicts learned chunks before ingested ones
            def compute(ids: Sequence[int]) -> ChunkKV:
                kv = self.precompute(ids)
                return ChunkKV(kv.k, kv.v, kv.meta | {"origin": LEARNED})
        source = self._hint_missing(key, ids, self._lookup(key, ids, compute, counter), counter)
        return source if len(ids) == handle.num_tokens else PrefixView(source, handle.num_tokens)

    def _hint_missing(self, key: str, ids: list[int], source: LayerSource, counter: LookupCounter) -> LayerSource:
        """``source``, served as it is (the prompt runs the full check), noted in ``counter``
        if it was stored without a deviation hint (by a version before hints)."""
        if HINT_FIELD not in source.meta:
            counter.unhinted.append((key, ids))
        return source

    def add_hints_later(self, counter: LookupCounter) -> None:
        """Add their hint to the entries ``counter`` served without one (:func:`add_hint`), on
        the background thread: called once the prefill that read them is done, so the work
        neither delays it nor races a tier's promotion of the entry it read."""
        for key, ids in counter.unhinted:
            self._hinting.submit(key, functools.partial(add_hint, self.store, key, ids, self.hinted_meta))
        counter.unhinted = []

    def _entry(self, handle: ChunkHandle) -> tuple[str, list[int]]:
        """The key and token ids of the entry that serves ``handle`` (itself, or itself
        followed by the chunk separator)."""
        ids = list(handle.token_ids)
        sep = self.separator
        if not sep or ids[-len(sep):] == sep:
            return handle.key, ids
        return chunk_key(self.fingerprint, ids + sep, self.policy), ids + sep

    def stored_source(self, handle: ChunkHandle, counter: LookupCounter) -> LayerSource | None:
        """The chunk's trusted stored cache, or None (nothing is computed)."""
        self.wait_learning(handle)
        key, ids = self._entry(handle)
        source = self._stored(key, len(ids), counter)
        if source is None:
            return None
        source = self._hint_missing(key, ids, source, counter)
        return source if len(ids) == handle.num_tokens else PrefixView(source, handle.num_tokens)

    # -- learning off the critical path ---------------------------------------------------
    def learn_later(self, handles: Sequence[ChunkHandle]) -> None:
        """Precompute and store chunks on a background thread: a passage first seen inside
        a prompt is computed in place by that prompt's prefill, and cached for the next."""
        for handle in handles:
            self._learning.submit(handle.key, functools.partial(self._chunk_source, handle, LookupCounter(), True))

    def wait_learning(self, handle: ChunkHandle | None = None) -> None:
        """Wait until ``handle``'s background precompute (or all background work, hints
        included) has finished; a precompute that failed was logged, and is redone on use."""
        self._learning.wait(None if handle is None else handle.key)
        if handle is None:
            self._hinting.wait()

    def prefix_source(self, ids: Sequence[int], counter: LookupCounter) -> LayerSource:
        """Exact K/V of a prompt prefix computed at position 0 (prefix caching)."""
        return self._lookup(chunk_key(self.fingerprint, ids, PREFIX_POLICY), ids, self.precompute_prefix, counter)

    def prefix_segment(self, ids: Sequence[int], counter: LookupCounter) -> Segment:
        """The prompt's prefix as a fusor segment: exact K/V from the prefix cache."""
        hits = counter.hits
        source = self.prefix_source(ids, counter)
        return Segment(ids, source, exact=True, stored=counter.hits > hits)

    def chunk_segment(self, handle: ChunkHandle, counter: LookupCounter) -> Segment:
        """A chunk as a fusor segment: its cache, stored or computed now (:meth:`chunk_source`)."""
        hits = counter.hits
        source = self.chunk_source(handle, counter)
        return Segment(handle.token_ids, source, stored=counter.hits > hits)

    def _lookup(self, key: str, ids: Sequence[int], compute: Callable[[Sequence[int]], ChunkKV],
                counter: LookupCounter) -> LayerSource:
        """The stored cache for ``key``, else ``compute(ids)`` stored under it."""
        source = self._stored(key, len(ids), counter)
        if source is not None:
            return source
        t = time.perf_counter()
        kv = compute(list(ids))
        self.store.put(key, kv)
        counter.precompute_s += time.perf_counter() - t
        return kv

    def _stored(self, key: str, num_tokens: int, counter: LookupCounter) -> LayerSource | None:
        """The stored entry for ``key`` if it can be trusted (counted as a hit), else None
        (a miss).  An entry made by another model, or of another length or depth, is
        dropped; one whose layers turn out to have another shape is dropped when read."""
        source = None if counter.bypass_store else self.store.open(key)
        if source is not None:
            shape = self.decoder.shape
            model = source.meta.get("model")
            fits = source.num_layers == shape.num_layers and model in (None, self.fingerprint)
            # the key's policy names the stored dtype (prefixes: the model's): another is not this entry's
            dtype = shape.dtype if source.meta.get("policy") == PREFIX_POLICY else self.kv_dtype
            fits = fits and source.meta.get("dtype", str(dtype)) == str(dtype)
            if isinstance(source, ChunkKV):  # in memory: check the shape now, read nothing
                fits = fits and source.k.shape[1::2] == (shape.num_kv_heads, shape.head_dim) and source.k.dtype == dtype
            if source.num_tokens == num_tokens and fits:
                counter.hits += 1
                if isinstance(source, ChunkKV):
                    return source
                return ShapeChecked(source, shape.num_kv_heads, shape.head_dim, lambda: self.store.delete(key))
            counter.foreign += 1
            self.store.delete(key)
        counter.misses += 1
        return None

    # -- fuse with verification --------------------------------------------------------
    @contextlib.contextmanager
    def _turn(self, deadline: float | None) -> Iterator[None]:
        """The lock, waited for in short slices: a request queued behind others' prefills
        stops waiting once its deadline passes (``TimeoutError``) or its async call is
        cancelled, instead of waiting out every prefill before its own."""
        while not self.lock.acquire(timeout=0.1):
            check_deadline(deadline, "the wait for other requests' prefills")
        try:
            yield
        finally:
            self.lock.release()

    def fuse(self, lookup: Lookup, kv: KVCache, counter: LookupCounter,
             observe: Observe | None = None, deadline: float | None = None) -> FusionReport:
        """Run ``lookup`` and the fused prefill into ``kv``, one request at a time.

        A cache that fails verification mid-read was dropped by its tier, so look up again
        (it is recomputed and replaced), bypassing the store on the last attempt.  The
        in-process engine and the vLLM connector's worker both prefill through here.  Past
        ``deadline`` the prefill stops between layers with ``TimeoutError``: the request's own
        KV cache is dropped, and every store entry was written whole before it began."""
        with self._turn(deadline):
            dropped = tier_total(self.store, "corrupt")
            for attempt in range(ATTEMPTS):
                counter.bypass_store = attempt == ATTEMPTS - 1
                segments, blend = lookup(counter)
                try:
                    report = guarded_prefill(self.decoder, segments, kv, blend, prefetch=self.prefetch,
                                             deadline=deadline)
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
        self.add_hints_later(counter)
        return report
