"""A prompt as fusor segments: which runs of tokens arrive with a cache, and which cache.

The in-process engine gives a prompt as its parts (system prefix, chunks, question) and the
chunks' handles (:func:`prompt_segments`); the vLLM connector gives token ids with the
chunks' ``[start, end)`` spans (:func:`span_segments`).  Both look every cache up through
the same :class:`~.chunks.ChunkCache`, so a chunk gets the same key and cache either way.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from ..blend.layout import Segment
from ..prompt import PromptIds
from ..results import ChunkHandle
from .chunks import ChunkCache, LookupCounter

__all__ = ["prompt_segments", "span_segments"]


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
        first = next((i for i, (_, chunk) in enumerate(body) if chunk), None)
        head = prompt.prefix + (body[first][0] if first is not None else [])
        rest = [t for ids, _ in body[(first + 1 if first is not None else 0):] for t in ids]
        return [cache.prefix_segment(head, counter), Segment(rest)]
    segs = [cache.prefix_segment(prompt.prefix, counter)] if prompt.prefix else []
    chunk_handles = iter(handles)
    for ids, chunk in body:
        segs.append(_chunk_segment(cache, next(chunk_handles), counter, defer) if chunk else Segment(ids))
    if counter.deferred and not any(s.cached is not None and not s.exact for s in segs):
        return [Segment(prompt.all_ids)]  # nothing to blend: plain full prefill, the causal kernel
    return segs


def _chunk_segment(cache: ChunkCache, handle: ChunkHandle, counter: LookupCounter, defer: Collection[str]) -> Segment:
    if handle.key not in defer:
        return Segment(handle.token_ids, cache.chunk_source(handle, counter))
    source = cache.stored_source(handle, counter)
    if source is None:
        counter.deferred.append(handle)
        return Segment(handle.token_ids)
    return Segment(handle.token_ids, source)


def span_segments(cache: ChunkCache, ids: Sequence[int], spans: Sequence[tuple[int, int]], counter: LookupCounter,
                  prefix_counter: LookupCounter | None = None) -> list[Segment]:
    """Segments of a prompt given as token ids with ``[start, end)`` chunk spans (what a
    vLLM request carries): spans reuse their chunks' caches; the tokens before the first
    span (system prompt, template) are the prompt's prefix, exact K/V from the prefix
    cache as in :func:`prompt_segments` (computed at position 0 and stored on a miss), its
    lookup counted in ``prefix_counter`` when given; the rest is computed."""
    ids = list(ids)
    pos = spans[0][0] if spans else 0
    segs = []
    if pos:
        pc = prefix_counter if prefix_counter is not None else counter
        pc.bypass_store = counter.bypass_store
        segs.append(cache.prefix_segment(ids[:pos], pc))
    for a, b in spans:
        if a > pos:
            segs.append(Segment(ids[pos:a]))
        segs.append(Segment(ids[a:b], cache.chunk_source(cache.handle(ids[a:b]), counter)))
        pos = b
    segs.append(Segment(ids[pos:]))
    return segs
