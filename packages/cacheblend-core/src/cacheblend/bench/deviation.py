"""How sparse the KV deviation is, layer by layer (paper §4.3, Figs. 6 and 8), and how
much of it a chunk shift explains.

For each chunk token, the deviation at layer l is the squared distance between the K/V
that full prefill computes there and the chunk's precomputed K/V (both before RoPE, so
position plays no part).  Two properties make selective recompute work: a small share of
tokens holds most of the deviation (sparsity), and the tokens that deviate most at one
layer also do at the next (rank correlation), so a choice made at an early layer holds.
What selection cannot reach is the error every token of a chunk shares: its mean, which
the chunk shift correction estimates from a sample (:func:`shift_profile`).
"""

from __future__ import annotations

import torch

from ..blend.fusor import KVCache, Segment, fused_prefill
from ..blend.selection import BlendConfig
from ..engine import Engine
from .stats import spearman
from .tasks import Example, Task

TOP_SHARES = (0.01, 0.05, 0.10, 0.15, 0.20, 0.30, 0.50)


def chunk_errors(engine: Engine, task: Task, ex: Example) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per reused chunk: full prefill's K and V minus the chunk's precomputed ones,
    ``[layers, kv_heads, chunk tokens, head_dim]`` each (keys before RoPE)."""
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
    out, start = [], len(prompt.prefix)
    for h in handles:
        cached = engine.store.get(h.key) or engine.chunks.precompute(list(h.token_ids))
        span = slice(start, start + h.num_tokens)
        out.append((full_k[:, :, span] - cached.k.float(), full_v[:, :, span] - cached.v.float()))
        start += h.num_tokens
    return out


def token_deviation(errors: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``[layers, chunk tokens]`` squared K+V deviation of reused chunks from full prefill."""
    return torch.cat([ek.pow(2).sum(dim=(1, 3)) + ev.pow(2).sum(dim=(1, 3)) for ek, ev in errors], dim=1)


def shift_profile(prompts: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> dict:
    """Per layer: the share of the chunk tokens' squared key and value error that each
    chunk's mean error (per layer and KV head) holds, averaged over prompts: what a
    perfect chunk shift (``shift_share``, :mod:`cacheblend.blend.shift`) would remove."""
    layers = prompts[0][0][0].shape[0]
    share: dict[str, list[float]] = {"k": [], "v": []}
    for part, name in ((0, "k"), (1, "v")):
        for layer in range(1, layers):
            vals = []
            for errors in prompts:
                total = sum(float(e[part][layer].pow(2).sum()) for e in errors)
                mean = sum(float(e[part][layer].mean(1).pow(2).sum()) * e[part].shape[2] for e in errors)
                vals.append(mean / max(total, 1e-12))
            share[name].append(sum(vals) / len(vals))
    return {"shift_share_k": share["k"], "shift_share_v": share["v"]}


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
