"""HKVD token selection: which reused tokens to recompute.

Paper §4.2: the tokens whose K/V deviate most from full prefill (high-KV-deviation,
HKVD) carry most of the cross-attention the per-chunk caches lack; they are few, and the
same tokens stay HKVD across neighbouring layers.  So at a *check layer* we compute fresh
K/V for every still-active reused token, compare with the cached K/V and keep the top
share; later layers recompute only those.  With *gradual filtering* several check
layers narrow the set step by step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

DEVIATIONS = ("v", "k", "kv")


@dataclass(frozen=True)
class BlendConfig:
    """How much of the reused KV to recompute, and how to choose it.

    ``recompute_ratio`` is the share of reused chunk tokens recomputed from the last check
    layer on (the paper's r, default 15 %).  ``check_layers`` are the layers at which
    deviation is measured (official code: layer 1).  ``deviation`` compares values
    (``"v"``, the official choice), pre-RoPE keys (``"k"``) or both.  With ``gradual``
    and several check layers, the first check keeps ``gradual_start`` × r (capped at 1)
    and the kept share shrinks linearly to r at the last check layer.
    """

    recompute_ratio: float = 0.15
    check_layers: tuple[int, ...] = (1,)
    deviation: str = "v"
    gradual: bool = False
    gradual_start: float = 2.0

    def __post_init__(self) -> None:
        r = self.recompute_ratio
        if not isinstance(r, (int, float)) or not 0.0 <= float(r) <= 1.0:
            raise ValueError(f"recompute_ratio must be within [0, 1], got {r!r}")
        if self.deviation not in DEVIATIONS:
            raise ValueError(f"deviation must be one of {DEVIATIONS}, got {self.deviation!r}")
        layers = tuple(self.check_layers)
        if not layers:
            raise ValueError("check_layers must name at least one layer")
        if any(int(x) < 0 for x in layers) or sorted(set(layers)) != list(layers):
            raise ValueError(f"check_layers must be distinct, ascending and >= 0, got {layers}")
        if self.gradual_start < 1.0:
            raise ValueError("gradual_start must be >= 1")
        object.__setattr__(self, "check_layers", layers)
        object.__setattr__(self, "recompute_ratio", float(r))

    def validate_for(self, num_layers: int) -> None:
        if self.check_layers[-1] >= num_layers:
            raise ValueError(
                f"check_layers {self.check_layers} out of range for a {num_layers}-layer model"
            )

    def keep_ratio(self, check_index: int) -> float:
        """Share of all reused tokens still recomputed after check layer ``check_index``."""
        r = self.recompute_ratio
        m = len(self.check_layers)
        if not self.gradual or m == 1:
            return r
        first = min(1.0, r * self.gradual_start)
        return first + (r - first) * check_index / (m - 1)


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
