"""How sparse the KV deviation is, layer by layer (paper §4.3, Figs. 6 and 8).

For each chunk token, the deviation at layer l is the squared distance between the K/V
that full prefill computes there and the chunk's precomputed K/V (both before RoPE, so
position plays no part).  Two properties make selective recompute work: a small share of
tokens holds most of the deviation (sparsity), and the tokens that deviate most at one
layer also do at the next (rank correlation), so a choice made at an early layer holds.
"""

from __future__ import annotations

import torch

from ..blend.fusor import KVCache, Segment, fused_prefill
from ..blend.selection import BlendConfig
from ..engine import Engine
from .stats import spearman
from .tasks import Example, Task

TOP_SHARES = (0.01, 0.05, 0.10, 0.15, 0.20, 0.30, 0.50)


def token_deviation(engine: Engine, task: Task, ex: Example) -> torch.Tensor:
    """``[layers, chunk tokens]`` squared K+V deviation of reused chunks from full prefill."""
    handles = engine.ingest(ex.passages)
    prompt = engine.prompts.build(ex.query, [list(h.token_ids) for h in handles], None, task.preamble)
    ids = prompt.all_ids
    shape = engine.decoder.shape
    full_k = torch.empty((shape.num_layers, shape.num_kv_heads, len(ids), shape.head_dim), dtype=torch.float32)
    full_v = torch.empty_like(full_k)

    def capture(layer, positions, k, v):
        full_k[layer][:, positions] = k.float()
        full_v[layer][:, positions] = v.float()

    with torch.inference_mode():
        fused_prefill(engine.decoder, [Segment(ids)], KVCache(shape, len(ids), "cpu"), BlendConfig(), capture=capture)
    rows, start = [], len(prompt.prefix)
    for h in handles:
        cached = engine.store.get(h.key) or engine.chunks.precompute(list(h.token_ids))
        span = slice(start, start + h.num_tokens)
        dk = (full_k[:, :, span] - cached.k.float()).pow(2).sum(dim=(1, 3))
        dv = (full_v[:, :, span] - cached.v.float()).pow(2).sum(dim=(1, 3))
        rows.append(dk + dv)
        start += h.num_tokens
    return torch.cat(rows, dim=1)


def sparsity_profile(deviations: list[torch.Tensor]) -> dict:
    """Per layer (from 1; layer 0 K/V depend on the token alone, so it never deviates):
    the share of squared deviation held by the top k % of tokens, averaged over prompts,
    and the rank correlation of deviation between consecutive layers."""
    layers = deviations[0].shape[0]
    share: dict[str, list[float]] = {f"{s:g}": [] for s in TOP_SHARES}
    corr = []
    for layer in range(1, layers):
        for s in TOP_SHARES:
            vals = []
            for d in deviations:
                row = d[layer].sort(descending=True).values
                k = max(1, round(s * row.numel()))
                vals.append(float(row[:k].sum() / row.sum().clamp_min(1e-12)))
            share[f"{s:g}"].append(sum(vals) / len(vals))
        if layer + 1 < layers:
            corr.append(sum(spearman(d[layer].tolist(), d[layer + 1].tolist()) for d in deviations) / len(deviations))
    return {"layers": list(range(1, layers)), "top_share": share, "rank_correlation_next_layer": corr,
            "prompts": len(deviations)}
