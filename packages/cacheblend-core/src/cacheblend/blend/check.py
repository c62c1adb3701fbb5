"""The check layer (paper §4.2): which reused tokens go on being recomputed past it.

At a check layer every candidate still active has fresh K/V next to its cached ones; HKVD
keeps the budget's share with the highest deviation (or another ranking the config
names), plus the chunk-shift sample (:mod:`.shift`) out of the budget.  Before the check,
:func:`pool_for_check` narrows the candidates computed up to it to those the stored
deviation hints mark (:mod:`.hint`), and :func:`shift_sample` picks the evenly spaced
tokens that estimate each chunk's shift.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..models.decoder import Decoder
from .hint import check_pool
from .layout import PromptLayout, Segment
from .selection import BlendConfig, Candidates, choose, kv_deviation, query_attention
from .shift import ChunkShift, evenly_spaced

__all__ = ["keep_at_check", "pool_for_check", "question_attention", "shift_sample"]


def shift_sample(config: BlendConfig, ratio: float, direct: bool, lay: PromptLayout,
                  spans: list[tuple[int, int, Segment]], num_layers: int) -> tuple[Tensor | None, ChunkShift | None]:
    """The evenly spaced tokens recomputed to estimate each chunk's shift
    (:mod:`cacheblend.blend.shift`), or (None, None) without a check layer to keep them at."""
    if config.shift_share <= 0.0 or not 0.0 < ratio < 1.0 or direct:
        return None, None
    approx = [None if s.exact else (a, b) for a, b, s in spans]
    sample = evenly_spaced([x for x in approx if x is not None], min(config.shift_share, ratio),
                           lay.ids.numel(), lay.ids.device)
    return sample, ChunkShift(approx, sample, config.shift_parts, round(config.shift_values_from * num_layers),
                              [s.cached for _, _, s in spans])


def pool_for_check(config: BlendConfig, ratio: float, lay: PromptLayout, spans: list[tuple[int, int, Segment]],
                sample: Tensor | None) -> Tensor | None:
    """The candidates computed up to the check layer when ``check_pool`` < 1: the top share of
    all chunk tokens by their stored deviation hints, and the shift sample (:mod:`cacheblend.blend.hint`).
    None: every candidate (a pool no larger than the budget, a probe, or a chunk without a hint)."""
    if not ratio < config.check_pool < 1.0 or config.selection != "deviation":
        return None
    approx = [(a, b, s.cached.meta) for a, b, s in spans if not s.exact]  # type: ignore[union-attr]
    pool = check_pool(approx, config.check_pool, lay.ids.numel(), lay.ids.device)
    return pool if pool is None or sample is None else pool | sample


def question_attention(dec: Decoder, layer: int, x: Tensor, active: Tensor, lay: PromptLayout, keys: Tensor,
                        cos: Tensor, sin: Tensor) -> Tensor:
    """The question's attention [n] over every position at this layer (keys of all positions
    are fresh here: every token was computed up to the check layer)."""
    rows = torch.searchsorted(active, lay.question)
    if rows.numel() == 0:
        return torch.zeros(keys.shape[1], device=keys.device)
    q = dec.rope(dec.queries(layer, x[rows]), cos[lay.question], sin[lay.question])
    return query_attention(q, lay.question, keys, dec.scaling)


def keep_at_check(
    config: BlendConfig,
    check_index: int,
    active: Tensor,
    lay: PromptLayout,
    approx_kv: list[tuple[Tensor, Tensor]],
    k: Tensor,
    v: Tensor,
    attention: Tensor | None,
    sample: Tensor | None = None,
) -> Tensor | None:
    """At a check layer, keep the chosen candidates; return indices into ``active`` to keep
    (None: keep all).  The shift ``sample`` is always kept, out of the budget."""
    is_cand = lay.candidate[active]
    keep_n = round(config.keep_ratio(check_index) * lay.n_candidates)
    if sample is not None:
        in_sample = sample[active]
        keep_n -= int(in_sample.sum())
        is_cand = is_cand & ~in_sample
    cand_idx = torch.nonzero(is_cand).squeeze(1)
    if cand_idx.numel() == 0 or keep_n >= cand_idx.numel():  # none left to choose from: the sample took them
        return None
    pos = active[cand_idx]
    rows = lay.row_of[pos]
    cached_k = torch.cat([ck for ck, _ in approx_kv], dim=1)[:, rows]
    cached_v = torch.cat([cv for _, cv in approx_kv], dim=1)[:, rows]
    dev = kv_deviation(k[:, cand_idx], v[:, cand_idx], cached_k, cached_v, config.deviation)
    att = None if attention is None else attention[pos]
    chosen = cand_idx[choose(config, Candidates(dev, att, lay.chunk_of[pos], lay.offset[pos]), keep_n)]
    return torch.cat([torch.nonzero(~is_cand).squeeze(1), chosen]).sort().values
