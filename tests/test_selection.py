"""Selection beyond the paper's HKVD: query-aware scores, chunk heads, per-chunk budgets,
the quality guard, the fidelity receipt, and the study's statistics."""

from __future__ import annotations

import math
import time

import pytest
import torch

from cacheblend import Engine
from cacheblend.bench.fidelity import parse_spec
from cacheblend.bench.stats import bootstrap, paired, spearman
from cacheblend.blend.fusor import KVCache, Segment, first_token_risk, fused_prefill
from cacheblend.blend.probe import ROWS, QuestionProbe
from cacheblend.blend.selection import BlendConfig, Candidates, choose, priority, query_attention
from cacheblend.config import GUARD_MAX_RISK, RequestOptions
from cacheblend.errors import CacheBlendError
from cacheblend.store.entry import ChunkKV
from conftest import PASSAGES, QUERY

GEN = dict(max_new_tokens=8)
MODES = [dict(selection="deviation"), dict(selection="attention"), dict(selection="impact"),
         dict(selection="impact", chunk_heads=3), dict(selection="deviation", chunk_budget="attention"),
         dict(selection="probe"), dict(selection="deviation", shift_share=0.0)]


def _cands(dev, att, chunk, offset) -> Candidates:
    return Candidates(torch.tensor(dev, dtype=torch.float), torch.tensor(att, dtype=torch.float),
                      torch.tensor(chunk), torch.tensor(offset))


def test_query_attention_is_causal_softmax_mean():
    torch.manual_seed(0)
    h, kvh, n, hd = 4, 2, 10, 8
    k = torch.randn(kvh, n, hd)
    q_pos = torch.tensor([7, 9])
    q = torch.randn(h, 2, hd)
    got = query_attention(q, q_pos, k, 0.5)
    want = torch.zeros(n)
    for head in range(h):
        kk = k[head // (h // kvh)]
        for row, p in enumerate(q_pos.tolist()):
            w = torch.softmax((kk[: p + 1] @ q[head, row]) * 0.5, 0)
            want[: p + 1] += w / (h * 2)
    torch.testing.assert_close(got, want)
    assert float(got.sum()) == pytest.approx(1.0, abs=1e-5)
    assert float(got[8]) > 0 and float(got[9]) > 0  # the second query row sees 8 and 9


def test_priority_orders_by_each_score():
    c = _cands([9, 1, 4, 0], [0.1, 0.5, 0.3, 0.05], [0, 0, 1, 1], [0, 1, 0, 1])
    assert priority(BlendConfig(), c).tolist() == [0, 2, 1, 3]
    assert priority(BlendConfig(selection="attention"), c).tolist() == [1, 2, 0, 3]
    assert priority(BlendConfig(selection="impact"), c).tolist()[0] == 2  # 0.3 * 2 beats 0.1 * 3 and 0.5 * 1


def test_chunk_heads_come_first():
    c = _cands([9, 8, 7, 0, 0, 0], [0.1] * 6, [0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 1, 2])
    first = priority(BlendConfig(chunk_heads=1), c).tolist()[:2]
    assert sorted(first) == [0, 3]  # the head of each chunk, though chunk 1 has no deviation


def test_chunk_budget_follows_the_question_attention():
    # chunk 1 gets 3/4 of the attention: about 3 of every 4 chosen rows
    c = _cands([1.0] * 16, [0.025] * 8 + [0.075] * 8, [0] * 8 + [1] * 8, list(range(8)) * 2)
    chosen = choose(BlendConfig(chunk_budget="attention"), c, keep=8)
    assert int((chosen >= 8).sum()) == 6


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
def test_every_selection_at_ratio_one_equals_full(tiny_engine, mode):
    handles = tiny_engine.ingest(PASSAGES)
    full = tiny_engine.generate(QUERY, handles, method="full", **GEN)
    blend = tiny_engine.generate(QUERY, handles, method="blend", recompute_ratio=1.0, **mode, **GEN)
    torch.testing.assert_close(blend.first_token_logits, full.first_token_logits, atol=1e-3, rtol=1e-3)
    assert blend.token_ids == full.token_ids and blend.stats.exact


@pytest.mark.parametrize("mode", [dict(chunk_heads=2), dict(chunk_budget="attention")])
def test_a_check_with_every_candidate_in_the_shift_sample_keeps_them_all(mode):
    """Tiny chunks (a vLLM client's spans of a token or two): the shift sample can take every
    candidate still active at the check layer, leaving a negative budget and none to choose
    from; choosing among none raised (``min()`` of an empty tensor)."""
    from types import SimpleNamespace

    from cacheblend.blend.check import keep_at_check

    n = 3
    lay = SimpleNamespace(candidate=torch.ones(n, dtype=torch.bool), n_candidates=n, row_of=torch.arange(n),
                          chunk_of=torch.arange(n), offset=torch.zeros(n, dtype=torch.long))
    k = v = torch.randn(2, n, 8)
    kept = keep_at_check(BlendConfig(recompute_ratio=0.15, **mode), 0, torch.arange(n), lay, [(k, v)], k, v,
                         torch.full((n,), 1 / n), sample=torch.ones(n, dtype=torch.bool))
    assert kept is None  # keep all: every one is the sample's


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
def test_every_selection_recomputes_its_budget(default_engine, mode):
    handles = default_engine.ingest(PASSAGES)
    r = default_engine.generate(QUERY, handles, method="blend", recompute_ratio=0.2, **mode, max_new_tokens=1)
    approx = r.stats.recomputed_tokens + r.stats.approximate_tokens
    assert r.stats.recomputed_tokens == round(0.2 * approx)
    assert not r.stats.exact and 0 < r.stats.risk <= 1 and not r.stats.escalated
    assert r.stats.ratio_used == pytest.approx(0.2, abs=0.01)


def test_first_token_risk_is_one_minus_the_top_two_margin():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    assert first_token_risk(logits) == pytest.approx(0.8)
    assert first_token_risk(torch.tensor([50.0, 0.0, 0.0])) == pytest.approx(0.0, abs=1e-6)


def test_guard_with_zero_risk_limit_is_full_prefill(default_engine):
    handles = default_engine.ingest(PASSAGES)
    full = default_engine.generate(QUERY, handles, method="full", **GEN)
    guarded = default_engine.generate(QUERY, handles, method="blend", recompute_ratio="guard", max_risk=0.0, **GEN)
    torch.testing.assert_close(guarded.first_token_logits, full.first_token_logits, atol=1e-3, rtol=1e-3)
    assert guarded.token_ids == full.token_ids
    s = guarded.stats
    assert s.escalated and s.exact and s.ratio_used == 1.0 and s.approximate_tokens == 0 and s.risk == 0.0


def test_guard_keeps_a_confident_blend(default_engine):
    handles = default_engine.ingest(PASSAGES)
    plain = default_engine.generate(QUERY, handles, method="blend", max_new_tokens=1)
    guarded = default_engine.generate(QUERY, handles, method="blend", recompute_ratio="guard", max_risk=1.0,
                                      max_exposure=1.0, max_new_tokens=1)  # limits nothing exceeds
    assert not guarded.stats.escalated and guarded.stats.risk == pytest.approx(plain.stats.risk)
    assert torch.equal(guarded.first_token_logits, plain.first_token_logits)


def test_guard_climbs_the_ladder(default_engine):
    handles = default_engine.ingest(PASSAGES)
    plain = default_engine.generate(QUERY, handles, method="blend", max_new_tokens=1)
    limit = plain.stats.risk - 1e-6  # just below the plain blend's risk: the first rung runs
    r = default_engine.generate(QUERY, handles, method="blend", max_risk=limit, max_new_tokens=1)
    assert r.stats.escalated and r.stats.ratio_used > plain.stats.ratio_used


def test_the_guard_also_watches_a_blend_at_ratio_zero(default_engine):
    """The guard was skipped at ratio 0, the riskiest setting: an explicit 0 with a risk limit,
    or guard mode with ``quality_floor=0``, came back approximate, never escalated."""
    handles = default_engine.ingest(PASSAGES)
    for options in (dict(recompute_ratio=0.0, max_risk=0.0), dict(recompute_ratio="guard", quality_floor=0.0,
                                                                  max_risk=0.0)):
        r = default_engine.generate(QUERY, handles, method="blend", max_new_tokens=1, **options)
        assert r.stats.escalated and r.stats.exact, options


def test_receipt_says_exact_or_approximate(default_engine):
    handles = default_engine.ingest(PASSAGES)
    for method, exact in (("full", True), ("prefix", True), ("reuse", False), ("blend", False)):
        r = default_engine.generate(QUERY, handles, method=method, max_new_tokens=1)
        receipt = r.metadata()["fidelity"]
        assert receipt["exact"] is exact, method
        assert (receipt["approximate_tokens"] == 0) is exact, method
        s = r.stats
        assert r.usage["cached_tokens"] == s.exact_cached_tokens <= s.reused_tokens - s.approximate_tokens
        assert r.usage["approximate_tokens"] == receipt["approximate_tokens"]
    assert r.metadata()["fidelity"]["ratio_used"] == pytest.approx(RequestOptions().blend().recompute_ratio, abs=0.01)


def test_guard_mode_defaults_and_bad_values():
    config = RequestOptions.parse({"recompute_ratio": "guard"}).blend()
    assert config.max_risk == GUARD_MAX_RISK and config.recompute_ratio == RequestOptions().quality_floor
    assert RequestOptions.parse({"method": "full", "recompute_ratio": "guard"}).blend().max_risk is None
    for bad in ({"selection": "magic"}, {"chunk_heads": -1}, {"chunk_heads": 1.5}, {"chunk_budget": "even"},
                {"max_risk": -0.1}, {"max_risk": 1.5}, {"max_risk": "high"}, {"recompute_ratio": "sometimes"}):
        with pytest.raises(CacheBlendError):
            RequestOptions.parse(bad)


def test_variant_specs():
    spec = parse_spec("blend@0.2:selection=impact:chunk_heads=2:check_layers=1+2")
    assert spec.options == {"method": "blend", "recompute_ratio": 0.2, "selection": "impact", "chunk_heads": 2,
                            "check_layers": (1, 2)}
    assert parse_spec("blend@guard:max_risk=0.3").options["max_risk"] == 0.3
    for bad in ("blend@0.2:colour=red", "blend@0.2:selection", "blend@2.0", "nonsense", "blend@0.1:chunk_heads=x"):
        with pytest.raises(CacheBlendError):
            parse_spec(bad)


def test_bootstrap_paired_and_spearman():
    values = [0.0, 1.0] * 50
    iv = bootstrap(values)
    assert iv.mean == 0.5 and iv.low < 0.5 < iv.high and iv.high - iv.low < 0.3
    assert bootstrap([1.0] * 10).low == 1.0
    same = paired([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert same.mean == same.low == same.high == 0.0
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833)  # ties share ranks
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


def test_question_probe_sums_each_layers_normalised_attention():
    torch.manual_seed(1)
    h, kvh, n, hd = 4, 2, 12, 8
    candidate = torch.zeros(n, dtype=torch.bool)
    candidate[2:9] = True
    question = torch.tensor([10, 11])
    rows = torch.tensor([0, 1, 9, 10, 11])  # the computed rows: a frame, a gap, the question
    probe = QuestionProbe(question, candidate, 0.3)
    want = torch.zeros(7)
    for layer in range(3):
        q, k = torch.randn(h, rows.numel(), hd), torch.randn(kvh, n, hd)
        probe(layer, rows, q, k)
        att = query_attention(q[:, 3:], question, k, 0.3)[2:9]
        want += att / att.sum()
    torch.testing.assert_close(probe.score, want)
    assert float(probe.score.sum()) == pytest.approx(3.0)  # one vote per layer


def _split_at(segments_of_chunk, chosen):
    """A chunk's cache split into runs: chosen tokens uncached (computed at every layer,
    as the probe's second pass does), the rest reused as they are."""
    ids, cache, start = segments_of_chunk
    out, i, n = [], 0, len(ids)
    while i < n:
        j = i
        while j < n and bool(chosen[start + j]) == bool(chosen[start + i]):
            j += 1
        if chosen[start + i]:
            out.append(Segment(ids[i:j]))
        else:
            out.append(Segment(ids[i:j], ChunkKV(cache.k[:, :, i:j].clone(), cache.v[:, :, i:j].clone())))
        i = j
    return out


def test_probe_recomputes_the_questions_top_tokens_from_layer_zero(default_engine):
    """The probe's choice is the top share of the question's attention in full reuse, summed
    over layers; the blend that follows equals full reuse with exactly those tokens computed
    at every layer (an independent construction: the chosen runs as uncached segments)."""
    eng, dec = default_engine, default_engine.decoder
    handles = eng.ingest(PASSAGES)
    prompt = eng.prompts.build(QUERY, [list(h.token_ids) for h in handles], None)
    caches = [eng.store.get(h.key) for h in handles]
    segs = [Segment(prompt.prefix)] + [Segment(h.token_ids, c) for h, c in zip(handles, caches, strict=True)]
    segs.append(Segment(prompt.suffix))
    n = len(prompt.all_ids)
    q_start = n - len(prompt.suffix)
    n_cand = sum(h.num_tokens for h in handles)
    score = torch.zeros(n)

    def listen(layer, rows, q, keys):  # the attention of the question's last ROWS tokens, by hand
        mine = rows >= n - ROWS
        logits = torch.einsum("hmd,hnd->hmn", q[:, mine], keys.repeat_interleave(q.shape[0] // keys.shape[0], 0))
        pos = rows[mine]
        logits = logits * dec.scaling + torch.where(torch.arange(n)[None] > pos[:, None], float("-inf"), 0.0)
        att = torch.softmax(logits, -1).mean(dim=(0, 1))[len(prompt.prefix):q_start]
        score[len(prompt.prefix):q_start] += att / att.sum()

    with torch.inference_mode():
        fused_prefill(dec, segs, KVCache(dec.shape, n, "cpu"), BlendConfig(recompute_ratio=0.0), attend=listen)
        keep = round(0.2 * n_cand)
        want = (torch.topk(score, keep).indices.sort().values)
        got = fused_prefill(dec, segs, KVCache(dec.shape, n, "cpu"),
                            BlendConfig(recompute_ratio=0.2, selection="probe"))
        assert got.hkvd_positions.tolist() == want.tolist()
        chosen = torch.zeros(n, dtype=torch.bool)
        chosen[want] = True
        split, start = [Segment(prompt.prefix)], len(prompt.prefix)
        for h, c in zip(handles, caches, strict=True):
            split += _split_at((list(h.token_ids), c, start), chosen)
            start += h.num_tokens
        split.append(Segment(prompt.suffix))
        ref = fused_prefill(dec, split, KVCache(dec.shape, n, "cpu"), BlendConfig(recompute_ratio=0.0))
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-4, rtol=1e-4)
    assert got.recomputed_tokens == keep and not got.exact


def test_a_shared_probe_budget_fills_the_rest_by_deviation(default_engine):
    """probe_share=0.5: half the budget is the probe's top tokens, the rest are the HKVD
    tokens of highest deviation that the probe did not take (all within plain HKVD's top)."""
    handles = default_engine.ingest(PASSAGES)
    kw = dict(method="blend", recompute_ratio=0.3, max_new_tokens=1)
    probe = set(default_engine.generate(QUERY, handles, selection="probe", **kw).hkvd_positions)
    hkvd = set(default_engine.generate(QUERY, handles, **kw).hkvd_positions)
    mixed = default_engine.generate(QUERY, handles, selection="probe", probe_share=0.5, **kw)
    chosen = set(mixed.hkvd_positions)
    assert len(chosen) == len(probe) == len(hkvd)
    by_probe = chosen & probe
    assert len(by_probe) >= round(0.5 * len(probe))
    assert chosen - probe <= hkvd and chosen != probe and chosen != hkvd


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_probe_reads_lazy_caches_cleanly(default_model_dir, tmp_path, share):
    """From a disk store (caches read layer by layer, prefetched) the probe gives the same
    answer as from memory and rejects nothing, though its second pass reads the caches only
    up to the check layer, or not at all."""
    opts = dict(method="blend", recompute_ratio=0.2, selection="probe", probe_share=share, max_new_tokens=4)
    disk = Engine.load(default_model_dir, store=f"disk:{tmp_path}")
    memory = Engine.load(default_model_dir, store="memory")
    got = disk.generate(QUERY, disk.ingest(PASSAGES), **opts)
    want = memory.generate(QUERY, memory.ingest(PASSAGES), **opts)
    assert got.stats.store_rejected == 0 and got.token_ids == want.token_ids
    assert got.hkvd_positions == want.hkvd_positions


def test_cached_tokens_count_only_what_the_store_served(default_engine):
    """``cached_tokens`` (OpenAI's: prompt tokens read from a cache) counted a prefix that
    missed the prefix cache, computed for this request and stored, as read from it."""
    handles = default_engine.ingest(PASSAGES)
    system = f"You answer from the passages. Request tag {time.time_ns()}."  # never stored before
    for method in ("prefix", "blend"):
        first, again = (default_engine.generate(QUERY, handles, system=f"{system} {method}", method=method,
                                                max_new_tokens=1) for _ in range(2))
        assert first.stats.store_misses >= 1 and first.usage["cached_tokens"] == 0, method
        assert again.usage["cached_tokens"] > 0 and again.stats.reused_tokens == first.stats.reused_tokens, method
