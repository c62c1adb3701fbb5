"""vLLM's own model for the connector's worker: the recompute runs on vLLM's weights.

vLLM 0.32 gives a KV connector its caches and attention layers, not the model
(docs/internals/vllm-connector.md), and on CPU it keeps no plain weight to take a view
of: each linear layer's weight is packed for oneDNN and held inside the layer.  What
vLLM does offer, publicly, is a registry of model loaders (``register_model_loader``)
and general plugins (the ``vllm.general_plugins`` entry point, run in every vLLM
process).  cacheblend-core's plugin, :func:`register`, adds :class:`CacheBlendModelLoader`
as ``load_format="cacheblend"``: vLLM's default loader, which also keeps a weak reference
to the model it loaded in this process.  The worker-side connector is built in the same
process after the model is loaded; :func:`adopt_vllm_weights` finds the model and hands
the core decoder :class:`VllmProducts` (:meth:`.Decoder.adopt`): the embedding, every
projection and the head then run through vLLM's own layers on vLLM's packed weights.
transformers' copy, which the core engine maps from the same safetensors file, is never
read, so its pages are never resident.  Without ``load_format="cacheblend"`` the worker
multiplies by that mapped copy, as it did before, and says so in its log (a
``VLLM_PLUGINS`` list without ``cacheblend`` leaves the format unknown: vLLM refuses it).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from typing import Any

from torch import Tensor, nn
from vllm.model_executor.model_loader import DefaultModelLoader, register_model_loader

from ..engine import Engine
from ..models.onednn import linear
from ..store.spec import hide_secrets
from .vllm_server import LOAD_FORMAT

__all__ = ["LOAD_FORMAT", "CacheBlendModelLoader", "VllmProducts", "adopt_vllm_weights", "loaded_model", "register",
           "worker_engine"]

log = logging.getLogger("vllm.cacheblend")

_loaded: list[weakref.ref[nn.Module]] = []  # the model this process's loader built (at most one)


class CacheBlendModelLoader(DefaultModelLoader):
    """vLLM's default loader ("auto" weight files) that remembers the model it loads."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(dataclasses.replace(load_config, load_format="auto"))

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
        model = super().load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        _loaded[:] = [weakref.ref(model)]
        return model


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make ``load_format="cacheblend"`` known
    in this process (vLLM may call it more than once)."""
    register_model_loader(LOAD_FORMAT)(CacheBlendModelLoader)


def loaded_model() -> nn.Module | None:
    """The model :class:`CacheBlendModelLoader` loaded in this process, if it is alive."""
    return _loaded[0]() if _loaded else None


@dataclasses.dataclass
class VllmProducts:
    """:class:`~cacheblend.models.external.ExternalProducts` over a loaded vLLM Llama-family
    model (one tensor-parallel rank): its ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and
    ``down_proj`` layers are called as vLLM's own forward calls them."""

    embed_tokens: nn.Module
    layers: list[tuple[Any, ...]]  # per layer: vLLM's qkv, o, gate_up and down modules
    head_weight: Tensor  # [vocab, d], the padding rows cut off
    name: str = "vLLM's own layers"

    @classmethod
    def of(cls, model: nn.Module, num_layers: int, qkv_width: int) -> VllmProducts:
        """The products of ``model``; ``ValueError`` says why a model does not fit (another
        layer structure, tensor parallelism, a layer count or q/k/v width the decoder does not have)."""
        inner: Any = getattr(model, "model", None)
        blocks = list(getattr(inner, "layers", []) or [])
        if len(blocks) != num_layers:
            raise ValueError(f"vLLM's model has {len(blocks)} decoder layers, the engine's {num_layers}")
        layers: list[tuple[Any, ...]] = []
        for blk in blocks:
            attn, mlp = getattr(blk, "self_attn", None), getattr(blk, "mlp", None)
            mods = tuple(getattr(m, n, None) for m, n in ((attn, "qkv_proj"), (attn, "o_proj"),
                                                          (mlp, "gate_up_proj"), (mlp, "down_proj")))
            if any(m is None for m in mods):
                raise ValueError(f"{type(blk).__name__} has no fused qkv_proj / o_proj / gate_up_proj / down_proj")
            if any(getattr(m, "tp_size", 1) != 1 for m in mods):
                raise ValueError("tensor parallelism: the layers hold one shard of each weight")
            layers.append(mods)
        width = getattr(layers[0][0], "output_size_per_partition", qkv_width)
        if width != qkv_width:
            raise ValueError(f"vLLM's qkv_proj has {width} outputs, the engine's q/k/v {qkv_width}")
        head = getattr(getattr(model, "lm_head", None), "weight", None)
        if not isinstance(head, Tensor) or head.dim() != 2 or head.numel() == 0:
            raise ValueError("vLLM's lm_head keeps no dense weight")
        vocab = getattr(model.lm_head, "org_vocab_size", head.shape[0])
        return cls(inner.embed_tokens, layers, head[:vocab])

    def embed(self, token_ids: Tensor) -> Tensor:
        return self.embed_tokens(token_ids)

    def qkv(self, layer: int, x: Tensor) -> Tensor:
        return self.mm(x, self.layers[layer][0])

    def layer(self, layer: int) -> tuple[Any, Any, Any]:
        return self.layers[layer][1:]

    def mm(self, x: Tensor, handle: Any) -> Tensor:
        out = handle(x)  # vLLM's linear layers return (output, bias to add) unless return_bias=False
        return out[0] if isinstance(out, tuple) else out

    def head(self, x: Tensor) -> Tensor:
        return linear(x, self.head_weight)


def adopt_vllm_weights(engine: Engine) -> str:
    """Point ``engine``'s decoder at the model vLLM loaded in this process, if any; what
    its products run on now, for the log."""
    model, dec = loaded_model(), engine.decoder
    if model is None:
        return (f"{dec.products} on a mapped copy of the weights (start vLLM with "
                f"load_format={LOAD_FORMAT!r} to recompute on vLLM's own)")
    s = dec.shape
    try:
        dec.adopt(VllmProducts.of(model, s.num_layers, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim))
    except (ValueError, RuntimeError) as e:
        return f"{dec.products} on a mapped copy of the weights (vLLM's model does not fit: {e})"
    return dec.products


def worker_engine(model_dir: str, store: str | None, dtype: Any, chunk_sink: str, kv_dtype: Any) -> Engine:
    """The core engine of the connector's worker, on vLLM's model folder and dtype:
    unpacked, so transformers' weights stay pages of the mapped safetensors file, and its
    products on vLLM's own layers where vLLM loaded the model with ours."""
    t = time.perf_counter()
    engine = Engine.load(model_dir, store=store, dtype=dtype, pack_weights=False, chunk_sink=chunk_sink,
                         kv_dtype=kv_dtype)
    log.info("CacheBlend engine loaded in %.1f s (store %s), products: %s", time.perf_counter() - t,
             hide_secrets(store) if store else store,
             adopt_vllm_weights(engine))
    return engine
