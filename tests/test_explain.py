"""Engine.explain, the data behind the explorer, against full prefill (tiny model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cacheblend import CacheBlendError, Engine
from cacheblend.blend.shift import evenly_spaced
from cacheblend.datasets import load_qa
from cacheblend.ui import Explorer, split_passages
from conftest import PASSAGES, QUERY, make_tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_model_dir):
    return make_tiny_model(tmp_path_factory.mktemp("explain"), "llama", default_model_dir)


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine.load(tiny_model, store="memory")


def test_attention_maps_are_full_prefill_at_ratio_one_and_block_diagonal_under_reuse(engine):
    ex = engine.explain(QUERY, PASSAGES[:3], attention_layer=2, recompute_ratio=1.0, answers=False)
    a = ex.attention
    assert torch.allclose(a.blend, a.full, atol=1e-5)
    assert torch.allclose(a.full.sum(dim=1), torch.ones(len(ex.tokens)), atol=1e-4)
    first, second, question = a.boundaries[0], a.boundaries[1], a.boundaries[3]
    assert a.reuse[second:a.boundaries[2], first:second].sum() == 0  # chunk 2 never saw chunk 1
    assert a.full[second:a.boundaries[2], first:second].sum() > 0
    rows = a.reuse[question:].sum(dim=1)  # the question is computed under reuse: whole rows
    assert torch.allclose(rows, torch.ones_like(rows), atol=1e-4)
    assert ex.tokens[question].part == "question"


def test_deviation_and_recompute_set(engine):
    ex = engine.explain(QUERY, PASSAGES, recompute_ratio=0.3, answers=False)
    cand = ex.candidates
    outside = torch.ones(len(ex.tokens), dtype=torch.bool)
    outside[cand] = False
    assert ex.deviation[outside].abs().sum() == 0 and ex.deviation[cand].max() > 0
    for r in (0.0, 0.15, 0.3, 1.0):
        assert int(ex.recomputed(r).sum()) == round(r * cand.numel())
    chosen = ex.recomputed()
    sample = evenly_spaced(ex.chunk_spans, min(ex.shift_share, 0.3), len(ex.tokens), torch.device("cpu"))
    assert ex.shift_share > 0 and bool(chosen[sample].all())  # the chunk-shift sample, then ...
    hkvd = chosen & ~sample
    assert ex.pool is not None and bool(ex.pool[hkvd].all())  # ... from the check pool (the default's) ...
    left = ex.pool & ~chosen
    assert ex.deviation[hkvd].min() >= ex.deviation[left].max()  # ... the highest, as HKVD picks
    with pytest.raises(CacheBlendError):
        ex.recomputed(1.5)


@pytest.mark.parametrize("sink", ["frame", "bos"])
def test_the_recompute_set_is_the_engines_on_a_real_prompt(tiny_model, sink):
    """A chunk of musique size (a 3 % sample of it, then HKVD): the explorer marks exactly
    the tokens the engine's fused prefill recomputes, at the default ratio and at another.
    Behind the frame sink, without a preamble, the one chunk follows the frame it was
    precomputed behind: its cache is exact, and neither marks a token.  With a preamble
    the chunk is blended; a chunk after a short preamble is almost exact, so rounding
    orders its deviations: the explorer once took them from a separate full prefill and
    marked other tokens than the engine recomputed."""
    engine = Engine.load(tiny_model, store="memory", chunk_sink=sink)
    ex_qa = load_qa("musique", "dev", limit=1, passages=1)[0]  # the tiny model holds 1,024 tokens
    for preamble in ("", "Passages:\n"):
        for ratio in (0.15, 0.3):
            ex = engine.explain(ex_qa.question, ex_qa.passages, preamble=preamble, recompute_ratio=ratio,
                                answers=False)
            r = engine.generate(ex_qa.question, ex_qa.passages, preamble=preamble, recompute_ratio=ratio,
                                max_new_tokens=1)
            assert torch.nonzero(ex.recomputed()).squeeze(1).tolist() == sorted(r.hkvd_positions)
            assert bool(r.hkvd_positions) == (sink == "bos" or bool(preamble))


def test_explain_answers_are_the_engines_and_serialize(engine):
    ex = engine.explain(QUERY, PASSAGES[:2], max_new_tokens=5, attention_layer=0)
    assert ex.full.token_ids == engine.generate(QUERY, PASSAGES[:2], method="full", max_new_tokens=5).token_ids
    assert ex.blended.token_ids == engine.generate(QUERY, PASSAGES[:2], max_new_tokens=5).token_ids
    assert json.loads(json.dumps(ex.as_dict()))["attention"]["layer"] == 0
    with pytest.raises(CacheBlendError, match="attention_layer"):
        engine.explain(QUERY, PASSAGES[:2], attention_layer=99)


def test_explorer_without_a_browser(engine):
    assert split_passages("a\n---\nb\n\n---\n  \n") == ["a", "b"]
    explorer = Explorer(engine, engine, bench_json=str(ROOT / "docs" / "bench-test-chunks.json"))
    steps = list(explorer.ask("\n---\n".join(PASSAGES[:2]), None, QUERY, "blend", 0.15, 4))
    full, chosen, stats = steps[-1]
    assert full and chosen and stats.count("TTFT") == 2
    fig, records = explorer.speed("", None, QUERY, 0.15, "bench JSON")
    assert records and fig.axes
    fig, records = explorer.speed("\n---\n".join(PASSAGES[:2]), None, QUERY, 0.15, "measure now")
    assert {r["method"] for r in records} == {"full", "prefix", "reuse", "blend"} and len(records) == 8
    assert all(r["output_f1_vs_full"] == 1.0 for r in records if r["method"] == "full")


def test_the_explorer_offers_musique_dev_examples(engine):
    from cacheblend.datasets import data_dir

    explorer = Explorer(engine, engine, data=str(data_dir(None)))
    name = next(iter(explorer.examples))
    passages, question = explorer.pick(name)
    assert name.startswith("musique dev 0") and len(split_passages(passages)) == 6 and question


def test_an_explanation_over_a_damaged_store_recomputes_the_damaged_entry(tiny_model, tmp_path):
    """``explain`` read the chunk caches outside the request path's retry: an entry damaged
    on disk raised CorruptEntry out of the explanation."""
    engine = Engine.load(tiny_model, store=f"disk:{tmp_path / 'kv'}")
    handles = engine.ingest(PASSAGES)
    path = engine.store.path(handles[0].key)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x55  # the last layer's bytes
    path.write_bytes(bytes(data))
    damaged = Engine.load(tiny_model, store=f"disk:{tmp_path / 'kv'}")
    reference = Engine.load(tiny_model, store="memory").explain(QUERY, PASSAGES, answers=False)
    out = damaged.explain(QUERY, handles, answers=False, attention_layer=1)
    torch.testing.assert_close(out.deviation, reference.deviation)
    assert damaged.store.stats()["corrupt"] >= 1


def test_a_prompt_over_the_context_is_refused_as_a_request_is(engine):
    """The Tokens and Attention tabs built any prompt: passages that fit one by one but not
    together were prefilled past the model's context, and the attention maps took memory
    by the square of the length (tens of GB) in the explorer's process."""
    long = [" ".join(f"{w}{i}" for i in range(260)) for w in ("alpha", "beta", "gamma")]  # each fits 1,024
    with pytest.raises(CacheBlendError, match="does not fit the model's context of 1024"):
        engine.generate(QUERY, long, max_new_tokens=1)
    with pytest.raises(CacheBlendError, match="does not fit the model's context of 1024"):
        engine.explain(QUERY, long, attention_layer=0, answers=False)


def test_measuring_speed_without_passages_is_refused_as_the_other_tabs_do(engine):
    with pytest.raises(ValueError, match="give at least one passage"):
        Explorer(engine, engine).speed("", None, QUERY, 0.15, "measure now")
