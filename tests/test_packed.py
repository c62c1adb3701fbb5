"""Packed projection weights (``models/packed.py``): fused, stored ``[in, out]`` for fast
one-row products.  Packing must change no numbers beyond float reordering, keep the HF
model working on the same weights, keep a tied head tied, and cost no memory."""

from __future__ import annotations

import pytest
import torch

from cacheblend.models.decoder import Decoder
from cacheblend.models.loader import load_model
from conftest import PASSAGES, QUERY, make_tiny_model

pytestmark = pytest.mark.slow


def _storage_bytes(model) -> int:
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


@pytest.fixture(scope="module", params=[("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)],
                ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}")
def pair(request, tmp_path_factory, default_model_dir):
    """The same tiny model loaded twice: one decoder packs, one runs transformers' modules."""
    family, tie = request.param
    folder = make_tiny_model(tmp_path_factory.mktemp(family), family, default_model_dir, tie=tie)
    return load_model(folder), load_model(folder), tie


def _ids(loaded):
    text = "\n".join(PASSAGES) + "\n" + QUERY
    return torch.tensor([loaded.tokenizer(text)["input_ids"][:200]])


def test_packing_keeps_the_hf_model_and_its_memory(pair):
    packed_model, plain_model, tie = pair
    ids = _ids(packed_model)
    with torch.inference_mode():
        before = packed_model.model(ids).logits
    bytes_before = _storage_bytes(packed_model.model)
    dec = Decoder(packed_model.model, pack=True, onednn=False)
    assert dec.packed is not None and dec.packed.head is not None
    assert _storage_bytes(packed_model.model) == bytes_before  # the packed tensors replace the originals
    head, embed = packed_model.model.lm_head, packed_model.model.model.embed_tokens
    assert (head.weight is embed.weight) == tie
    with torch.inference_mode():
        torch.testing.assert_close(packed_model.model(ids).logits, before, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(embed(ids[0]), plain_model.model.model.embed_tokens(ids[0]), atol=0, rtol=0)


def test_packed_decoder_matches_the_module_decoder(pair):
    """Layer by layer and through the head, on a prompt and on one row (a decode step)."""
    packed_model, plain_model, _ = pair
    packed = Decoder(packed_model.model, pack=True, onednn=False)
    plain = Decoder(plain_model.model, pack=False, onednn=False)
    assert packed.packed is not None and plain.packed is None
    ids = _ids(packed_model)[0]
    with torch.inference_mode():
        for rows in (ids, ids[-1:]):
            h1, h2 = packed.embed(rows), plain.embed(rows)
            for layer in range(packed.shape.num_layers):
                q1, k1, v1 = packed.qkv(layer, h1)
                q2, k2, v2 = plain.qkv(layer, h2)
                x = packed.attn_input(layer, h1)
                for a, b in ((q1, q2), (k1, k2), (v1, v2), (packed.queries(layer, x), q2),
                             (packed.keys_values(layer, x)[0], k2), (packed.keys_values(layer, x)[1], v2)):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
                h1, h2 = packed.finish(layer, h1, q1), plain.finish(layer, h2, q2)  # q as a stand-in for attention
                torch.testing.assert_close(h1, h2, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(packed.logits(h1), plain.logits(h2), atol=1e-4, rtol=1e-4)


def test_in_place_products_match_the_modules_and_copy_nothing(pair):
    """Unpacked weights (the vLLM worker's, views of the mapped file): the products run
    through oneDNN on transformers' own weights.  Layer by layer, on a prompt and on one row,
    and through the head they give the modules' results; no weight is copied or moved; the
    HF model still runs; ``onednn=False`` keeps the modules' own products."""
    _, plain_model, _ = pair
    model = plain_model.model
    ptrs, bytes_before = [p.data_ptr() for p in model.parameters()], _storage_bytes(model)
    in_place, modules = Decoder(model, pack=False), Decoder(model, pack=False, onednn=False)
    assert (in_place.products, modules.products) == ("oneDNN in place", "transformers")
    assert [p.data_ptr() for p in model.parameters()] == ptrs and _storage_bytes(model) == bytes_before
    ids = _ids(plain_model)[0]
    with torch.inference_mode():
        model(ids[None])
        for rows in (ids, ids[-1:]):
            h1, h2 = in_place.embed(rows), modules.embed(rows)
            for layer in range(in_place.shape.num_layers):
                (q1, k1, v1), (q2, k2, v2) = in_place.qkv(layer, h1), modules.qkv(layer, h2)
                for a, b in ((q1, q2), (k1, k2), (v1, v2)):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
                h1, h2 = in_place.finish(layer, h1, q1), modules.finish(layer, h2, q2)
                torch.testing.assert_close(h1, h2, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(in_place.logits(h1), modules.logits(h2), atol=1e-4, rtol=1e-4)


def test_row_tiles_change_no_result(pair):
    """Long prompts run the output projection and MLP a tile of rows at a time (their widest
    temporary would otherwise be mapped afresh every layer); the tiles, an uneven last one
    included, give each row the result of one untiled product."""
    for model, pack in ((pair[0], True), (pair[1], False)):
        dec = Decoder(model.model, pack=pack, onednn=False)
        assert dec.row_tile >= 256
        ids = _ids(model)[0]
        with torch.inference_mode():
            h = dec.embed(ids)
            q, _, _ = dec.qkv(0, h)
            whole = dec.finish(0, h, q)
            dec.row_tile = 64  # 200 rows: tiles of 64, 64, 64 and 8
            torch.testing.assert_close(dec.finish(0, h, q), whole, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("family,tie", [("llama", True), ("qwen2", False)])
def test_onednn_weights_give_the_packed_products(tmp_path, default_model_dir, family, tie):
    """Every product on weights reordered for oneDNN (the default where the weights are packed
    float32): the same numbers as the ``[in, out]`` products up to float reordering, layer by
    layer, in row tiles and through the head, for a prompt and for one row (qwen2: q/k/v
    biases).  The reordered copy is then the only one: transformers' projections are released
    (its forward raises, never computes zeros from meta weights), a tied embedding keeps a
    table of its own."""
    folder = make_tiny_model(tmp_path / family, family, default_model_dir, tie=tie)
    fast_model, plain_model = load_model(folder), load_model(folder)
    fast = Decoder(fast_model.model, pack=True, onednn=True)
    plain = Decoder(plain_model.model, pack=True, onednn=False)
    assert fast.dnn is not None and fast.packed is None and plain.dnn is None
    blk, hf = fast_model.model.model.layers[0], fast_model.model
    assert blk.self_attn.q_proj.weight.is_meta and blk.mlp.down_proj.weight.is_meta and hf.lm_head.weight.is_meta
    assert not hf.model.embed_tokens.weight.is_meta and not blk.input_layernorm.weight.is_meta
    ids = _ids(fast_model)[0]
    with torch.inference_mode():
        torch.testing.assert_close(fast.embed(ids), plain.embed(ids), atol=0, rtol=0)
        with pytest.raises(RuntimeError, match="reordered for oneDNN .* onednn_weights=False"):
            fast_model.model(ids[None])
        fast.row_tile = plain.row_tile = 64
        for rows in (ids, ids[-1:]):
            h1, h2 = fast.embed(rows), plain.embed(rows)
            for layer in range(fast.shape.num_layers):
                x = fast.attn_input(layer, h1)
                for a, b in zip((*fast.qkv(layer, h1), fast.queries(layer, x), *fast.keys_values(layer, x)),
                                (*plain.qkv(layer, h2), plain.queries(layer, x), *plain.keys_values(layer, x)),
                                strict=True):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
                q1, q2 = fast.qkv(layer, h1)[0], plain.qkv(layer, h2)[0]
                h1, h2 = fast.finish(layer, h1, q1), plain.finish(layer, h2, q2)
                torch.testing.assert_close(h1, h2, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(fast.logits(h1), plain.logits(h2), atol=1e-4, rtol=1e-4)


def test_onednn_weights_are_an_engine_setting(tmp_path, default_model_dir):
    """On, off, or (the default) measured at load; with ``compile`` (whose graphs take plain
    tensors) the products run on the packed weights; greedy answers are the same either way;
    the choice is named in ``Decoder.products``; a non-bool is refused."""
    from cacheblend import Engine
    from cacheblend.errors import CacheBlendError

    folder = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    on, off = Engine.load(folder, store="memory", onednn_weights=True), \
        Engine.load(folder, store="memory", onednn_weights=False)
    assert on.decoder.dnn is not None and off.decoder.dnn is None
    assert (on.decoder.products, off.decoder.products) == ("oneDNN", "MKL")
    measured = Engine.load(folder, store="memory").decoder
    assert measured.products in ("oneDNN", "MKL") and (measured.dnn is None) == (measured.packed is not None)
    assert Engine.load(folder, store="memory", compile=True).decoder.dnn is None
    assert on.generate(QUERY, PASSAGES, max_new_tokens=8).token_ids == \
        off.generate(QUERY, PASSAGES, max_new_tokens=8).token_ids
    with pytest.raises(CacheBlendError, match="onednn_weights must be True or False"):
        Engine.load(folder, store="memory", onednn_weights=1)


@pytest.mark.parametrize("mkl,onednn,keep", [(2.0, 1.0, True), (1.0, 2.0, False), (0.97, 1.0, True), (0.9, 1.0, False)])
def test_the_measured_choice_keeps_onednn_unless_mkl_is_clearly_faster(pair, mkl, onednn, keep):
    """``faster_one_row`` times both layouts' one-row passes, alternating, and keeps oneDNN
    on a tie (within 5 %): a noisy machine must not flip the choice from run to run.  The
    clock is scripted so the decision, not this machine's speed, is what is tested."""
    from cacheblend.models.onednn import OneDnnWeights, faster_one_row

    packed_model, _, _ = pair
    dec = Decoder(packed_model.model, onednn=False)
    assert dec.packed is not None
    dnn = OneDnnWeights.reorder(dec.packed, dec.shape.num_heads * dec.shape.head_dim)
    if dnn is None:
        pytest.skip("no oneDNN in this PyTorch")
    order = ["mkl", "onednn", "onednn", "mkl", "mkl", "onednn"]  # rounds alternate which goes first
    ticks, now = [], 0.0
    for name in order:
        ticks += [now, now + (mkl if name == "mkl" else onednn)]
        now += 10.0
    clock = iter(ticks)
    kept, t_mkl, t_onednn = faster_one_row(dec.packed, dnn, rounds=3, clock=lambda: next(clock))
    assert kept == keep and t_mkl == pytest.approx(mkl) and t_onednn == pytest.approx(onednn)


def test_pack_weights_is_an_engine_setting(tmp_path, default_model_dir):
    """Off (the vLLM connector's worker, whose weights must stay views of the mapped file),
    the decoder runs transformers' modules; a non-bool is refused by name."""
    from cacheblend import Engine
    from cacheblend.errors import CacheBlendError

    folder = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    off = Engine.load(folder, store="memory", pack_weights=False).decoder
    assert off.packed is None and off.dnn is None
    assert Engine.load(folder, store="memory", onednn_weights=False).decoder.packed is not None
    with pytest.raises(CacheBlendError, match="pack_weights must be True or False"):
        Engine.load(folder, store="memory", pack_weights="no")


@pytest.mark.parametrize("native_bf16", [True, False])
def test_bfloat16_weights_stay_unpacked_where_the_cpu_has_no_bf16_products(tmp_path, default_model_dir,
                                                                            monkeypatch, native_bf16):
    """On an AVX2 CPU ATen's fallback gemm ran the packed bf16 products (``x @ W``, W
    ``[in, out]``) about 12x slower than ``F.linear`` on transformers' own ``[out, in]``
    weights: a 680-token bf16 prefill took 84 s against 10 s unpacked.  float32 packs on any CPU."""
    from cacheblend import Engine
    from cacheblend.models import packed

    monkeypatch.setattr(packed, "bf16_products_native", lambda: native_bf16)
    folder = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    bf16 = Engine.load(folder, store="memory", dtype="bfloat16", onednn_weights=False).decoder
    assert (bf16.packed is not None) is native_bf16
    assert Engine.load(folder, store="memory", onednn_weights=False).decoder.packed is not None


def test_packing_lets_go_of_the_loaders_memory_map(tmp_path, default_model_dir):
    """transformers maps the safetensors file and its weights are views of the map; after
    packing nothing may still point into it, or the pages packing read stay resident too
    (the process would hold the weights twice).  A bug fixed: norms kept the map alive."""
    import gc

    folder = make_tiny_model(tmp_path / "m", "llama", default_model_dir, tie=True)
    loaded = load_model(folder)

    def mapped() -> bool:
        with open("/proc/self/maps") as maps:
            return any(str(folder) in line for line in maps)

    assert mapped(), "expected transformers to memory-map the weights file"
    Decoder(loaded.model, pack=True)
    gc.collect()
    assert not mapped()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_kernel_gives_transformers_bits(dtype):
    """The fused RMSNorm replaces transformers' module on packed layers: it must give the
    very same bits, or greedy answers could part from transformers' own."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from cacheblend.models.kernels import rms_norm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    for rows in (1, 333):
        x = (3 * torch.randn(rows, 96)).to(dtype)
        assert torch.equal(rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))


def test_queries_and_keys_rotated_together_equal_each_rotated_alone(pair):
    """A decode step rotates queries and keys in one RoPE (``Decoder.qkv_rope``); the bits
    must be those of rotating each alone, for families with a per-head norm too."""
    packed_model, _, _ = pair
    dec = Decoder(packed_model.model)
    ids = _ids(packed_model)[0]
    with torch.inference_mode():
        for rows in (ids, ids[-1:]):
            cos, sin = dec.rope_tables(torch.arange(rows.numel()) + 7)
            h = dec.embed(rows)
            for layer in range(dec.shape.num_layers):
                q, k, v = dec.qkv(layer, h)
                q2, k2, v2 = dec.qkv_rope(layer, h, cos, sin)
                assert torch.equal(dec.rope(q, cos, sin), q2) and torch.equal(dec.rope(k, cos, sin), k2)
                assert torch.equal(v, v2)
                h = dec.finish(layer, h, q)


def test_onednn_agreement_checks_see_a_product_that_reads_its_input_out_of_order(pair, monkeypatch):
    """The start-up checks of oneDNN's products multiplied an all-ones row by the first
    layer's weight: every output was a weight row's sum, so a product reading its input in
    another order (a permuted or transposed weight) passed.  Random rows on a layer's
    products and the head catch it; the products are then not used."""
    from cacheblend.models import onednn

    packed_model, plain_model, _ = pair
    packed = Decoder(packed_model.model, pack=True, onednn=False)
    q_width = packed.shape.num_heads * packed.shape.head_dim
    assert onednn.OneDnnWeights.reorder(packed.packed, q_width) is not None
    assert onednn.in_place_products(plain_model.model)
    reorder, linear = onednn._reorder, onednn.linear  # noqa: SLF001 - a broken reorder, on purpose
    monkeypatch.setattr(onednn, "_reorder", lambda w: reorder(w.flip(0)))  # reads the input reversed
    assert onednn.OneDnnWeights.reorder(packed.packed, q_width) is None
    monkeypatch.setattr(onednn, "linear", lambda x, w, b=None: linear(x.flip(-1), w, b))
    assert not onednn.in_place_products(plain_model.model)
