"""``Decoder.adopt``: the embedding, projections and head run through another engine's layers.

The vLLM connector's worker recomputes on the layers vLLM loaded (``cacheblend.integrations.
vllm_model``; tested end to end in tests/vllm_connector).  Here the other engine is
transformers' own weights fused the way vLLM fuses them (q/k/v in one product, gate and up
in another) and multiplied by ``F.linear``: the adopted decoder must give the answers of
the decoder on its own weights, keep the identities of the fused prefill, and run one q/k/v
product per layer, not one for keys and another for queries.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cacheblend import Engine
from conftest import PASSAGES, QUERY, make_tiny_model


class FusedLayers:
    """:class:`cacheblend.models.external.ExternalProducts` over transformers' weights, fused
    as vLLM fuses them, counting the q/k/v products."""

    name = "fused test layers"

    def __init__(self, hf) -> None:
        def fused(*mods):
            biases = [m.bias for m in mods]
            return (torch.cat([m.weight for m in mods]),
                    None if biases[0] is None else torch.cat(biases))

        self.layers = [(fused(b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj), fused(b.self_attn.o_proj),
                        fused(b.mlp.gate_proj, b.mlp.up_proj), fused(b.mlp.down_proj)) for b in hf.model.layers]
        self.embed_weight, self.head_weight = hf.model.embed_tokens.weight, hf.lm_head.weight
        self.qkv_calls = 0

    def embed(self, token_ids):
        return F.embedding(token_ids, self.embed_weight)

    def qkv(self, layer, x):
        self.qkv_calls += 1
        return self.mm(x, self.layers[layer][0])

    def layer(self, layer):
        return self.layers[layer][1:]

    def mm(self, x, weight_bias):
        return F.linear(x, *weight_bias)

    def head(self, x):
        return F.linear(x, self.head_weight)


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # qwen2: q/k/v biases
def engines(request, tmp_path_factory, default_model_dir):
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, default_model_dir)
    own = Engine.load(folder, store="memory", pack_weights=False)
    adopted = Engine.load(folder, store="memory", pack_weights=False)
    products = FusedLayers(adopted.decoder.hf_model)
    adopted.decoder.adopt(products)
    return own, adopted, products


def test_adopted_products_give_the_decoders_own_answers(engines):
    own, adopted, _ = engines
    assert adopted.decoder.products == "fused test layers"
    for opts in ({"method": "full"}, {"recompute_ratio": 0.15}, {"recompute_ratio": 0.0}):
        a = own.generate(QUERY, PASSAGES, max_new_tokens=8, **opts)
        b = adopted.generate(QUERY, PASSAGES, max_new_tokens=8, **opts)
        assert b.token_ids == a.token_ids, opts
        torch.testing.assert_close(b.first_token_logits, a.first_token_logits, atol=2e-4, rtol=1e-4)


def test_adopted_products_keep_the_identities(engines):
    _, adopted, _ = engines
    full = adopted.generate(QUERY, PASSAGES, max_new_tokens=8, method="full")
    whole = adopted.generate(QUERY, PASSAGES, max_new_tokens=8, recompute_ratio=1.0)
    assert whole.token_ids == full.token_ids
    torch.testing.assert_close(whole.first_token_logits, full.first_token_logits, atol=1e-5, rtol=1e-5)


def test_one_qkv_product_per_layer(engines):
    """Keys and queries of the same rows come from one product; only a layer whose rows
    shrink between them (a check layer, the last layer's single row) runs a second one."""
    _, adopted, products = engines
    layers = adopted.decoder.shape.num_layers
    for opts, extra in (({"method": "full"}, 1), ({"recompute_ratio": 0.15}, 2)):
        adopted.generate(QUERY, PASSAGES, max_new_tokens=1, **opts)  # the chunks' and the prefix's own prefills
        products.qkv_calls = 0
        adopted.generate(QUERY, PASSAGES, max_new_tokens=1, **opts)
        assert products.qkv_calls == layers + extra, opts


def test_a_packed_decoder_adopts_them_too(tmp_path, default_model_dir):
    """On a decoder whose own weights are packed and reordered, every path (the prefill's
    products and the decode step's fused q/k/v + RoPE) goes through the adopted products."""
    from cacheblend.models.loader import load_model

    folder = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    own = Engine.load(folder, store="memory")
    adopted = Engine.load(folder, store="memory")
    products = FusedLayers(load_model(folder).model.eval())
    adopted.decoder.adopt(products)
    a = own.generate(QUERY, PASSAGES, max_new_tokens=8, recompute_ratio=0.15)
    b = adopted.generate(QUERY, PASSAGES, max_new_tokens=8, recompute_ratio=0.15)
    assert b.token_ids == a.token_ids
    products.qkv_calls = 0
    adopted.generate(QUERY, PASSAGES, max_new_tokens=4, method="full")
    assert products.qkv_calls == adopted.decoder.shape.num_layers * (1 + 3) + 1  # prefill, then 3 decode steps
