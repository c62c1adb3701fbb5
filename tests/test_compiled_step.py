"""The decode step as one compiled graph (``generate/compiled.py``, ``compile_decode``):
greedy tokens identical to the eager step in float32 on every layer shape the decoder
supports (q/k/v biases, sliding windows, per-head norms), on both product layouts, past the
split-key attention on the real model; and a graph that fails falls back to eager."""

from __future__ import annotations

import logging

import pytest
import torch

from cacheblend import Engine
from conftest import PASSAGES, QUERY, make_tiny_model


@pytest.mark.parametrize("family", ["llama", "qwen2-window", "qwen3"])
@pytest.mark.parametrize("onednn", [True, False], ids=["oneDNN", "MKL"])
def test_compiled_step_gives_the_eager_tokens(tmp_path, default_model_dir, family, onednn):
    folder = make_tiny_model(tmp_path / family, family, default_model_dir)
    eager = Engine.load(folder, store="memory", onednn_weights=onednn)
    compiled = Engine.load(folder, store="memory", onednn_weights=onednn, compile_decode=True)
    assert compiled.decode_step.enabled
    for method in ("full", "blend"):
        a = eager.generate(QUERY, PASSAGES, method=method, max_new_tokens=12, ignore_eos=True)
        b = compiled.generate(QUERY, PASSAGES, method=method, max_new_tokens=12, ignore_eos=True)
        assert b.token_ids == a.token_ids
    assert compiled.decode_step.enabled, "the graph fell back to eager"


def test_two_engines_keep_their_own_caches(tmp_path, default_model_dir):
    """The attention op finds its cache through the step object: two compiled engines, one
    request interleaved with the other's, each get their own answer."""
    folder = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    one = Engine.load(folder, store="memory", compile_decode=True)
    two = Engine.load(folder, store="memory", compile_decode=True)
    ref = Engine.load(folder, store="memory")
    s1 = one.stream(QUERY, PASSAGES, method="full", max_new_tokens=8, ignore_eos=True)
    s2 = two.stream("Who wrote it?", PASSAGES[:1], method="full", max_new_tokens=8, ignore_eos=True)
    text1, text2 = "", ""
    for p1, p2 in zip(s1, s2, strict=False):
        text1, text2 = text1 + p1, text2 + p2
    text1 += "".join(s1)
    text2 += "".join(s2)
    assert text1 == ref.generate(QUERY, PASSAGES, method="full", max_new_tokens=8, ignore_eos=True).text
    assert text2 == ref.generate("Who wrote it?", PASSAGES[:1], method="full", max_new_tokens=8,
                                 ignore_eos=True).text


def test_a_failing_graph_falls_back_to_eager(tmp_path, default_model_dir, caplog):
    folder = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    eager = Engine.load(folder, store="memory")
    compiled = Engine.load(folder, store="memory", compile_decode=True)

    def broken(*args):
        raise RuntimeError("no C++ compiler here")

    compiled.decode_step.graph = broken
    with caplog.at_level(logging.WARNING, logger="cacheblend.compiled"):
        r = compiled.generate(QUERY, PASSAGES, max_new_tokens=8, ignore_eos=True)
    assert r.token_ids == eager.generate(QUERY, PASSAGES, max_new_tokens=8, ignore_eos=True).token_ids
    assert not compiled.decode_step.enabled
    assert "compiled decode step is unavailable here (RuntimeError: no C++ compiler here)" in caplog.text


def test_compile_decode_must_be_a_bool(tmp_path, default_model_dir):
    from cacheblend.errors import CacheBlendError

    with pytest.raises(CacheBlendError, match="compile_decode must be True or False"):
        Engine.load(make_tiny_model(tmp_path / "m", "llama", default_model_dir), store="memory", compile_decode="yes")


@pytest.mark.slow
def test_compiled_step_on_the_default_model_past_split_keys(default_model_dir, default_engine):
    """SmolLM2, float32, a prompt past ``split_key_attention.MIN_KEYS``: the compiled step's
    greedy tokens are the eager step's, after full prefill and after a blend."""
    from cacheblend.blend.attention import split_key_attention

    compiled = Engine.load(default_model_dir, store="memory", compile_decode=True,
                           onednn_weights=default_engine.decoder.dnn is not None)
    text = " ".join(PASSAGES)
    while len(compiled.tokenizer(text)["input_ids"]) < split_key_attention.MIN_KEYS + 40:
        text += " " + " ".join(PASSAGES)
    for method in ("full", "blend"):
        a = default_engine.generate(QUERY, [text, PASSAGES[0]], method=method, max_new_tokens=16, ignore_eos=True)
        b = compiled.generate(QUERY, [text, PASSAGES[0]], method=method, max_new_tokens=16, ignore_eos=True)
        assert b.token_ids == a.token_ids
        torch.testing.assert_close(b.first_token_logits, a.first_token_logits, atol=0, rtol=0)  # prefill unchanged
    assert compiled.decode_step.enabled
