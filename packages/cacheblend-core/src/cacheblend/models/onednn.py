"""The projection weights reordered once into oneDNN's blocked layout, for every product.

MKL's ``x @ W`` re-packs the weight into its own blocks inside every call; oneDNN can take
a weight reordered ahead of time (the same prepacking vLLM's CPU backend does for its
linear layers) and skip that work.  Measured on the 2-core AMD EPYC (AVX-512), float32,
two engines in one process, alternating (``benchmarks/onednn_weights.py``,
docs/internals/latency.md): full prefill of a 3.8K-token musique prompt 10.36 → 9.38 s,
blend at 15 % 2.59 → 2.43 s, decode 69 → 64 ms per token; the same greedy tokens.

The reordered tensors are opaque (no strides, no views), so transformers' modules cannot
run on them.  Rather than keep a second copy of the weights, :func:`release` takes the
projection weights away from those modules once the copies exist: the model's own
``forward`` then raises (its projections are meta tensors, and a hook on each says why,
instead of the zeros PyTorch would compute from them), and the decoder is the only way to
run it.  ``EngineConfig.onednn_weights=False`` keeps transformers' modules
working on the packed weights.  float32 and bfloat16 weights are reordered (the dtypes
measured, :data:`REORDERED_DTYPES`); where PyTorch has no oneDNN, or the reorder fails, the
decoder keeps the ``[in, out]`` products and says why once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .packed import PackedWeights

log = logging.getLogger("cacheblend.onednn")

__all__ = ["REORDERED_DTYPES", "OneDnnLayer", "OneDnnWeights", "faster_one_row", "give_back_freed_memory",
           "in_place_products", "linear", "release"]

# The weight dtypes reordered (those measured).  bfloat16 on an AMX Xeon: a decode step's
# 30 layers of one-row products take 19 ms on reordered weights against 31 ms through
# ``x @ W`` (prefill products are within 10 % either way).
REORDERED_DTYPES = (torch.float32, torch.bfloat16)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ W (+ bias)`` with ``weight`` reordered by :func:`_reorder`."""
    # The op inductor's CPU backend emits for a frozen linear layer (no public name).
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # noqa: SLF001


def _probe_rows(width: int, dtype: torch.dtype) -> Tensor:
    """Two rows of fixed random values: an all-ones row sums each weight row, so it cannot
    see a product that reads the input in another order (a transposed or permuted weight)."""
    return torch.randn(2, width, generator=torch.Generator().manual_seed(0)).to(dtype)


def _agrees(got: Tensor, want: Tensor) -> bool:
    """Whether two products agree to the rounding of their dtype, relative to their scale."""
    tol = 1e-3 if want.dtype == torch.float32 else 2e-2
    got, want = got.float(), want.float()
    return bool((got - want).abs().max() <= tol * max(1.0, float(want.abs().max())))


def in_place_products(hf_model: Any) -> bool:
    """Whether :func:`linear` can run on transformers' own ``[out, in]`` weights, as they
    are: every projection an ``nn.Linear`` with a dense CPU weight of a reordered dtype, and
    oneDNN's product on one agreeing with PyTorch's.

    Why: where the weights must stay views of the memory-mapped safetensors file (the vLLM
    connector's worker, ``EngineConfig.pack_weights=False``), no reordered copy can be
    kept, but oneDNN still multiplies a plain weight faster than ``F.linear`` (MKL) does
    for a prefill's rows.  Two unpacked engines in one process, 4 musique dev prompts, blend
    at 15 % from a disk store (AMD EPYC): 1.591 s through ``F.linear``, 1.488 s through oneDNN
    on the same weights, 1.428 s on the packed, reordered copy; the same greedy tokens."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")):
        return False
    mods = [m for blk in hf_model.model.layers for m in (blk.self_attn.q_proj, blk.self_attn.k_proj,
            blk.self_attn.v_proj, blk.self_attn.o_proj, blk.mlp.gate_proj, blk.mlp.up_proj, blk.mlp.down_proj)]
    mods.append(hf_model.lm_head)
    if not all(type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype in REORDERED_DTYPES
               and m.weight.is_contiguous() for m in mods):
        return False
    try:
        with torch.no_grad():  # one layer's products, and the head
            return all(_agrees(linear(x := _probe_rows(m.weight.shape[1], m.weight.dtype), m.weight, m.bias), m(x))
                       for m in mods[:7] + mods[-1:])
    except RuntimeError as e:  # an ISA or build oneDNN does not support here: transformers' products
        log.warning("cacheblend: oneDNN products unavailable (%s); the projections run through transformers", e)
        return False


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
    qkv_bias: Tensor | None
    o: Tensor
    o_bias: Tensor | None
    gate_up: Tensor
    down: Tensor


@dataclass(frozen=True)
class OneDnnWeights:
    layers: tuple[OneDnnLayer, ...]
    head: Tensor | None

    @classmethod
    def reorder(cls, packed: PackedWeights, q_width: int) -> OneDnnWeights | None:
        """oneDNN copies of ``packed``'s products; None where they cannot be made here."""
        if packed.layers[0].qkv.dtype not in REORDERED_DTYPES or packed.layers[0].qkv.device.type != "cpu":
            return None
        ops = torch.ops.mkldnn  # both ops have no public name: a build without either keeps MKL
        if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
                and hasattr(ops, "_linear_pointwise")):
            log.warning("cacheblend: this PyTorch has no oneDNN; the projections run through MKL")
            return None
        try:
            with torch.no_grad():
                layers = tuple(OneDnnLayer(
                    q=_reorder(p.qkv[:, :q_width]), kv=_reorder(p.qkv[:, q_width:]), qkv=_reorder(p.qkv),
                    qkv_bias=p.qkv_bias, o=_reorder(p.o), o_bias=p.o_bias, gate_up=_reorder(p.gate_up),
                    down=_reorder(p.down)) for p in packed.layers)
                head = None if packed.head is None else _reorder(packed.head)
                plain = packed.layers[-1]  # the last layer's products, and the head
                pairs = [(layers[-1].q, plain.qkv[:, :q_width]), (layers[-1].kv, plain.qkv[:, q_width:]),
                         (layers[-1].qkv, plain.qkv), (layers[-1].o, plain.o), (layers[-1].gate_up, plain.gate_up),
                         (layers[-1].down, plain.down)]
                if head is not None and packed.head is not None:
                    pairs.append((head, packed.head))
                for reordered, w in pairs:
                    x = _probe_rows(w.shape[0], w.dtype)
                    if not _agrees(linear(x, reordered), x @ w):
                        raise RuntimeError("a reordered product disagrees with the plain one")
        except RuntimeError as e:  # an ISA or build the reorder does not support: the plain products
            log.warning("cacheblend: oneDNN weights unavailable (%s); the projections run through MKL", e)
            return None
        return cls(layers, head)


# Where the measured choice keeps MKL: its one-row pass must be this much faster than oneDNN's.
# Why a margin: oneDNN was the measured winner on the AMD EPYC (decode 63.8 against 69.3 ms),
# so a tie on a noisy machine keeps it and the choice does not flip between two runs.
MKL_MARGIN = 0.95


def faster_one_row(packed: PackedWeights, dnn: OneDnnWeights, rounds: int = 3,
                   clock: Callable[[], float] = time.perf_counter) -> tuple[bool, float, float]:
    """Whether oneDNN's reordered weights multiply one row (a decode step) faster than MKL's
    ``x @ W`` on the packed ones, on this CPU: (oneDNN, MKL seconds, oneDNN seconds).

    Why measure: the winner depends on the CPU and the dtype, by a lot.  30 SmolLM2 layers of
    one-row products: on the AMD EPYC (AVX-512, float32) oneDNN was faster; on an AMX Xeon,
    float32 takes 16.5 ms through MKL against 22.5 ms through oneDNN, bfloat16 21.6 against
    13.5 (docs/internals/latency.md).  Prefill-sized products were within a few percent either
    way on both.  Each pass streams every layer's weights once, as a decode step does; the
    two alternate ``rounds`` times after a warm-up pass each, and each keeps its fastest."""
    dtype = packed.layers[0].qkv.dtype
    widths = {n for p in packed.layers for n in (p.qkv.shape[0], p.o.shape[0], p.down.shape[0])}
    rows = {n: torch.ones(1, n, dtype=dtype) for n in widths}

    def mkl() -> None:
        for p in packed.layers:
            for w in (p.qkv, p.o, p.gate_up, p.down):
                rows[w.shape[0]] @ w

    def onednn() -> None:
        for p, d in zip(packed.layers, dnn.layers, strict=True):
            for w_in_out, w in ((p.qkv, d.qkv), (p.o, d.o), (p.gate_up, d.gate_up), (p.down, d.down)):
                linear(rows[w_in_out.shape[0]], w)

    best = {mkl: float("inf"), onednn: float("inf")}
    with torch.no_grad():
        mkl()
        onednn()
        for r in range(rounds):
            for fn in ((mkl, onednn) if r % 2 == 0 else (onednn, mkl)):
                t = clock()
                fn()
                best[fn] = min(best[fn], clock() - t)
    return not best[mkl] < MKL_MARGIN * best[onednn], best[mkl], best[onednn]


def _released(module: nn.Module, args: Any) -> None:
    raise RuntimeError(
        f"cacheblend: this {type(module).__name__}'s weights were reordered for oneDNN and taken away from "
        "transformers' module (EngineConfig.onednn_weights=True); run the model through cacheblend's "
        "Decoder, or load it apart, or pass onednn_weights=False")


def release(hf_model: Any, head: bool) -> None:
    """Take the projection weights (and the output head, when ``head``: it was reordered too)
    away from transformers' modules: they become meta tensors, so the packed tensors they
    viewed are freed and the process holds one copy of the weights; calling such a module
    raises.  A tied embedding gets a
    table of its own first (it was a view of the packed head)."""
    def drop(module: Any) -> None:
        module.weight = nn.Parameter(torch.empty(module.weight.shape, device="meta"), requires_grad=False)
        module.register_forward_pre_hook(_released)

    for blk in hf_model.model.layers:
        attn, mlp = blk.self_attn, blk.mlp
        for module in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            drop(module)
    if head:
        embed = hf_model.model.embed_tokens
        if embed.weight is hf_model.lm_head.weight:
            embed.weight = nn.Parameter(embed.weight.detach().contiguous(), requires_grad=False)
        drop(hf_model.lm_head)


def give_back_freed_memory() -> None:
    """Return freed heap pages to the system now.  Why: the packed weights :func:`release`
    lets go of were allocated among other blocks of glibc's heap, which keeps freed memory
    mapped, and counted in the process's resident set, until asked to trim (measured on
    SmolLM2: 1.65 GB resident before the trim, 1.15 GB after).  A no-op without glibc."""
    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator decides when to give back
        pass
