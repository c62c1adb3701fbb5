"""Attention of a subset of query positions against the fused KV cache.

The recomputed (HKVD) tokens are scattered through the prompt, so their attention must
be causal by *absolute* position: a token at position p sees keys 0..p and nothing
later.  A dense [m, N] mask is exact but costs about twice a causal kernel, because
every query scores every key.  We split the sorted queries into a few buckets and give
each bucket only the key prefix it can see (up to its last position); the mask then
only trims the bucket's own tail.  Cost approaches the causal kernel's while staying
exact — unlike a bottom-right-aligned causal mask, which lets an early recomputed token
see later ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_BUCKETS = 4
_MIN_BUCKET = 64


def _sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, **kw) -> Tensor:
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], scale=scale, enable_gqa=q.shape[0] != k.shape[0], **kw
    )[0]


def _visible(q_pos: Tensor, kv_len: int, window: int | None) -> Tensor:
    j = torch.arange(kv_len, device=q_pos.device)[None, :]
    ok = j <= q_pos[:, None]
    if window is not None:
        ok &= j > q_pos[:, None] - window
    return ok


def positional_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    scale: float,
    window: int | None = None,
) -> Tensor:
    """Attention of queries ``q`` [H, m, hd] at sorted absolute positions ``q_pos`` [m]
    against keys/values ``k``, ``v`` [KVH, n, hd] at positions 0..n-1.

    Exactly causal by absolute position (and sliding-window aware). Returns [H, m, hd].
    """
    m, n = q.shape[1], k.shape[1]
    if window is not None and window >= n:
        window = None
    if m == n and window is None:
        # Every position is a query: the plain causal kernel is exact and fastest.
        return _sdpa(q, k, v, scale, is_causal=True)
    if m == 1:
        start = 0 if window is None else max(0, int(q_pos[0]) - window + 1)
        end = int(q_pos[0]) + 1
        return _sdpa(q, k[:, start:end], v[:, start:end], scale)
    buckets = max(1, min(_BUCKETS, m // _MIN_BUCKET))
    outs = []
    for idx in torch.tensor_split(torch.arange(m, device=q.device), buckets):
        pos = q_pos[idx]
        end = int(pos[-1]) + 1
        mask = _visible(pos, end, window)
        outs.append(_sdpa(q[:, idx], k[:, :end], v[:, :end], scale, attn_mask=mask))
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
