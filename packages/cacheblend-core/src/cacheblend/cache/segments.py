"""A prompt as fusor segments: which runs of tokens arrive with a cache, and which cache.

The in-process engine gives a prompt as its parts (system prefix, chunks, question) and the
chunks' handles (:func:`prompt_segments`); the vLLM connector gives token ids with the
chunks' ``[start, end)`` spans (:func:`span_segments`).  Both look every cache up through
the same :class:`~.chunks.ChunkCache`, so a chunk gets the same key and cache either way.

A chunk whose prompt tokens before it are exactly its sink sits where it was precomputed
(:func:`mark_exact_behind_sink`): its cache is full prefill's, reused as exact like the
prompt's prefix, not a recompute candidate.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from ..blend.layout import Segment
from ..prompt import PromptIds
from ..results import ChunkHandle
from .chunks import ChunkCache, LookupCounter

__all__ = ["behind_sink", "mark_exact_behind_sink", "prompt_segments", "span_segments"]


def prompt_segments(cache: ChunkCache, prompt: PromptIds, handles: Sequence[ChunkHandle], method: str,
                    counter: LookupCounter, defer: Collection[str] = ()) -> list[Segment]:
    """The prompt as fusor segments with the caches ``method`` may use.  A chunk whose
    key is in ``defer`` and that is not stored yet is computed in place (as full prefill
    would) and listed in ``counter.deferred``, to be stored later (:meth:`ChunkCache.learn_later`)."""
    counter.deferred = []
    if method == "full":
        return [Segment(prompt.all_ids)]
    body = prompt.body()
    if method == "prefix":
        first = next((i for i, (_, chunk) in enumerate(body) if chunk), -1)  # through it: the prefix cache's
        head = prompt.prefix + [t for ids, _ in body[:first + 1] for t in ids]
        if not head:  # no prefix and no chunk (a short chat): nothing the prefix cache could hold
            return [Segment(prompt.all_ids)]
        rest = [t for ids, _ in body[first + 1:] for t in ids]
        return [cache.prefix_segment(head, counter), Segment(rest)]
    segs = [cache.prefix_segment(prompt.prefix, counter)] if prompt.prefix else []
    chunk_handles = iter(handles)
    for ids, chunk in body:
        segs.append(_chunk_segment(cache, next(chunk_handles), counter, defer) if chunk else Segment(ids))
    mark_exact_behind_sink(cache, segs)
    if counter.deferred and not any(s.cached is not None and not s.exact for s in segs):
        return [Segment(prompt.all_ids)]  # nothing to blend: plain full prefill, the causal kernel
    return segs


def mark_exact_behind_sink(cache: ChunkCache, segs: Sequence[Segment]) -> None:
    """Mark exact the chunk whose prompt tokens before it are exactly the cache's sink.

    A chunk is precomputed behind the sink at position 0 (:meth:`ChunkCache.precompute`);
    in a prompt that opens with the sink and then the chunk (the engine's prompt without a
    system message or preamble: the chat frame is the frame sink) the chunk's K/V are what
    full prefill computes there, up to rounding, as the prefix cache's are.  Left approximate,
    such a chunk was checked, shifted and counted in the budget for nothing, and a prompt of
    one such chunk got an approximate receipt and could be escalated by the guard.  Chunks
    stored in another dtype than the model's are never exact."""
    before: list[int] = []
    for seg in segs:
        if len(before) > len(cache.sink):
            return
        if seg.cached is not None and not seg.exact and behind_sink(cache, before):
            seg.exact = True
        before.extend(seg.token_ids)


def behind_sink(cache: ChunkCache, before: Sequence[int]) -> bool:
    """Whether a chunk after the prompt tokens ``before`` is exact (:func:`mark_exact_behind_sink`)."""
    return cache.exact_behind_sink and tuple(before) == cache.sink


def _chunk_segment(cache: ChunkCache, handle: ChunkHandle, counter: LookupCounter, defer: Collection[str]) -> Segment:
    if handle.key not in defer:
        return cache.chunk_segment(handle, counter)
    source = cache.stored_source(handle, counter)
    if source is None:
        counter.deferred.append(handle)
        return Segment(handle.token_ids)
    return Segment(handle.token_ids, source)


def span_segments(cache: ChunkCache, ids: Sequence[int], spans: Sequence[tuple[int, int]], counter: LookupCounter,
                  prefix_counter: LookupCounter | None = None, prefix: int = 0) -> list[Segment]:
    """Segments of a prompt given as token ids with ``[start, end)`` chunk spans (what a
    vLLM request carries): spans reuse their chunks' caches; the tokens before the first
    span (system prompt, template), or its first ``prefix`` when given (a chat's system
    turn, :func:`~cacheblend.chat.layout`), are the prompt's prefix, exact K/V from the prefix
    cache as in :func:`prompt_segments` (computed at position 0 and stored on a miss), its
    lookup counted in ``prefix_counter`` when given; the rest is computed.  A prompt without
    spans may still name its ``prefix`` (a long system instruction) to read it exactly."""
    ids = list(ids)
    pos = prefix if prefix or not spans else spans[0][0]
    segs = []
    if pos:
        pc = prefix_counter if prefix_counter is not None else counter
        pc.bypass_store = counter.bypass_store
        segs.append(cache.prefix_segment(ids[:pos], pc))
    for a, b in spans:
        if a > pos:
            segs.append(Segment(ids[pos:a]))
        segs.append(cache.chunk_segment(cache.handle(ids[a:b]), counter))
        pos = b
    segs.append(Segment(ids[pos:]))
    mark_exact_behind_sink(cache, segs)
    return segs
