"""Chunk shift correction: the part of a stale chunk's K/V error that every token shares.

A chunk's cache was computed without the chunks before it.  Measured against full prefill
on dev prompts, a large part of the missing context is common to the whole chunk: per
layer and KV head, the mean of (full prefill's K/V − the cached K/V) over the chunk's
tokens holds about 40 % of the key error and 15 % of the value error of the tokens a 15 %
blend leaves stale.  A shift shared by all of a chunk's keys moves the question's
attention to that chunk as a whole, which no choice of a few tokens repairs.

The HKVD tokens are a biased sample of that mean (the most deviant ones, the chunk's first
tokens among them), so the shift is estimated from a small sample spread evenly over each
chunk: those tokens are recomputed at every layer like HKVD tokens (they take part of the
budget), and at each layer after the check layer the mean of their fresh-minus-cached K/V
is added to the cached K/V of the chunk before it is placed in the fused cache (keys
before RoPE, so the shift is position-free).  The sampled and HKVD tokens then overwrite
their own rows with fresh K/V, as before; only the stale rows keep the shifted cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..store.entry import ChunkKV

__all__ = ["ChunkShift", "evenly_spaced", "segment_shrunk_means"]


def evenly_spaced(spans: Sequence[tuple[int, int]], share: float, length: int, device: torch.device) -> Tensor:
    """A bool mask over ``length`` positions: ``share`` of each span ``[a, b)`` (at least one
    token), at the centres of equal parts of the span."""
    mask = torch.zeros(length, dtype=torch.bool, device=device)
    for a, b in spans:
        size = b - a
        count = min(size, max(1, round(share * size)))
        mask[a + ((torch.arange(count, device=device) * 2 + 1) * size) // (2 * count)] = True
    return mask


class ChunkShift:
    """Per approximately reused span: the sampled positions, and each layer's shift.

    The shifts of all spans come from one batched pass per layer (gather, segment sums):
    a loop over spans cost about 3 % of a 6-chunk blend's TTFT in small ops."""

    def __init__(self, spans: Sequence[tuple[int, int] | None], sample: Tensor, parts: str = "kv",
                 values_from: int = 0, sources: Sequence[object] | None = None) -> None:
        """``spans``: one entry per reused segment, None for an exact one (never shifted);
        ``sample``: the bool mask of :func:`evenly_spaced`; ``parts``: shift the keys
        (``"k"``), the values (``"v"``) or both (``"kv"``); values only at layers from
        ``values_from`` on; ``sources``: the segments' caches, one per span: where every
        shifted one is in memory (a :class:`ChunkKV`), its sampled rows of every layer are
        gathered here once, instead of a dozen small gathers per layer (about 0.3 ms a layer)."""
        self.spans, self.parts, self.values_from = list(spans), parts, values_from
        self._shifted: list[int] = []  # the spans with a sample, in order
        self._offsets: list[Tensor] = []  # their sampled offsets within the span
        positions, segment = [], []
        for i, span in enumerate(self.spans):
            if span is None:
                continue
            offs = torch.nonzero(sample[span[0]:span[1]]).squeeze(1)
            if offs.numel() == 0:
                continue
            positions.append(offs + span[0])
            segment.append(torch.full_like(offs, len(self._shifted)))
            self._shifted.append(i)
            self._offsets.append(offs)
        if self._shifted:
            self._positions, self._segment = torch.cat(positions), torch.cat(segment)
            self._counts = torch.tensor([o.numel() for o in self._offsets], device=sample.device)
        self._rows: tuple[Tensor, Tensor] | None = None  # (active, rows of the sample in it)
        self._stale: Tensor | None = None  # [layers, 2 * KVH, sampled rows, hd]: K heads, then V heads
        held = [src for src in (sources[i] for i in self._shifted) if isinstance(src, ChunkKV)] \
            if sources is not None else []
        if held and len(held) == len(self._shifted):
            self._stale = torch.cat([torch.cat([src.k.index_select(2, offs), src.v.index_select(2, offs)], 1)
                                     for src, offs in zip(held, self._offsets, strict=True)], 2)

    def deltas(self, active: Tensor, k: Tensor, v: Tensor, cached: Sequence[tuple[Tensor, Tensor]],
               layer: int) -> list[tuple[Tensor | None, Tensor | None] | None]:
        """The shift [KVH, 1, hd] of K (pre-RoPE) and V per span at ``layer``, from the
        sampled rows' fresh ``k``/``v`` ([KVH, len(active), hd], rows in ``active`` order)
        against ``cached`` (one (K, V) per span, [KVH, span tokens, hd]); None for a half
        this layer does not move."""
        out: list[tuple[Tensor | None, Tensor | None] | None] = [None] * len(self.spans)
        move_k, move_v = "k" in self.parts, "v" in self.parts and layer >= self.values_from
        if not self._shifted or not (move_k or move_v):
            return out
        if self._rows is None or self._rows[0] is not active:  # active changes only at check layers
            self._rows = (active, torch.searchsorted(active, self._positions))
        rows = self._rows[1]
        heads = k.shape[0]
        # K and V heads stacked, so one pass estimates both
        fresh = torch.cat([k.index_select(1, rows), v.index_select(1, rows)])
        stale = self._stale[layer] if self._stale is not None else \
            torch.cat([self._sampled(cached, 0), self._sampled(cached, 1)])
        shift = segment_shrunk_means(fresh.float() - stale.float(), self._segment, self._counts)
        dk, dv = shift[:heads].to(stale.dtype), shift[heads:].to(stale.dtype)
        for j, i in enumerate(self._shifted):
            out[i] = (dk[:, j : j + 1] if move_k else None, dv[:, j : j + 1] if move_v else None)
        return out

    def _sampled(self, cached: Sequence[tuple[Tensor, Tensor]], which: int) -> Tensor:
        """The sampled rows of the cached K (``which`` 0) or V (1), spans concatenated."""
        return torch.cat([cached[i][which].index_select(1, offs)
                          for i, offs in zip(self._shifted, self._offsets, strict=True)], 1)


def segment_shrunk_means(diff: Tensor, segment: Tensor, counts: Tensor) -> Tensor:
    """The sample mean of each segment of ``diff`` [H, M, hd], shrunk towards zero per head
    by the positive-part James–Stein factor ``1 − σ²/(m·‖mean‖²)``; all segments at once.
    ``segment`` [M] names each row's segment (0 … S − 1), ``counts`` [S] its number of rows
    m; returns [H, S, hd].

    Adding c·mean to a stale row whose error is shift + residual leaves an expected error of
    (1 − c)²‖shift‖² + c²σ²/m (σ²: the residual's variance, summed over dims), least at
    c = ‖shift‖² / (‖shift‖² + σ²/m); ‖mean‖² − σ²/m estimates ‖shift‖².  A few samples of a
    short chunk, or a shift small against the spread, get little or no correction: one
    sample, none.  Unshrunk, a 3 % sample of a 50-token chunk made keys worse than no shift.
    """
    heads, _, dims = diff.shape
    m = counts.to(diff.dtype)
    sums = diff.new_zeros(heads, m.numel(), dims).index_add_(1, segment, diff)
    mean = sums / m.clamp_min(1.0)[None, :, None]
    centred = (diff - mean.index_select(1, segment)).pow(2).sum(-1)  # [H, M]
    spread = centred.new_zeros(heads, m.numel()).index_add_(1, segment, centred) / (m - 1).clamp_min(1.0)
    power = mean.pow(2).sum(-1).clamp_min(1e-30)
    factor = (1.0 - spread / (m * power)).clamp(0.0, 1.0) * (m >= 2).to(diff.dtype)
    return mean * factor[..., None]

