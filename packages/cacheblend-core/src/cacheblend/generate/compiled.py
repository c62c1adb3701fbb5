"""A decode step as one compiled graph (``EngineConfig.compile_decode``).

An eager decode step runs about 40 small ops per layer, 30 layers a token: RMSNorm, RoPE,
SiLU gating, residuals, views.  Each costs a dispatch and a pass over a tiny tensor, and
the step spends a fifth of its time outside any op (docs/internals/performance-log.md).  Here the whole
step is one ``torch.compile`` graph, as gpt-fast does: inductor fuses the elementwise work
of a layer into a few loops and Python runs once per token, not once per op.

Two things stay outside the graph, as opaque custom ops, for the same reason vLLM keeps its
attention outside its compiled graphs:

- **attention and the cache write** (``cacheblend::decode_attention``).  A graph that writes
  into the decode cache gets it functionalised: inductor then copies the whole 30-layer
  cache back at every step, six times slower than eager (docs/internals/latency.md).  The
  op finds the request's cache through the step object (a registry keyed by a small int),
  writes the new key and value and runs the same attention as :func:`.decode.decode_step`.
- **products on oneDNN's reordered weights** (``cacheblend::onednn_linear``).  Those tensors
  are opaque (no strides): a graph cannot take them as inputs.  Packed ``[in, out]`` weights
  (MKL) are plain tensors and go into the graph as ``x @ W``.

Nothing is frozen into the graph, so inductor's on-disk cache serves it to the next process
(under ``$CACHEBLEND_HOME/inductor``): 12–18 s to compile the first time on 2 cores, about 3 s
to trace and load it afterwards.  Any failure to compile or run the graph logs once and the
step runs eagerly from then on: a slower answer, never a failed one.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import weakref
from typing import Any

import torch
from torch import Tensor

from ..blend.attention import AttentionPlans
from ..models.decoder import Decoder
from ..models.kernels import apply_rope, rms_norm
from ..models.loader import cache_home
from ..models.onednn import linear
from .decode import KVCache, append_and_attend, decode_step

log = logging.getLogger("cacheblend.compiled")

__all__ = ["CompiledStep"]

_STEPS: weakref.WeakValueDictionary[int, CompiledStep] = weakref.WeakValueDictionary()
_KEYS = itertools.count()  # per process: the first engine's graph has key 0 in every process (disk-cache hits)
_QKV, _O, _GATE_UP, _DOWN, _HEAD = range(5)


@torch.library.custom_op("cacheblend::decode_attention", mutates_args=())
def _decode_attention(q: Tensor, k: Tensor, v: Tensor, key: int, layer: int, pos: Tensor) -> Tensor:
    """:func:`.decode.append_and_attend` on the running step's cache."""
    step = _STEPS[key]
    assert step.kv is not None
    plans = AttentionPlans(pos.reshape(1), step.dec.shape.dtype, step.dec.shape.groups)  # built only if used
    return append_and_attend(step.dec, step.kv, layer, q, k, v, int(pos), plans)


@_decode_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, key: int, layer: int, pos: Tensor) -> Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("cacheblend::onednn_linear", mutates_args=())
def _onednn_linear(x: Tensor, key: int, layer: int, which: int) -> Tensor:
    """``x`` times one of the decoder's oneDNN-reordered weights (by layer and role)."""
    dnn = _STEPS[key].dec.dnn
    assert dnn is not None
    if which == _HEAD:
        assert dnn.head is not None
        return linear(x, dnn.head)
    d = dnn.layers[layer]
    return linear(x, (d.qkv, d.o, d.gate_up, d.down)[which])


@_onednn_linear.register_fake
def _(x: Tensor, key: int, layer: int, which: int) -> Tensor:
    return x.new_empty(x.shape[0], _STEPS[key].widths[which])


class CompiledStep:
    """:func:`.decode.decode_step` as one compiled graph per decoder; same signature."""

    def __init__(self, dec: Decoder) -> None:
        self.dec = dec
        self.kv: KVCache | None = None  # the cache of the step being run (the attention op's)
        self._lock = threading.Lock()  # one step at a time: ``kv`` is the running step's (async streams use threads)
        self.key = next(_KEYS)
        _STEPS[self.key] = self
        s, first = dec.shape, dec.layers[0]
        self.widths = ((s.num_heads + 2 * s.num_kv_heads) * s.head_dim, first.self_attn.o_proj.out_features,
                       2 * first.mlp.gate_proj.out_features, first.mlp.down_proj.out_features,
                       dec.embed_tokens.weight.shape[0])
        # Where the products are neither oneDNN's nor packed (transformers' modules run), or the
        # output head kept a bias, the eager step runs.
        head = dec.dnn.head if dec.dnn is not None else dec.packed.head if dec.packed is not None else None
        self.enabled = head is not None
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_home() / "inductor"))
        # emulate_precision_casts: fused bf16 loops round where eager ops would, so compiled
        # and eager bf16 steps stay close (float32 is unaffected).
        self.graph: Any = torch.compile(self._step, dynamic=False, options={"emulate_precision_casts": True})

    def __call__(self, dec: Decoder, kv: KVCache, token_id: int) -> Tensor:
        """Append one token at position ``kv.length`` and return next-token logits."""
        if dec is not self.dec:
            raise ValueError("this compiled step belongs to another decoder")
        if not self.enabled or dec.external is not None:  # adopted products (Decoder.adopt) run eagerly
            return decode_step(dec, kv, token_id)
        pos = kv.length
        if pos >= kv.capacity:
            raise ValueError("KV cache is full")
        positions = torch.tensor([pos], device=kv.k.device)
        cos, sin = dec.rope_tables(positions)
        h = dec.embed(torch.tensor([token_id], device=kv.k.device))
        with self._lock:
            self.kv = kv
            try:
                logits = self.graph(h, cos, sin, positions[0])
            except Exception as e:  # noqa: BLE001 - any compiler failure: fall back, never fail the request
                log.warning("cacheblend: the compiled decode step is unavailable here (%s: %s); decoding eagerly",
                            type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                self.enabled = False
                return decode_step(dec, kv, token_id)  # rewrites whatever the graph wrote at pos
            finally:
                self.kv = None
        kv.length = pos + 1
        return logits

    # -- the graph ------------------------------------------------------------------------
    def _mm(self, x: Tensor, layer: int, which: int) -> Tensor:
        dec = self.dec
        if dec.dnn is not None:
            return _onednn_linear(x, self.key, layer, which)
        assert dec.packed is not None
        if which == _HEAD:
            assert dec.packed.head is not None
            return x @ dec.packed.head
        p = dec.packed.layers[layer]
        return x @ (p.qkv, p.o, p.gate_up, p.down)[which]

    def _biases(self, layer: int) -> tuple[Tensor | None, Tensor | None]:
        dec = self.dec
        w: Any = dec.dnn.layers[layer] if dec.dnn is not None else dec.packed.layers[layer]  # type: ignore[union-attr]
        return w.qkv_bias, w.o_bias

    def _step(self, h: Tensor, cos: Tensor, sin: Tensor, pos: Tensor) -> Tensor:
        dec, s = self.dec, self.dec.shape
        width, kv_width = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        for layer in range(s.num_layers):
            blk = dec.layers[layer]
            attn, n1, n2 = blk.self_attn, blk.input_layernorm, blk.post_attention_layernorm
            qkv_bias, o_bias = self._biases(layer)
            out = self._mm(rms_norm(h, n1.weight, n1.variance_epsilon), layer, _QKV)
            if qkv_bias is not None:
                out = out + qkv_bias
            q, k, v = out.split([width, kv_width, kv_width], dim=-1)
            q, k = q.view(1, s.num_heads, s.head_dim), k.view(1, s.num_kv_heads, s.head_dim)
            if dec.has_qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = apply_rope(q.transpose(0, 1), cos, sin), apply_rope(k.transpose(0, 1), cos, sin)
            v = v.view(1, s.num_kv_heads, s.head_dim).transpose(0, 1)
            a = _decode_attention(q, k, v, self.key, layer, pos).transpose(0, 1).reshape(1, width)
            o = self._mm(a, layer, _O)
            h = h + (o if o_bias is None else o + o_bias)
            gate, up = self._mm(rms_norm(h, n2.weight, n2.variance_epsilon), layer, _GATE_UP).chunk(2, dim=-1)
            h = h + self._mm(torch.nn.functional.silu(gate) * up, layer, _DOWN)
        norm = dec.final_norm
        return self._mm(rms_norm(h, norm.weight, norm.variance_epsilon), -1, _HEAD).float()[0]
