"""Where each segment of a prompt sits in the fused prefill, and which tokens are reused
approximately (the recompute candidates) or always computed (the question).

The fusor and its check layer both read this map; it is built once per prefill from the
segments, before any layer runs, so a prompt that cannot be fused (empty, longer than the
cache, ending on a cached token) is refused before any work is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..store.entry import LayerSource

__all__ = ["PromptLayout", "Segment", "layout_of"]


@dataclass
class Segment:
    """A run of prompt tokens and, if reused, its position-free cache.

    ``exact`` marks a cache that equals full prefill at this offset (a prefix computed at
    position 0, a chunk right behind the sink it was precomputed behind): it is reused as
    is and never a recompute candidate.  ``stored`` says the cache was read from the store;
    one computed for this request on a miss is reused the same way but is not a cache read
    (usage's ``cached_tokens``).
    """

    token_ids: Sequence[int]
    cached: LayerSource | None = None
    exact: bool = False
    stored: bool = True

    def __post_init__(self) -> None:
        if self.cached is not None and self.cached.num_tokens != len(self.token_ids):
            raise ValueError(
                f"cache holds {self.cached.num_tokens} tokens, segment has {len(self.token_ids)}"
            )


@dataclass
class PromptLayout:
    """Where each segment sits, and which tokens are reused approximately (candidates)."""

    ids: Tensor
    reused_spans: list[tuple[int, int, Segment]]
    candidate: Tensor  # bool per position: reused, not exact: may be recomputed
    uncached: Tensor  # bool per position: always computed (the question, gaps)
    row_of: Tensor  # position -> row among the candidates (-1 elsewhere)
    n_candidates: int
    chunk_of: Tensor  # position -> index of its approximate chunk (-1 elsewhere)
    offset: Tensor  # position -> offset within its segment
    question: Tensor  # positions of the uncached tail after the last candidate (the question)


def layout_of(segments: Sequence[Segment], capacity: int, device: torch.device) -> PromptLayout:
    ids = torch.tensor([t for s in segments for t in s.token_ids], dtype=torch.long, device=device)
    n = ids.numel()
    if n == 0:
        raise ValueError("empty prompt")
    if n > capacity:
        raise ValueError(f"prompt of {n} tokens exceeds the KV cache capacity {capacity}")
    spans: list[tuple[int, int, Segment]] = []
    start = 0
    candidate = torch.zeros(n, dtype=torch.bool, device=device)
    uncached = torch.zeros(n, dtype=torch.bool, device=device)
    chunk_of = torch.full((n,), -1, dtype=torch.long, device=device)
    offset = torch.zeros(n, dtype=torch.long, device=device)
    for seg in segments:
        end = start + len(seg.token_ids)
        spans.append((start, end, seg))
        offset[start:end] = torch.arange(end - start, device=device)
        if seg.cached is None:
            uncached[start:end] = True
        elif not seg.exact:
            candidate[start:end] = True
            chunk_of[start:end] = int(chunk_of.max()) + 1
        start = end
    if not uncached[-1]:
        raise ValueError("the last prompt token must be computed (end the prompt with an uncached segment)")
    n_candidates = int(candidate.sum())
    row_of = torch.full((n,), -1, dtype=torch.long, device=device)
    row_of[candidate] = torch.arange(n_candidates, device=device)
    last = int(torch.nonzero(candidate).max()) if n_candidates else -1
    question = torch.nonzero(uncached & (torch.arange(n, device=device) > last)).squeeze(1)
    return PromptLayout(ids, [(a, b, s) for a, b, s in spans if s.cached is not None], candidate, uncached, row_of,
                   n_candidates, chunk_of, offset, question)
