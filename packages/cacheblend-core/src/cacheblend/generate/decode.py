"""The decode cache and one decode step.

The fused prefill fills a :class:`KVCache` (paper §5: the fused KV replaces the regular
prefill output); decoding then appends one token at a time to that same cache.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import native
from ..blend.attention import AttentionPlans, split_key_attention
from ..models.decoder import Decoder, ModelShape


class KVCache:
    """Preallocated fused KV cache: keys *after* RoPE, ``[layers, kv_heads, capacity, hd]``.

    After the fused prefill it is the engine's ordinary decode cache (paper §5: the fused
    KV replaces the regular prefill output)."""

    def __init__(self, shape: ModelShape, capacity: int, device: torch.device | str,
                 storage: tuple[Tensor, Tensor] | None = None) -> None:
        """``storage``: flat K and V tensors of at least the cache's size to lay it over
        (a kept buffer, :mod:`.kv_pool`); None: fresh ones."""
        dims = (shape.num_layers, shape.num_kv_heads, capacity, shape.head_dim)
        numel = self.size(shape, capacity)
        if storage is None:
            storage = (torch.empty(numel, dtype=shape.dtype, device=device),
                       torch.empty(numel, dtype=shape.dtype, device=device))
        self.storage = storage
        self.k = storage[0][:numel].view(dims)
        self.v = storage[1][:numel].view(dims)
        self.capacity = capacity
        self.length = 0

    @staticmethod
    def size(shape: ModelShape, capacity: int) -> int:
        """Elements of each of K and V for ``capacity`` positions."""
        return shape.num_layers * shape.num_kv_heads * capacity * shape.head_dim


def decode_step(dec: Decoder, kv: KVCache, token_id: int) -> Tensor:
    """Append one token at position ``kv.length`` and return next-token logits."""
    pos = kv.length
    if pos >= kv.capacity:
        raise ValueError("KV cache is full")
    device = kv.k.device
    positions = torch.tensor([pos], device=device)
    cos, sin = dec.rope_tables(positions)
    h = dec.embed(torch.tensor([token_id], device=device))
    plans = AttentionPlans(positions, dec.shape.dtype, dec.shape.groups)
    for layer in range(dec.shape.num_layers):
        q, k, v = dec.qkv_rope(layer, h, cos, sin)
        h = dec.finish(layer, h, append_and_attend(dec, kv, layer, q, k, v, pos, plans))
    kv.length = pos + 1
    return dec.logits(h)[0]


def append_and_attend(dec: Decoder, kv: KVCache, layer: int, q: Tensor, k: Tensor, v: Tensor, pos: int,
                      plans: AttentionPlans) -> Tensor:
    """Write one token's ``k``, ``v`` [KVH, 1, hd] at ``pos`` of ``layer`` and attend its ``q``
    [H, 1, hd] over keys 0..pos: through the native kernel where the decoder has it (not past
    a sliding window), else PyTorch's kernel split in two halves of the keys where that fits,
    else through ``plans`` (built for ``[pos]``).  The eager step and the compiled one's attention op share it."""
    kv.k[layer, :, pos : pos + 1] = k
    kv.v[layer, :, pos : pos + 1] = v
    window, n = dec.shape.windows[layer], pos + 1
    if window is None or window >= n:  # every cached key is visible
        if dec.decode_attention is not None:
            return dec.decode_attention(q, kv.k[layer], kv.v[layer], n, dec.scaling,
                                        native.key_slices(dec.shape.num_kv_heads, n))
        if split_key_attention.fits(kv.k.dtype, n, kv.capacity):
            return split_key_attention(q, kv.k[layer], kv.v[layer], n, dec.scaling)
    return plans[window](q, kv.k[layer, :, :n], kv.v[layer, :, :n], dec.scaling)
