"""The projection weights reordered once into oneDNN's blocked layout, for every product.

MKL's ``x @ W`` re-packs the weight into its own blocks inside every call; oneDNN can take
a weight reordered ahead of time (the same prepacking vLLM's CPU backend does for its
linear layers) and skip that work.  Measured on the 2-core AMD EPYC (AVX-512), float32,
same process, alternating (docs/internals/latency.md): full prefill of a 3.8K-token
musique prompt 10.3 → 8.0 s, blend at 15 % 2.37 → 1.94 s, decode 61–66 → 55–56 ms per
token; first-token logits within 7e-5 of the MKL products and the same greedy tokens.

The reordered tensors are opaque (no strides, no views), so they cannot stand in for the
weights transformers' modules hold: they are a second copy, beside the ``[in, out]``
tensors of :mod:`.packed` (SmolLM2-135M: about 0.7 GB more resident memory).
``EngineConfig.onednn_weights=False`` keeps one copy.  Only float32 weights are reordered
(the dtype measured); where PyTorch has no oneDNN, or the reorder fails, the decoder keeps
the ``[in, out]`` products and says why once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from .packed import PackedWeights

log = logging.getLogger("cacheblend.onednn")

__all__ = ["OneDnnLayer", "OneDnnWeights", "linear"]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ W (+ bias)`` with ``weight`` reordered by :func:`_reorder`."""
    # The op inductor's CPU backend emits for a frozen linear layer (no public name).
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # noqa: SLF001


def _reorder(w_in_out: Tensor) -> Tensor:
    """A ``[in, out]`` weight reordered for :func:`linear` (oneDNN takes ``[out, in]``)."""
    return torch.ops.mkldnn._reorder_linear_weight(w_in_out.t().contiguous())  # noqa: SLF001


@dataclass(frozen=True)
class OneDnnLayer:
    """One layer's products: queries, keys + values and all three together (the fusor
    computes queries for fewer rows than keys at a check layer; a decode step fuses them),
    the output projection, gate + up, and down."""

    q: Tensor
    kv: Tensor
    qkv: Tensor
    o: Tensor
    gate_up: Tensor
    down: Tensor


@dataclass(frozen=True)
class OneDnnWeights:
    layers: tuple[OneDnnLayer, ...]
    head: Tensor | None

    @classmethod
    def reorder(cls, packed: PackedWeights, q_width: int) -> OneDnnWeights | None:
        """oneDNN copies of ``packed``'s products; None where they cannot be made here."""
        if packed.layers[0].qkv.dtype != torch.float32 or packed.layers[0].qkv.device.type != "cpu":
            return None
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
            log.warning("cacheblend: this PyTorch has no oneDNN; the projections run through MKL")
            return None
        try:
            with torch.no_grad():
                layers = tuple(OneDnnLayer(
                    q=_reorder(p.qkv[:, :q_width]), kv=_reorder(p.qkv[:, q_width:]), qkv=_reorder(p.qkv),
                    o=_reorder(p.o), gate_up=_reorder(p.gate_up), down=_reorder(p.down)) for p in packed.layers)
                head = None if packed.head is None else _reorder(packed.head)
                probe = torch.ones(1, packed.layers[0].qkv.shape[0])
                if not torch.allclose(linear(probe, layers[0].qkv), probe @ packed.layers[0].qkv, atol=1e-3, rtol=1e-3):
                    raise RuntimeError("a reordered product disagrees with the plain one")
        except RuntimeError as e:  # an ISA or build the reorder does not support: the plain products
            log.warning("cacheblend: oneDNN weights unavailable (%s); the projections run through MKL", e)
            return None
        return cls(layers, head)
