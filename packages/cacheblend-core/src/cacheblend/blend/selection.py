"""Token selection: which reused tokens to recompute, and how risky the rest is.

Paper §4.2: the tokens whose K/V deviate most from full prefill (high-KV-deviation,
HKVD) carry most of the cross-attention the per-chunk caches lack; they are few, and the
same tokens stay HKVD across neighbouring layers.  So at a *check layer* we compute fresh
K/V for every still-active reused token, compare with the cached K/V and keep the top
share; later layers recompute only those.  With *gradual filtering* several check
layers narrow the set step by step.

Deviation alone ignores whether the question will ever look at a token.  Up to the check
layer every token is computed, so the question's attention there is full prefill's own;
it tells which reused tokens the answer reads (query-aware selection, as ProphetKV and
A³ argue).  The *impact* of leaving token i stale is then its attention times its value
error, ``a_i · ‖Δv_i‖``: the first-order error it puts into the question's attention
output.  (Measured on dev, neither beats deviation alone at equal budget on the default
model; see docs/fidelity.md.)

A selection is a priority order over the candidates: the first ``n`` are recomputed.
Chunk heads (EPIC: chunk-initial tokens act as attention sinks) come first; with
per-chunk budgets the order interleaves chunks in proportion to the question's
attention mass on each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import DEVIATIONS, BlendConfig

__all__ = ["DEVIATIONS", "BlendConfig", "Candidates", "choose", "impact", "kv_deviation", "priority",
           "query_attention"]


def kv_deviation(
    fresh_k: Tensor, fresh_v: Tensor, cached_k: Tensor, cached_v: Tensor, kind: str
) -> Tensor:
    """Squared L2 deviation per token of fresh vs. cached K/V, all [KVH, n, hd] (keys
    pre-RoPE: a rotation preserves distances, so position-free keys compare directly)."""
    d = torch.zeros(fresh_v.shape[1], device=fresh_v.device)
    if kind in ("v", "kv"):
        d += (fresh_v.float() - cached_v.float()).pow(2).sum(dim=(0, 2))
    if kind in ("k", "kv"):
        d += (fresh_k.float() - cached_k.float()).pow(2).sum(dim=(0, 2))
    return d


def query_attention(q: Tensor, q_pos: Tensor, k: Tensor, scale: float) -> Tensor:
    """Mean attention probability [n] that the query rows ``q`` [H, m, hd] (RoPE applied, at
    positions ``q_pos``) give each key of ``k`` [KVH, n, hd] (RoPE applied, positions 0..n-1),
    averaged over heads and query rows, causal by position."""
    kvh, n = k.shape[0], k.shape[1]
    h, m, hd = q.shape
    grouped = q.float().reshape(kvh, (h // kvh) * m, hd)
    logits = grouped @ k.float().transpose(1, 2) * scale  # [KVH, g*m, n]
    hidden = torch.arange(n, device=k.device)[None, :] > q_pos[:, None]  # [m, n]
    logits = logits.masked_fill(hidden.repeat(h // kvh, 1)[None], float("-inf"))
    return torch.softmax(logits, dim=-1).mean(dim=(0, 1))


@dataclass
class Candidates:
    """What the check layer knows of the reused tokens still active (one row each)."""

    deviation: Tensor  # squared K/V deviation (kv_deviation)
    attention: Tensor | None  # the question's attention (query_attention), same rows; None if unused
    chunk: Tensor  # index of the chunk each row belongs to
    offset: Tensor  # position of each row within its chunk


def impact(c: Candidates) -> Tensor:
    """First-order error each stale row puts into the question's attention output."""
    return _attention(c) * c.deviation.sqrt()


def _attention(c: Candidates) -> Tensor:
    if c.attention is None:
        raise ValueError("this selection needs the question's attention (BlendConfig.uses_attention)")
    return c.attention


def _score(config: BlendConfig, c: Candidates) -> Tensor:
    if config.selection in ("attention", "probe"):
        return _attention(c)
    if config.selection == "impact":
        return impact(c)
    return c.deviation


def priority(config: BlendConfig, c: Candidates) -> Tensor:
    """All rows, most important first."""
    score = _score(config, c)
    if config.chunk_budget == "attention":
        order = torch.argsort(score, descending=True)
        rank = torch.empty_like(order)
        # rank within the row's own chunk, in score order
        for chunk in torch.unique(c.chunk):
            mine = order[c.chunk[order] == chunk]
            rank[mine] = torch.arange(mine.numel(), device=rank.device)
        mass = torch.zeros(int(c.chunk.max()) + 1, device=score.device).index_add_(0, c.chunk, _attention(c))
        share = (mass / mass.sum().clamp_min(1e-12)).clamp_min(1e-6)
        key = (rank.float() + 1.0) / share[c.chunk]  # chunk c gets about n · share_c of the first n
    else:
        key = -score
    if config.chunk_heads:
        key = torch.where(c.offset < config.chunk_heads, key.min() - 1.0 - (config.chunk_heads - c.offset), key)
    return torch.argsort(key, stable=True)


def choose(config: BlendConfig, c: Candidates, keep: int) -> Tensor:
    """The rows to recompute (ascending): the first ``keep`` by priority; a probe sharing
    its budget takes its ``probe_share`` by attention and fills the rest by deviation."""
    keep = max(0, min(keep, c.deviation.numel()))
    if config.selection == "probe" and config.probe_share < 1.0:
        first = torch.argsort(_attention(c), descending=True)[: round(config.probe_share * keep)]
        rest = c.deviation.clone()
        rest[first] = -1.0
        return torch.cat([first, torch.argsort(rest, descending=True)[: keep - first.numel()]]).sort().values
    return priority(config, c)[:keep].sort().values
