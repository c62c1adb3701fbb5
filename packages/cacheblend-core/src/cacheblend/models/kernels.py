"""The elementwise parts of a layer as functions: plain PyTorch, compiled with
``torch.compile``, or our own one-pass kernels (:meth:`Kernels.use_native`,
:mod:`cacheblend.native`, float32 and bfloat16: the default where they build).

The profile (docs/internals/performance-log.md) puts a tenth of full prefill in elementwise work run as
separate eager ops over [n, d] tensors: RMSNorm (square, mean, rsqrt, two products), RoPE
(two products, a negation, a concatenation and a sum), SiLU-gating and the residual adds.
Each op reads and writes the whole activation again.  Compiled, inductor fuses each of
these groups into one loop and keeps the matmuls as library calls.

The functions take the weights as arguments, so one compiled graph serves every layer
(shapes are dynamic in the number of tokens: one graph serves every prompt length).
Compiled code is cached on disk (inductor's FX graph cache, under ``$CACHEBLEND_HOME/inductor``
unless ``TORCHINDUCTOR_CACHE_DIR`` is set), so its cost is paid once per machine.  Where
compilation fails (no C++ compiler, an unsupported platform) the kernels say why once and
run eagerly from then on: a slower answer, never a failed one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .loader import cache_home

if TYPE_CHECKING:
    from ..native import LayerOps

log = logging.getLogger("cacheblend.kernels")


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` [heads, n, head_dim] to the positions whose ``cos``/``sin`` [n, hd] are given."""
    return x * cos + rotate_half(x) * sin


def rope_into(out: Tensor, x: Tensor, cos: Tensor, sin: Tensor) -> None:
    """:func:`apply_rope` written into ``out`` (a slice of the fused cache) without the
    result's temporaries: the same products and sum, so the same bits."""
    torch.mul(x, cos, out=out)
    out.add_(rotate_half(x) * sin)  # not in place: ``x`` may be stored narrower than ``sin``


Shift = tuple[Tensor | None, Tensor | None] | None  # a span's chunk shift of K and V [KVH, 1, hd]


def reposition(out_k: Tensor, out_v: Tensor, starts: list[int], cached: list[tuple[Tensor, Tensor]],
               shifts: list[Shift], cos: Tensor, sin: Tensor,
               rope_into_: Callable[[Tensor, Tensor, Tensor, Tensor], None] = rope_into) -> None:
    """One layer's reused K/V written into the fused cache (``out_k``/``out_v`` [KVH, n, hd]):
    span i's keys rotated to positions ``starts[i]``.. (``cos``/``sin`` [n, hd]) and its
    values copied, each half moved by the span's chunk shift where it has one (summed in
    the stored dtype, then written)."""
    for a, (ck, cv), shift in zip(starts, cached, shifts, strict=True):
        b = a + ck.shape[1]
        dk, dv = shift if shift is not None else (None, None)
        rope_into_(out_k[:, a:b], ck if dk is None else ck + dk, cos[a:b], sin[a:b])
        if dv is None:
            out_v[:, a:b] = cv
        else:
            torch.add(cv, dv, out=out_v[:, a:b])


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama's RMSNorm, bit for bit as transformers computes it (in float32, then back to
    ``x``'s dtype, then times the weight), through PyTorch's fused op: one op where
    transformers' module runs eight, which a decode step pays twice per layer
    (``tests/test_packed.py`` holds the bits equal in float32 and bfloat16)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.to(torch.float32), (x.shape[-1],), None, eps).to(x.dtype)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """The gated MLP's hidden rows: SiLU of the gate times up (as transformers' Llama MLP)."""
    return F.silu(gate) * up


def finish(h: Tensor, attn: Tensor, wo: Tensor, bo: Tensor | None, norm_w: Tensor, eps: float,
           w_gate_up: Tensor, wd: Tensor, mm: Callable[[Tensor, Tensor], Tensor] = torch.matmul,
           norm: Callable[[Tensor, Tensor, float], Tensor] = rms_norm,
           act: Callable[[Tensor, Tensor], Tensor] = silu_mul) -> Tensor:
    """Output projection and residual, then RMSNorm, the SiLU-gated MLP and its residual.
    ``attn`` is [n, H·hd]; the weights are packed ``[in, out]`` (:mod:`.packed`), gate and
    up side by side in ``w_gate_up``, or reordered for ``mm`` (:func:`.onednn.linear`);
    ``norm`` and ``act`` may be the native pieces (:class:`Kernels`)."""
    o = mm(attn, wo)
    h = h + (o if bo is None else o + bo)
    gate, up = mm(norm(h, norm_w, eps), w_gate_up).chunk(2, dim=-1)
    return h + mm(act(gate, up), wd)


class Kernels:
    """The layer pieces the decoder runs: the plain functions, compiled ones that fall back
    to the plain functions for good on their first failure, or (:meth:`use_native`) our
    pieces from :mod:`cacheblend.native`."""

    def __init__(self, compiled: bool = False) -> None:
        self.compiled = compiled
        self.native = False
        self.rope: Callable[..., Tensor] = apply_rope
        self.rope_into: Callable[[Tensor, Tensor, Tensor, Tensor], None] = rope_into
        self.norm: Callable[..., Tensor] = rms_norm
        self.act: Callable[[Tensor, Tensor], Tensor] = silu_mul
        self.finish: Callable[..., Tensor] = finish
        if compiled:
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_home() / "inductor"))
            self.rope, self.norm, self.finish = (self._guarded(fn) for fn in (apply_rope, rms_norm, finish))
            self.rope_into = self._compiled_rope_into
        self.reposition: Callable[..., None] = partial(reposition, rope_into_=self.rope_into)

    def _compiled_rope_into(self, out: Tensor, x: Tensor, cos: Tensor, sin: Tensor) -> None:
        """The compiled RoPE copied into ``out``; the plain one in place once compiling failed."""
        if self.compiled:
            out.copy_(self.rope(x, cos, sin))
        else:
            rope_into(out, x, cos, sin)

    def _guarded(self, fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        fast = torch.compile(fn, dynamic=True)

        def run(*args: Any) -> Tensor:
            if not self.compiled:
                return fn(*args)
            try:
                return fast(*args)
            except Exception as e:  # noqa: BLE001 - any compiler failure: fall back, never fail the request
                log.warning("cacheblend: torch.compile is unavailable here (%s: %s); running eagerly",
                            type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                self.compiled = False
                return fn(*args)

        return run

    def use_native(self, ops: LayerOps) -> None:
        """Run RMSNorm, RoPE, the re-positioning and the SiLU gate through ``ops`` (float32 or bfloat16, every
        tensor of a call in one dtype; where a call's tensors do not fit them, e.g.
        broadcast tables or mixed dtypes, the plain function runs)."""
        if self.compiled:
            return  # inductor fuses these pieces itself

        from ..native import DTYPES  # the dtypes the pieces take (one definition)

        def ok(*ts: Tensor) -> bool:
            return ts[0].dtype in DTYPES and all(t.dtype == ts[0].dtype and t.stride(-1) == 1 for t in ts)

        def norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
            return ops.rms_norm(x, weight, eps) if x.dim() == 2 and ok(x, weight) else rms_norm(x, weight, eps)

        def fits(x: Tensor, cos: Tensor, sin: Tensor) -> bool:
            return x.dim() == 3 and cos.shape == sin.shape == (x.shape[1], x.shape[2]) and ok(x, cos, sin)

        def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
            return ops.rope(x, cos, sin) if fits(x, cos, sin) else apply_rope(x, cos, sin)

        def rope_into_(out: Tensor, x: Tensor, cos: Tensor, sin: Tensor) -> None:
            if fits(x, cos, sin) and out.shape == x.shape and ok(x, out):
                ops.rope_into(out, x, cos, sin)
            else:
                rope_into(out, x, cos, sin)

        def reposition_(out_k: Tensor, out_v: Tensor, starts: list[int], cached: list[tuple[Tensor, Tensor]],
                        shifts: list[Shift], cos: Tensor, sin: Tensor) -> None:
            ks, vs = [k for k, _ in cached], [v for _, v in cached]
            dks, dvs = ([None if s is None else s[i] for s in shifts] for i in (0, 1))
            if ok(out_k, out_v, cos, sin, *ks, *vs, *(d for d in (*dks, *dvs) if d is not None)) \
                    and cos.dim() == 2 and cos.shape == sin.shape:
                ops.reposition(out_k, out_v, starts, ks, vs, dks, dvs, cos, sin)
            else:
                reposition(out_k, out_v, starts, cached, shifts, cos, sin, rope_into_)

        def act(gate: Tensor, up: Tensor) -> Tensor:
            return ops.silu_mul(gate, up) if gate.dim() == 2 and gate.shape == up.shape and ok(gate, up) \
                else silu_mul(gate, up)

        self.native, self.norm, self.rope, self.rope_into, self.act = True, norm, rope, rope_into_, act
        self.reposition = reposition_
        self.finish = partial(finish, norm=norm, act=act)

