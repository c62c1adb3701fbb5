"""The backbone: every method against full prefill on the same prompt.

blend at r = 1 must equal full prefill; blend at r = 0 must equal full KV reuse; prefix
caching with one chunk must equal full prefill; full prefill must equal transformers' own
forward and greedy ``generate``; re-positioned keys must equal keys computed in place.
"""

from __future__ import annotations

import pytest
import torch

from cacheblend.blend.attention import split_key_attention
from cacheblend.blend.fusor import KVCache, Segment, fused_prefill
from cacheblend.blend.selection import BlendConfig
from cacheblend.cache.segments import behind_sink
from cacheblend.models.decoder import apply_rope
from conftest import PASSAGES, QUERY, reference_model

GEN = dict(max_new_tokens=12)


def _atol(engine) -> float:
    return 1e-3 if engine.decoder.shape.dtype == torch.float32 else 5e-2


def _prompt_ids(engine, handles, query=QUERY):
    return engine.prompts.build(query, [list(h.token_ids) for h in handles], None).all_ids


def _exact_tokens(engine, handles) -> int:
    """Tokens reused exactly: the prompt's prefix, and the first chunk when that prefix is
    the sink it was precomputed behind (cache/segments.py)."""
    prefix = engine.prompts.build(QUERY, [], None).prefix
    return len(prefix) + (handles[0].num_tokens if behind_sink(engine.chunks, prefix) else 0)


def _approx_tokens(engine, handles) -> int:
    prefix = len(engine.prompts.build(QUERY, [], None).prefix)
    return sum(h.num_tokens for h in handles) - (_exact_tokens(engine, handles) - prefix)


def test_full_matches_transformers_forward_and_generate(tiny_engine):
    handles = tiny_engine.ingest(PASSAGES)
    full = tiny_engine.generate(QUERY, handles, method="full", **GEN)
    ids = torch.tensor([_prompt_ids(tiny_engine, handles)])
    hf = reference_model(tiny_engine)
    with torch.inference_mode():
        ref_logits = hf(ids).logits[0, -1].float()
        ref = hf.generate(ids, max_new_tokens=GEN["max_new_tokens"], do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    torch.testing.assert_close(full.first_token_logits, ref_logits, atol=_atol(tiny_engine), rtol=1e-3)
    assert full.token_ids == ref[: len(full.token_ids)]


def test_blend_ratio_one_equals_full(tiny_engine):
    handles = tiny_engine.ingest(PASSAGES)
    full = tiny_engine.generate(QUERY, handles, method="full", **GEN)
    blend = tiny_engine.generate(QUERY, handles, method="blend", recompute_ratio=1.0, **GEN)
    torch.testing.assert_close(blend.first_token_logits, full.first_token_logits, atol=_atol(tiny_engine), rtol=1e-3)
    assert blend.token_ids == full.token_ids
    assert blend.stats.reused_tokens == _exact_tokens(tiny_engine, handles)


def test_blend_ratio_zero_equals_reuse(tiny_engine):
    handles = tiny_engine.ingest(PASSAGES)
    reuse = tiny_engine.generate(QUERY, handles, method="reuse", **GEN)
    blend = tiny_engine.generate(QUERY, handles, method="blend", recompute_ratio=0.0, **GEN)
    assert torch.equal(blend.first_token_logits, reuse.first_token_logits)
    assert blend.token_ids == reuse.token_ids
    assert blend.stats.recomputed_tokens == 0


def test_prefix_with_one_chunk_equals_full(tiny_engine):
    handles = tiny_engine.ingest(PASSAGES[:1])
    full = tiny_engine.generate(QUERY, handles, method="full", **GEN)
    prefix = tiny_engine.generate(QUERY, handles, method="prefix", **GEN)
    torch.testing.assert_close(prefix.first_token_logits, full.first_token_logits, atol=_atol(tiny_engine), rtol=1e-3)
    assert prefix.token_ids == full.token_ids
    assert prefix.stats.reused_tokens > handles[0].num_tokens


def test_repositioned_keys_equal_keys_computed_at_offset(tiny_engine):
    """Layer-0 keys depend only on the token, so a chunk's cached keys rotated to offset p
    must equal what full prefill computes at p."""
    handles = tiny_engine.ingest(PASSAGES)
    ids = _prompt_ids(tiny_engine, handles)
    dec = tiny_engine.decoder
    kv = KVCache(dec.shape, len(ids), "cpu")
    with torch.inference_mode():
        fused_prefill(dec, [Segment(ids)], kv, BlendConfig())
    offset = len(tiny_engine.prompts.build(QUERY, [], None).prefix) + handles[0].num_tokens
    chunk = tiny_engine.store.get(handles[1].key)
    n = chunk.num_tokens
    cos, sin = dec.rope_tables(torch.arange(offset, offset + n))
    moved = apply_rope(chunk.k[0], cos, sin)
    torch.testing.assert_close(moved, kv.k[0, :, offset : offset + n], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(chunk.v[0], kv.v[0, :, offset : offset + n], atol=1e-5, rtol=1e-4)


def test_recomputed_tokens_never_see_later_tokens(tiny_engine):
    """Changing the last chunk must not change any fused K/V before it (exact causality
    of recomputed tokens by absolute position)."""
    dec = tiny_engine.decoder
    handles = tiny_engine.ingest(PASSAGES)
    other = tiny_engine.ingest(["An entirely different closing passage about tea and Darjeeling."])[0]
    caches = []
    for last in (handles[3], other):
        hs = handles[:3] + [last]
        prompt = tiny_engine.prompts.build(QUERY, [list(h.token_ids) for h in hs], None)
        segs = [Segment(prompt.prefix)]
        segs += [Segment(h.token_ids, tiny_engine.store.get(h.key)) for h in hs] + [Segment(prompt.suffix)]
        kv = KVCache(dec.shape, len(prompt.all_ids), "cpu")
        with torch.inference_mode():
            fused_prefill(dec, segs, kv, BlendConfig(recompute_ratio=1.0))
        caches.append(kv)
    cut = len(prompt.prefix) + sum(h.num_tokens for h in handles[:3])
    torch.testing.assert_close(caches[0].k[:, :, :cut], caches[1].k[:, :, :cut], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(caches[0].v[:, :, :cut], caches[1].v[:, :, :cut], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("ratio", [0.2, 0.5])
def test_blend_selects_requested_share(tiny_engine, ratio):
    handles = tiny_engine.ingest(PASSAGES)
    r = tiny_engine.generate(QUERY, handles, method="blend", recompute_ratio=ratio, max_new_tokens=2)
    assert r.stats.recomputed_tokens == round(ratio * _approx_tokens(tiny_engine, handles))
    assert r.stats.reused_tokens + r.stats.recomputed_tokens + r.stats.computed_tokens == r.stats.prompt_tokens


def test_gradual_filtering_narrows(tiny_engine):
    handles = tiny_engine.ingest(PASSAGES)
    r = tiny_engine.generate(QUERY, handles, method="blend", recompute_ratio=0.2,
                             check_layers=(1, 2, 3), gradual=True, max_new_tokens=2)
    assert r.stats.recomputed_tokens == round(0.2 * _approx_tokens(tiny_engine, handles))


def test_long_prompt_decode_matches_transformers_generate(tiny_engine):
    """Past ``split_key_attention.MIN_KEYS`` keys a decode step attends over two halves of
    the keys, merged by log-sum-exp, and reads the cache slot after the last key when the
    count is odd: greedy tokens must stay transformers' own across odd and even lengths."""
    text = " ".join(PASSAGES)
    while len(tiny_engine.tokenizer(text)["input_ids"]) < split_key_attention.MIN_KEYS + 40:
        text += " " + " ".join(PASSAGES)
    handles = tiny_engine.ingest([text])
    full = tiny_engine.generate(QUERY, handles, method="full", max_new_tokens=8)
    ids = torch.tensor([_prompt_ids(tiny_engine, handles)])
    assert split_key_attention.MIN_KEYS < ids.shape[1] < 1000
    with torch.inference_mode():
        ref = reference_model(tiny_engine).generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None,
                                                    pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert full.token_ids == ref[: len(full.token_ids)]


def test_a_chunk_right_behind_its_sink_is_reused_exactly(default_engine, tmp_path, default_model_dir):
    """A prompt without a system message or preamble opens with the chat frame, the frame
    sink the chunks are precomputed behind: the first chunk's cache is full prefill's there.
    It was checked, shifted and counted as approximate, so a one-chunk prompt got an
    approximate receipt (and a guard could escalate it) for a cache that needed nothing."""
    from cacheblend import Engine

    eng = default_engine
    assert behind_sink(eng.chunks, eng.prompts.build(QUERY, [], None).prefix)  # SmolLM2: the frame sink
    handles = eng.ingest(PASSAGES[:2])
    full = eng.generate(QUERY, handles[:1], method="full", **GEN)
    eng.generate(QUERY, handles[:1], recompute_ratio=0.15, max_new_tokens=1)  # stores the prefix, if new
    one = eng.generate(QUERY, handles[:1], recompute_ratio=0.15, **GEN)
    assert one.stats.exact and one.stats.recomputed_tokens == 0 and one.stats.risk == 0.0
    assert one.stats.exact_cached_tokens == len(eng.prompts.build(QUERY, [], None).prefix) + handles[0].num_tokens
    torch.testing.assert_close(one.first_token_logits, full.first_token_logits, atol=1e-3, rtol=1e-3)
    assert one.token_ids == full.token_ids
    two = eng.generate(QUERY, handles, recompute_ratio=0.5, max_new_tokens=1)  # only the second chunk is a candidate
    assert not two.stats.exact and two.stats.recomputed_tokens == round(0.5 * handles[1].num_tokens)
    start = len(eng.prompts.build(QUERY, [], None).prefix) + handles[0].num_tokens
    assert all(start <= p < start + handles[1].num_tokens for p in two.hkvd_positions)
    system = eng.generate(QUERY, handles[:1], system="Answer briefly.", recompute_ratio=0.15, max_new_tokens=1)
    assert not system.stats.exact and system.stats.recomputed_tokens > 0  # behind another system message
    low = Engine.load(default_model_dir, store="memory", kv_dtype="bfloat16")  # stored at another precision
    stored = low.generate(QUERY, low.ingest(PASSAGES[:1]), recompute_ratio=0.15, max_new_tokens=1)
    assert not stored.stats.exact and stored.stats.recomputed_tokens > 0
