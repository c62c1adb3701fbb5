"""Products from weights the decoder does not own: a second weight source.

The core decoder normally multiplies by transformers' weights (packed and reordered for
oneDNN, or as they are).  A serving engine that has already loaded the model holds a
second copy of every projection, often in a layout of its own that no tensor view can
reach: vLLM's CPU backend packs each linear layer for oneDNN and keeps the packed weight
only inside the layer's closure (docs/internals/vllm-connector.md).  So rather than read
another engine's weights, the decoder can *call* its layers: :meth:`.Decoder.adopt` takes
an :class:`ExternalProducts` and from then on runs the embedding, every projection and the
output head through it.  The norms, RoPE, the SiLU gate and attention stay the decoder's
own (their weights are a few kilobytes), so the arithmetic between products is unchanged.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

__all__ = ["ExternalProducts"]


class ExternalProducts(Protocol):
    """The weight-bearing steps of a Llama-family layer stack, computed elsewhere.

    Shapes follow the decoder's: ``x`` is ``[n, d]`` (normalized hidden states).
    ``qkv`` returns queries, keys (before RoPE) and values side by side,
    ``[n, (H + 2·KVH)·hd]``, biases included; :meth:`layer` gives the output projection,
    the fused gate + up projection (gate first) and the down projection of one layer as
    opaque handles for :meth:`mm`."""

    name: str  # what the products run on, for logs and ``Decoder.products``

    def embed(self, token_ids: Tensor) -> Tensor: ...

    def qkv(self, layer: int, x: Tensor) -> Tensor: ...

    def layer(self, layer: int) -> tuple[Any, Any, Any]: ...

    def mm(self, x: Tensor, handle: Any) -> Tensor: ...

    def head(self, x: Tensor) -> Tensor:
        """Logits of final-normed hidden states ``x``."""
        ...
