"""HKVD token selection: which reused tokens to recompute.

Paper §4.2: the tokens whose K/V deviate most from full prefill (high-KV-deviation,
HKVD) carry most of the cross-attention the per-chunk caches lack; they are few, and the
same tokens stay HKVD across neighbouring layers.  So at a *check layer* we compute fresh
K/V for every still-active reused token, compare with the cached K/V and keep the top
share; later layers recompute only those.  With *gradual filtering* several check
layers narrow the set step by step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import DEVIATIONS, BlendConfig

__all__ = ["DEVIATIONS", "BlendConfig", "kv_deviation", "select_hkvd"]


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


def select_hkvd(deviation: Tensor, keep: int) -> Tensor:
    """Indices (ascending) of the ``keep`` tokens with the largest deviation."""
    keep = max(0, min(keep, deviation.numel()))
    if keep == deviation.numel():
        return torch.arange(keep, device=deviation.device)
    return torch.topk(deviation, keep, sorted=False).indices.sort().values
