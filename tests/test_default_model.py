"""Identities on the real default model (SmolLM2-135M-Instruct), float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from cacheblend import Engine
from conftest import PASSAGES, QUERY, reference_model

pytestmark = pytest.mark.slow
GEN = dict(max_new_tokens=16)


def test_full_equals_transformers_generate(default_engine):
    handles = default_engine.ingest(PASSAGES)
    full = default_engine.generate(QUERY, handles, method="full", **GEN)
    ids = torch.tensor([default_engine.prompts.build(QUERY, [list(h.token_ids) for h in handles], None).all_ids])
    with torch.inference_mode():
        out = reference_model(default_engine).generate(ids, max_new_tokens=GEN["max_new_tokens"], do_sample=False)
    ref = [t for t in out[0, ids.shape[1]:].tolist() if t not in default_engine.eos_ids]
    assert full.token_ids == ref
    assert full.text.strip()


def test_blend_one_equals_full_and_zero_equals_reuse(default_engine):
    handles = default_engine.ingest(PASSAGES)
    full = default_engine.generate(QUERY, handles, method="full", **GEN)
    b1 = default_engine.generate(QUERY, handles, method="blend", recompute_ratio=1.0, **GEN)
    torch.testing.assert_close(b1.first_token_logits, full.first_token_logits, atol=1e-3, rtol=1e-3)
    assert b1.token_ids == full.token_ids
    reuse = default_engine.generate(QUERY, handles, method="reuse", **GEN)
    b0 = default_engine.generate(QUERY, handles, method="blend", recompute_ratio=0.0, **GEN)
    assert b0.token_ids == reuse.token_ids
    assert torch.equal(b0.first_token_logits, reuse.first_token_logits)


def test_prefix_one_chunk_equals_full(default_engine):
    handles = default_engine.ingest(PASSAGES[:1])
    full = default_engine.generate(QUERY, handles, method="full", **GEN)
    prefix = default_engine.generate(QUERY, handles, method="prefix", **GEN)
    assert prefix.token_ids == full.token_ids
    torch.testing.assert_close(prefix.first_token_logits, full.first_token_logits, atol=1e-3, rtol=1e-3)


def test_blend_is_closer_to_full_than_reuse(default_engine):
    handles = default_engine.ingest(PASSAGES)
    full = default_engine.generate(QUERY, handles, method="full", max_new_tokens=1)
    p = torch.log_softmax(full.first_token_logits, -1)

    def kl(r):
        return float((p.exp() * (p - torch.log_softmax(r.first_token_logits, -1))).sum())

    reuse = default_engine.generate(QUERY, handles, method="reuse", max_new_tokens=1)
    blend = default_engine.generate(QUERY, handles, method="blend", recompute_ratio=0.3, max_new_tokens=1)
    assert kl(blend) < kl(reuse)
    assert blend.stats.store_hits == len(handles) + 1  # every chunk and the system prefix


def test_bfloat16(default_model_dir, default_engine):
    engine = Engine.load(default_model_dir, dtype="bfloat16", store="memory")
    handles = engine.ingest(PASSAGES[:2])
    assert engine.store.get(handles[0].key).k.dtype == torch.bfloat16
    full = engine.generate(QUERY, handles, method="full", max_new_tokens=8)
    b1 = engine.generate(QUERY, handles, method="blend", recompute_ratio=1.0, max_new_tokens=8)
    # bfloat16 rounds logits of 30-60 in steps of 0.125-0.25 and the bucketed attention
    # sums in another order than full prefill, so the two are not bit-close (CPUs with
    # native bf16 kernels put single elements 0.4 apart).  What must hold: blend at r=1
    # is as close to the float32 answer as bfloat16 full prefill is, up to bfloat16's own
    # rounding: both errors are 1-2 spacings of bfloat16 at the logits' size, and which of the
    # two lands closer changes with any reordering of the products (packed weights moved
    # full prefill from 0.12 to 0.06 and blend from 0.08 to 0.20).  A broken blend (stale or
    # misplaced K/V) is off by whole units.
    ref = default_engine.generate(QUERY, PASSAGES[:2], method="full", max_new_tokens=1).first_token_logits
    err_full = (full.first_token_logits.float() - ref).abs()
    err_blend = (b1.first_token_logits.float() - ref).abs()
    spacing = (torch.finfo(torch.bfloat16).eps * ref.abs()).mean()
    assert err_blend.mean() < 1.5 * err_full.mean() + 2 * spacing, (err_blend.mean(), err_full.mean(), spacing)
    assert err_blend.max() < 1.0
    assert b1.token_ids[:1] == full.token_ids[:1] == [int(ref.argmax())]
    assert engine.fingerprint != Engine.load(default_model_dir, store="memory").fingerprint


def test_bfloat16_decode_follows_transformers_past_split_keys(default_model_dir):
    """bfloat16 runs its products on oneDNN-reordered weights and its attention natively,
    the decode step over two halves of the keys past ``split_key_attention.MIN_KEYS``.  Every
    greedy token must be one transformers' own bfloat16 forward ranks top, up to bfloat16's
    rounding of logits (a spacing is 0.25 at their size; a wrong cache is off by units)."""
    from cacheblend.blend.attention import split_key_attention
    from cacheblend.models.loader import load_model

    engine = Engine.load(default_model_dir, dtype="bfloat16", store="memory", onednn_weights=True)
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():  # noqa: SLF001
        assert engine.decoder.dnn is not None
    text = " ".join(PASSAGES)
    while len(engine.tokenizer(text)["input_ids"]) < split_key_attention.MIN_KEYS + 40:
        text += " " + " ".join(PASSAGES)
    handles = engine.ingest([text])
    r = engine.generate(QUERY, handles, method="full", max_new_tokens=8, ignore_eos=True)
    prompt = engine.prompts.build(QUERY, [list(h.token_ids) for h in handles], None).all_ids
    assert len(prompt) > split_key_attention.MIN_KEYS and len(r.token_ids) == 8
    hf = load_model(default_model_dir, dtype="bfloat16").model.eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + r.token_ids])).logits[0].float()
    for i, token in enumerate(r.token_ids):
        row = logits[len(prompt) - 1 + i]
        assert row[token] >= row.max() - 0.75, (i, float(row[token]), float(row.max()))
