"""vLLM's paged KV cache on CPU ("vec" attention ISA): views, and writing or reading the
K/V of a run of token positions through a request's block table."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def paged_views(cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K as ``[blocks, heads, head_dim, block_size]`` and V as ``[blocks, heads, block_size,
    head_dim]``: views of one layer's CPU cache ``[blocks, heads, block_size, 2*head_dim]``,
    whose (block, head) pages hold all K (transposed), then all V ("vec" ISA)."""
    nb, heads = cache.shape[:2]
    halves = cache.view(nb, heads, 2, -1)
    head_dim = halves.shape[-1] // block_size
    return (halves[:, :, 0].unflatten(-1, (head_dim, block_size)),
            halves[:, :, 1].unflatten(-1, (block_size, head_dim)))


def _slots(block_ids: Sequence[int], block_size: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block index and offset in it of token positions ``[start, end)``."""
    t = torch.arange(start, end)
    return torch.tensor(list(block_ids), dtype=torch.long)[t // block_size], t % block_size


def write_blocks(caches: Sequence[torch.Tensor], block_size: int, block_ids: Sequence[int], start: int,
                 k: torch.Tensor, v: torch.Tensor) -> None:
    """Write K (post-RoPE) and V ``[layers, heads, n, head_dim]`` of positions
    ``[start, start + n)`` into the blocks."""
    blk, off = _slots(block_ids, block_size, start, start + k.shape[2])
    for layer, cache in enumerate(caches):
        k_t, v_pg = paged_views(cache, block_size)
        k_t[blk, :, :, off] = k[layer].permute(1, 0, 2).to(cache.dtype)
        v_pg[blk, :, off] = v[layer].permute(1, 0, 2).to(cache.dtype)


def read_blocks(caches: Sequence[torch.Tensor], block_size: int, block_ids: Sequence[int], start: int,
                end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K (as stored: post-RoPE) and V ``[layers, heads, tokens, head_dim]`` of positions
    ``[start, end)`` from the blocks."""
    blk, off = _slots(block_ids, block_size, start, end)
    ks, vs = [], []
    for cache in caches:
        k_t, v_pg = paged_views(cache, block_size)
        ks.append(k_t[blk, :, :, off].permute(1, 0, 2))  # [n, H, D] -> [H, n, D]
        vs.append(v_pg[blk, :, off].permute(1, 0, 2))
    return torch.stack(ks), torch.stack(vs)
