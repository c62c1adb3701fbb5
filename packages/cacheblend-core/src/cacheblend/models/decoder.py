"""Layer-by-layer execution of a Llama-family transformer over HF weights.

CacheBlend needs what ``model.forward`` does not offer: run one layer at a time, on an
arbitrary subset of token positions (the HKVD tokens plus the question), read each
layer's keys *before* RoPE (so caches are position-free) and write fresh K/V into a
fused cache.  Rather than monkey-patching transformers' modules we call their
sub-modules (projections, norms, MLP, rotary embedding) directly, so the weights,
RoPE scaling variants and numerics are exactly transformers' own.

Supported families share one layer shape: Llama, Mistral, Qwen2 (q/k/v bias lives in
the ``nn.Linear``), Qwen3 (per-head ``q_norm``/``k_norm`` before RoPE).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import native
from ..errors import CacheBlendError
from .external import ExternalProducts
from .kernels import Kernels, Shift, apply_rope, finish, rotate_half
from .onednn import OneDnnWeights, faster_one_row, give_back_freed_memory, in_place_products, linear, release
from .packed import PackedWeights, packing_pays

log = logging.getLogger("cacheblend.decoder")

__all__ = ["SUPPORTED_MODEL_TYPES", "Decoder", "ModelShape", "apply_rope", "rotate_half"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_TILE_BYTES = 8 << 20  # the MLP's widest temporary per tile (measured best: 512-768 rows on SmolLM2)
_MIN_ROW_TILE = 256  # fewer rows per product would cost more in GEMM efficiency than the faults


@dataclass(frozen=True)
class ModelShape:
    """What the fusor and the store need to know about a model's KV layout."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    windows: tuple[int | None, ...]  # per layer: sliding-window size, None for full attention
    dtype: torch.dtype

    @property
    def groups(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads


class Decoder:
    """Runs a transformers ``*ForCausalLM`` (Llama family) one layer at a time."""

    def __init__(self, hf_model: Any, compile: bool = False, pack: bool = True, onednn: bool | None = None,
                 native_attention: bool | None = None) -> None:
        """``hf_model``: a transformers ``*ForCausalLM`` (typed loosely: its submodules are
        reached by name).  Where the layers have the plain Llama shape (SiLU gating, no MLP
        biases): ``pack`` re-lays the projection weights for fast one-row products
        (:mod:`.packed`; the HF model is re-pointed at the packed tensors, no copy is kept),
        and ``compile`` runs RMSNorm, RoPE and the output projection + MLP through
        ``torch.compile`` (:mod:`.kernels`); ``onednn`` (packed, not compiled) runs every
        product on weights reordered for oneDNN (:mod:`.onednn`), which then replace the
        packed ones: ``hf_model``'s own forward no longer runs; None: only where oneDNN
        multiplies one row faster than MKL on this CPU (:func:`.onednn.faster_one_row`).
        Otherwise transformers' modules run as they are, their products through oneDNN on
        their own weights unless ``onednn`` is False (:func:`.onednn.in_place_products`).
        ``native_attention``: decode steps, and float32 prefill, attend through our compiled
        kernels (:mod:`cacheblend.native`), and the layers' RMSNorm, RoPE and SiLU gate run
        through its layer pieces; None: where they build and fit the model; True: required
        (an error where they cannot)."""
        cfg = hf_model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {cfg.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        inner = hf_model.model
        self.hf_model = hf_model.eval()
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers
        self.final_norm = inner.norm
        self.lm_head = hf_model.lm_head
        self.rotary = inner.rotary_emb
        attn0 = self.layers[0].self_attn
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers
        windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
        self.shape = ModelShape(
            model_type=cfg.model_type,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            max_positions=cfg.max_position_embeddings,
            windows=windows,
            dtype=self.embed_tokens.weight.dtype,
        )
        self.scaling: float = float(getattr(attn0, "scaling", head_dim**-0.5))
        self.has_qk_norm = hasattr(attn0, "q_norm")
        self._q_width = self.shape.num_heads * head_dim  # queries' columns in a packed q/k/v
        plain = getattr(cfg, "hidden_act", None) in ("silu", "swish") and _plain_layers(self.layers)
        packs = pack and plain and packing_pays(self.shape.dtype)
        self.packed: PackedWeights | None = PackedWeights.pack(hf_model) if packs else None
        self.kernels = Kernels(compile and self.packed is not None)
        self.dnn: OneDnnWeights | None = None
        if onednn is not False and self.packed is not None and not self.kernels.compiled:
            self.dnn = OneDnnWeights.reorder(self.packed, self._q_width)
            if self.dnn is not None and onednn is None:  # the faster one-row products on this CPU
                self.dnn = self.dnn if _measured_choice(self.packed, self.dnn) else None
            if self.dnn is not None:  # one copy of the weights: the reordered one
                release(hf_model, head=self.dnn.head is not None)
                self.packed = None
                give_back_freed_memory()
        self._modules = self.packed is None and self.dnn is None  # transformers' projections run as they are
        # ... their weights as they are; the products through oneDNN where it runs on them (no copy)
        self._in_place = self._modules and onednn is not False and in_place_products(hf_model)
        self._plain = plain  # then the norms and the SiLU gate still run through self.kernels
        self.external: ExternalProducts | None = None  # another engine's weights (adopt)
        self._pending_q: tuple[int, Tensor, Tensor] | None = None  # (layer, x, queries) of its last q/k/v
        inter = getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size
        row_bytes = 2 * inter * self.shape.dtype.itemsize  # the gate and up products of one row
        self.row_tile: int = max(_MIN_ROW_TILE, _TILE_BYTES // row_bytes)
        # our attention kernels (cacheblend.native): decode steps, and float32 prefill by position
        self.decode_attention: native.DecodeAttention | None = None
        self.prefill_attention: native.PositionalAttention | None = None
        # on the CPU only: the kernels read their tensors' memory directly, so a GPU tensor's
        # pointer would be read on the host (a crash, not a fallback)
        on_cpu = next(hf_model.parameters()).device.type == "cpu"
        if native_attention is not False and on_cpu and native.fits(self.shape.dtype, head_dim):
            self.decode_attention = native.decode_attention()
            if self.shape.dtype == torch.float32:
                self.prefill_attention = native.positional_attention()
            ops = native.layer_ops()
            if ops is not None:  # and the layer's RMSNorm, RoPE and SiLU gate
                self.kernels.use_native(ops)
        if native_attention and self.decode_attention is None:
            why = "the model is not on the CPU" if not on_cpu else native.last_failure() or \
                f"they take float32 or bfloat16 with head_dim {native.HEAD_DIMS}"
            raise CacheBlendError(f"native_attention=True, but the native attention kernels cannot run: {why}")

    @property
    def products(self) -> str:
        """What the projections run on: "oneDNN" (reordered weights), "MKL" (packed weights,
        ``x @ W``), "oneDNN in place" (transformers' own weights) or "transformers" (its modules)."""
        if self.external is not None:
            return self.external.name
        if self._modules:
            return "oneDNN in place" if self._in_place else "transformers"
        return "oneDNN" if self.dnn is not None else "MKL"

    @property
    def attention(self) -> str:
        """What attention runs on: "native" (:mod:`cacheblend.native`: decode steps, and the
        prefill in float32) or "PyTorch"."""
        return "native" if self.decode_attention is not None else "PyTorch"

    def adopt(self, products: ExternalProducts) -> None:
        """Run the embedding, every projection and the head through ``products`` from now on
        (:mod:`.external`).  Why: the vLLM connector's worker then recomputes on the weights
        vLLM has loaded, not on a second copy; transformers' weights stay untouched pages
        of the mapped file.  The decoder computes what lies between the products, so the
        layers must have the plain Llama shape (RMSNorms, a SiLU-gated MLP without biases)."""
        if not self._plain:
            raise CacheBlendError("external products need the plain Llama layer shape "
                                  "(RMSNorms, a SiLU-gated MLP without biases)")
        self.external = products
        self._pending_q = None

    # -- positions -------------------------------------------------------------------
    def rope_tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos/sin [n, head_dim] for absolute ``positions``, via the model's own rotary module
        (so every RoPE scaling type transformers implements applies unchanged)."""
        probe = self.embed_tokens.weight[:1]
        cos, sin = self.rotary(probe, positions[None, :])
        return cos[0], sin[0]

    # -- one layer, split where the fusor needs to step in ---------------------------
    def embed(self, token_ids: Tensor) -> Tensor:
        return self.embed_tokens(token_ids) if self.external is None else self.external.embed(token_ids)

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """:func:`apply_rope`, compiled when the decoder is."""
        return self.kernels.rope(x, cos, sin)

    def rope_into(self, out: Tensor, x: Tensor, cos: Tensor, sin: Tensor) -> None:
        """:meth:`rope` written into ``out`` (the fused cache), without temporaries when eager."""
        self.kernels.rope_into(out, x, cos, sin)

    def reposition(self, kv_k: Tensor, kv_v: Tensor, starts: list[int], cached: list[tuple[Tensor, Tensor]],
                   shifts: list[Shift], cos: Tensor, sin: Tensor) -> None:
        """One layer's reused chunk K/V into the fused cache (:func:`kernels.reposition`):
        one native call for every span where the kernels run."""
        self.kernels.reposition(kv_k, kv_v, starts, cached, shifts, cos, sin)

    def attn_input(self, layer: int, h: Tensor) -> Tensor:
        norm = self.layers[layer].input_layernorm
        if not self._plain:
            return norm(h)
        return self.kernels.norm(h, norm.weight, norm.variance_epsilon)

    def queries(self, layer: int, x: Tensor) -> Tensor:
        """Queries [H, n, hd] (before RoPE) of normalized hidden states ``x`` [n, d]."""
        attn = self.layers[layer].self_attn
        if self.external is not None:
            return self._q_heads(attn, self._external_q(layer, x))
        q = self._linear(attn.q_proj, x) if self._modules else self._project(layer, x, 0, self._q_width)
        return self._q_heads(attn, q)

    def keys_values(self, layer: int, x: Tensor) -> tuple[Tensor, Tensor]:
        """Keys (before RoPE) and values, each [KVH, n, hd]."""
        attn = self.layers[layer].self_attn
        if self.external is not None:  # one q/k/v product: its queries wait for queries() of the same rows
            out = self.external.qkv(layer, x)
            self._pending_q = (layer, x, out[:, : self._q_width])
            k, v = out[:, self._q_width :].chunk(2, dim=-1)
            return self._kv_heads(attn, k, v)
        if self._modules:
            return self._kv_heads(attn, self._linear(attn.k_proj, x), self._linear(attn.v_proj, x))
        k, v = self._project(layer, x, self._q_width, None).chunk(2, dim=-1)
        return self._kv_heads(attn, k, v)

    def qkv(self, layer: int, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Query, key (pre-RoPE) and value of hidden states ``h`` [n, d] at ``layer`` (one
        product when the weights are packed: a decode step's three become one)."""
        x = self.attn_input(layer, h)
        if self._modules or self.external is not None:  # keys first: external products give queries with them
            k, v = self.keys_values(layer, x)
            return self.queries(layer, x), k, v
        attn = self.layers[layer].self_attn
        kv_width = self.shape.num_kv_heads * self.shape.head_dim
        q, k, v = self._project(layer, x, 0, None).split([self._q_width, kv_width, kv_width], dim=-1)
        return (self._q_heads(attn, q), *self._kv_heads(attn, k, v))

    def qkv_rope(self, layer: int, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`qkv` with queries and keys rotated (``cos``/``sin`` [n, hd]), in one RoPE
        over both where the projection is packed and the family has no per-head norm: a
        decode step's queries and keys are adjacent columns of one product, and one
        rotation of the [H + KVH] heads is six ops fewer per layer.  Same bits either way."""
        if self._modules or self.has_qk_norm or self.external is not None:
            q, k, v = self.qkv(layer, h)
            return self.rope(q, cos, sin), self.rope(k, cos, sin), v
        s, n = self.shape, h.shape[0]
        out = self._project(layer, self.attn_input(layer, h), 0, None)
        heads = s.num_heads + s.num_kv_heads
        qk = self.rope(out[:, : heads * s.head_dim].view(n, heads, s.head_dim).transpose(0, 1), cos, sin)
        v = out[:, heads * s.head_dim :].view(n, s.num_kv_heads, s.head_dim).transpose(0, 1)
        return qk[: s.num_heads], qk[s.num_heads :], v

    def _external_q(self, layer: int, x: Tensor) -> Tensor:
        """Queries of ``x`` through the external q/k/v product: those :meth:`keys_values`
        computed with the keys when ``x`` is the same tensor (the fusor asks for keys and
        queries of the same rows at every layer but a check layer), else a product of their own."""
        assert self.external is not None
        pending = self._pending_q
        if pending is not None and pending[0] == layer and pending[1] is x:
            self._pending_q = None
            return pending[2]
        return self.external.qkv(layer, x)[:, : self._q_width]

    # -- the projections' outputs as heads -------------------------------------------
    def _q_heads(self, attn: Any, q: Tensor) -> Tensor:
        """[n, H·hd] -> [H, n, hd], through the per-head norm where the family has one."""
        q = q.view(q.shape[0], self.shape.num_heads, self.shape.head_dim)
        if self.has_qk_norm:
            q = attn.q_norm(q)
        return q.transpose(0, 1)

    def _kv_heads(self, attn: Any, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """[n, KVH·hd] each -> [KVH, n, hd] each (keys through the per-head norm, if any)."""
        n, s = k.shape[0], self.shape
        k = k.view(n, s.num_kv_heads, s.head_dim)
        v = v.view(n, s.num_kv_heads, s.head_dim)
        if self.has_qk_norm:
            k = attn.k_norm(k)
        return k.transpose(0, 1), v.transpose(0, 1)

    def _project(self, layer: int, x: Tensor, start: int, end: int | None) -> Tensor:
        """Columns ``start:end`` of ``x`` times the layer's packed q/k/v weight (and bias)."""
        if self.dnn is not None:  # the three column ranges the callers take, each reordered
            d = self.dnn.layers[layer]
            w = d.qkv if end is None and start == 0 else d.q if start == 0 else d.kv
            return linear(x, w, None if d.qkv_bias is None else d.qkv_bias[start:end])
        assert self.packed is not None
        p = self.packed.layers[layer]
        w = p.qkv[:, start:end]
        if p.qkv_bias is None:
            return x @ w
        return torch.addmm(p.qkv_bias[start:end], x, w)

    def finish(self, layer: int, h: Tensor, attn_out: Tensor) -> Tensor:
        """Output projection, residuals and MLP. ``attn_out`` is [H, n, hd].

        More than :attr:`row_tile` rows run a tile of rows at a time.  Why: the gated MLP's
        widest temporary is n × 2·intermediate (46 MB for a 3.7K-token SmolLM2 prompt), above
        glibc's 32 MB mmap ceiling, so untiled every layer maps fresh pages and faults on each
        first write, and the SiLU gating streams it through memory; tiles of at most 8 MB are
        served from the heap again and again and stay in the last-level cache.  Every row's
        arithmetic is the same, so the tiles change no result (docs/internals/latency.md)."""
        n = h.shape[0]
        attn = attn_out.transpose(0, 1).reshape(n, -1)
        step = self.row_tile
        if n <= step:
            return self._finish_rows(layer, h, attn)
        out = torch.empty_like(h)
        for i in range(0, n, step):
            out[i : i + step] = self._finish_rows(layer, h[i : i + step], attn[i : i + step])
        return out

    def _linear(self, module: Any, x: Tensor) -> Tensor:
        """One of transformers' projections (``nn.Linear``) of ``x``: through oneDNN on the
        module's own weight where :func:`.onednn.in_place_products` said it can, else the module."""
        return linear(x, module.weight, module.bias) if self._in_place else module(x)

    def _finish_rows(self, layer: int, h: Tensor, attn: Tensor) -> Tensor:
        """:meth:`finish` of ``h`` [n, d] with the attention output ``attn`` [n, H·hd]."""
        blk = self.layers[layer]
        if self.external is not None:
            o, gate_up, down = self.external.layer(layer)
            norm = blk.post_attention_layernorm
            return finish(h, attn, o, None, norm.weight, norm.variance_epsilon, gate_up, down, self.external.mm,
                          self.kernels.norm, self.kernels.act)
        if self.dnn is not None:
            d, norm = self.dnn.layers[layer], blk.post_attention_layernorm
            return finish(h, attn, d.o, d.o_bias, norm.weight, norm.variance_epsilon, d.gate_up, d.down, linear,
                          self.kernels.norm, self.kernels.act)
        if self.packed is not None:
            p, norm = self.packed.layers[layer], blk.post_attention_layernorm
            return self.kernels.finish(h, attn, p.o, p.o_bias, norm.weight, norm.variance_epsilon,
                                       p.gate_up, p.down)
        h = h + self._linear(blk.self_attn.o_proj, attn)
        if not self._plain:
            return h + blk.mlp(blk.post_attention_layernorm(h))
        # transformers' Llama MLP (the same products and bits), with our norm and gate
        mlp, norm = blk.mlp, blk.post_attention_layernorm
        x = self.kernels.norm(h, norm.weight, norm.variance_epsilon)
        return h + self._linear(mlp.down_proj, self.kernels.act(self._linear(mlp.gate_proj, x),
                                                                 self._linear(mlp.up_proj, x)))

    def logits(self, h: Tensor) -> Tensor:
        if self.external is not None:
            return self.external.head(self._final(h)).float()
        if self.dnn is not None and self.dnn.head is not None:
            return linear(self._final(h), self.dnn.head).float()
        if self.packed is not None and self.packed.head is not None:
            return (self._final(h) @ self.packed.head).float()
        return self._linear(self.lm_head, self.final_norm(h)).float()

    def _final(self, h: Tensor) -> Tensor:
        """The final RMSNorm through the kernel (packed layers have the plain norm shape)."""
        return self.kernels.norm(h, self.final_norm.weight, self.final_norm.variance_epsilon)


# The measured choice per weight layout (dtype and shapes), once per process: every engine on
# the same model then computes the same bits, whatever the machine's noise did to a timing.
_CHOICES: dict[tuple, bool] = {}


def _measured_choice(packed: PackedWeights, dnn: OneDnnWeights) -> bool:
    """Whether oneDNN's products are kept (:func:`.onednn.faster_one_row`), measured once."""
    key = (packed.layers[0].qkv.dtype, len(packed.layers), *(tuple(t.shape) for t in packed.tensors()[:6]))
    if key not in _CHOICES:
        keep, mkl, onednn = faster_one_row(packed, dnn)
        log.info("cacheblend: one-row products %.1f ms through MKL, %.1f ms through oneDNN: %s",
                 1e3 * mkl, 1e3 * onednn, "oneDNN" if keep else "MKL")
        _CHOICES[key] = keep
    return _CHOICES[key]


def _plain_layers(layers: Any) -> bool:
    """Whether every layer has the shape :func:`.kernels.finish` computes: RMSNorms with a
    ``variance_epsilon``, a gated MLP without biases (the caller checks the activation)."""
    for blk in layers:
        mlp = blk.mlp
        parts = (getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None), getattr(mlp, "down_proj", None))
        if any(p is None or p.bias is not None for p in parts):
            return False
        norms = (blk.input_layernorm, blk.post_attention_layernorm)
        if not all(hasattr(n, "variance_epsilon") and hasattr(n, "weight") for n in norms):
            return False
    return True
