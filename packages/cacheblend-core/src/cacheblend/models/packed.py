"""The projection weights re-laid for one-row products: fused and stored ``[in, out]``.

A decode step multiplies one row by every weight matrix of the model; it is bound by how
fast those weights stream from memory.  Measured on a 2-core AVX2 CPU (docs/internals/latency.md),
MKL streams a weight stored ``[in, out]`` and row-major (``x @ W``) faster than the
``[out, in]`` layout ``nn.Linear`` keeps (``F.linear`` multiplies by its transpose), and one
product over q, k and v together (or over the MLP's gate and up) faster than two or three:
30 SmolLM2 layers take 36 ms instead of 47, the tied output head 9 ms instead of 14.  For a
prefill's large products the packed layout is no slower (a tenth faster on the MLP).

Packing costs no memory once loaded: the packed tensors replace the originals, and
transformers' ``nn.Linear`` modules are re-pointed at views of them (``weight`` = a
transposed slice), so the HF model still runs as before on the same numbers.  The weights
become the process's own memory instead of pages of the mapped safetensors file; while
packing, the mapped pages it reads are resident too (SmolLM2: a peak of 1.5 GB RSS instead
of 1.0 GB, then 1.0 GB either way once a prompt has run).  A tied output head stays tied: the
embedding table becomes a view of the transposed head (a lookup reads a strided column,
negligible next to a prefill).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["PackedLayer", "PackedWeights", "packing_pays"]


def bf16_products_native() -> bool:
    """Whether PyTorch runs bfloat16 products through oneDNN on this CPU (AVX-512 or
    AVX-NE-CONVERT); elsewhere (AVX2) ATen falls back to its own reference gemm."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # noqa: SLF001 - the check its matmul dispatch makes


def packing_pays(dtype: torch.dtype) -> bool:
    """Whether the packed ``[in, out]`` layout is worth having for products in ``dtype``.

    float32: always (above).  bfloat16 only where :func:`bf16_products_native`: ATen's
    fallback gemm multiplies ``x @ W`` with W ``[in, out]`` far slower than ``F.linear`` on
    ``[out, in]``.  Measured on a 2-core AMD EPYC with AVX2 (docs/internals/latency.md): 680
    rows x 576 x 3072 took 1.90 s against 0.16 s, one row 2.8 against 0.24 ms, so a bf16
    engine's 680-token prefill took 84 s where transformers' own took 13."""
    return dtype != torch.bfloat16 or bf16_products_native()


@dataclass(frozen=True)
class PackedLayer:
    """One layer's projections as ``[in, out]`` row-major tensors."""

    qkv: Tensor  # [d, (H + 2·KVH)·hd]: queries, then keys, then values
    qkv_bias: Tensor | None
    o: Tensor  # [H·hd, d]
    o_bias: Tensor | None
    gate_up: Tensor  # [d, 2·I]: gate, then up
    down: Tensor  # [I, d]


@dataclass(frozen=True)
class PackedWeights:
    """Every layer's :class:`PackedLayer` and the output head ``[d, vocab]``."""

    layers: tuple[PackedLayer, ...]
    head: Tensor | None  # None: the head has a bias and runs as transformers' module

    @classmethod
    def pack(cls, hf_model: Any) -> PackedWeights:
        """Pack a Llama-family ``*ForCausalLM`` whose MLPs are gated and bias-free (the
        caller checks), re-pointing its modules at views of the packed tensors."""
        with torch.no_grad():
            packed = cls(tuple(_pack_layer(blk) for blk in hf_model.model.layers), _pack_head(hf_model))
            _own_the_rest(hf_model, packed)
            return packed

    def tensors(self) -> list[Tensor]:
        out = [t for p in self.layers for t in (p.qkv, p.qkv_bias, p.o, p.o_bias, p.gate_up, p.down) if t is not None]
        return out + ([self.head] if self.head is not None else [])


def _pack_layer(blk: Any) -> PackedLayer:
    attn, mlp = blk.self_attn, blk.mlp
    qkv, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
    o, o_bias = _fuse([attn.o_proj])
    gate_up, _ = _fuse([mlp.gate_proj, mlp.up_proj])
    down, _ = _fuse([mlp.down_proj])
    return PackedLayer(qkv, qkv_bias, o, o_bias, gate_up, down)


def _fuse(linears: list[nn.Linear]) -> tuple[Tensor, Tensor | None]:
    """Concatenate ``linears`` along their outputs into one ``[in, Σout]`` tensor and point
    each module's ``weight`` (and ``bias``) at its slice of it."""
    packed = torch.cat([m.weight for m in linears]).t().contiguous()
    has_bias = [m.bias is not None for m in linears]
    bias = None
    if any(has_bias):
        bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])
    start = 0
    for m, b in zip(linears, has_bias, strict=True):
        end = start + m.out_features
        m.weight = nn.Parameter(packed[:, start:end].t(), requires_grad=False)
        if b and bias is not None:
            m.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return packed, bias


def _pack_head(hf_model: Any) -> Tensor | None:
    head, embed = hf_model.lm_head, hf_model.model.embed_tokens
    if getattr(head, "bias", None) is not None:
        return None
    tied = head.weight is embed.weight
    packed = head.weight.t().contiguous()
    head.weight = nn.Parameter(packed.t(), requires_grad=False)
    if tied:
        embed.weight = head.weight
    return packed


def _own_the_rest(hf_model: Any, packed: PackedWeights) -> None:
    """Copy the parameters packing did not touch (norms; a head with a bias) out of the
    loader's memory map.  transformers loads weights as views of the mapped safetensors
    file; while one view lives, the whole mapping stays, and so do the pages packing just
    read: the process would count the weights twice (file-backed and packed)."""
    mine = {t.untyped_storage().data_ptr() for t in packed.tensors()}
    for param in hf_model.parameters():
        if param.untyped_storage().data_ptr() not in mine:
            param.data = param.data.clone()
