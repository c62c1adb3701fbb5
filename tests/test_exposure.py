"""The exposure (how much the first token rests on stale K/V) and the guard's limit on it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cacheblend.bench.fidelity import Sample, parse_spec
from cacheblend.blend.exposure import StaleExposure, within_guard
from cacheblend.config import GUARD_MAX_EXPOSURE, BlendConfig, RequestOptions
from cacheblend.errors import CacheBlendError
from conftest import PASSAGES, QUERY


def test_exposure_is_value_error_times_stale_attention_by_layer():
    torch.manual_seed(0)
    n, kvh, groups, hd, scaling = 12, 2, 3, 4, 0.5
    candidate = torch.zeros(n, dtype=torch.bool)
    candidate[2:10] = True  # 0-1: exact prefix, 10-11: the question
    meter = StaleExposure(candidate, num_layers=2, groups=groups, scaling=scaling)
    expected = 0.0
    for active in (torch.arange(n), torch.tensor([0, 1, 3, 7, 10, 11])):
        fresh = torch.randn(kvh, active.numel(), hd)
        cache = torch.randn(kvh, n + 3, hd)
        keys, query = torch.randn(kvh, n, hd), torch.randn(kvh * groups, hd)
        meter.values(active, fresh, cache)
        meter.attention(active, query, keys)
        mine = candidate[active]
        new, old = fresh[:, mine], cache[:, active[mine]]
        error = float(((new - old) ** 2).sum() / (new**2).sum())
        stale = candidate.clone()
        stale[active] = False
        probs = torch.stack([torch.softmax(keys[h // groups] @ query[h] * scaling, 0) for h in range(kvh * groups)])
        expected += error * float(probs.mean(0)[stale].sum())
    assert meter.errors[0] > 0 and meter.masses[0] == 0.0  # every candidate computed: nothing stale
    assert meter.value == pytest.approx(expected / 2, rel=1e-5)


def _report(exact=False, risk=0.5, exposure=0.01):
    return SimpleNamespace(exact=exact, risk=risk, exposure=exposure)


def test_within_guard_reads_both_limits():
    both = BlendConfig(max_risk=0.9, max_exposure=0.02)
    assert within_guard(_report(risk=0.5, exposure=0.03), both)  # 0.015 <= 0.02
    assert not within_guard(_report(risk=0.8, exposure=0.03), both)  # 0.024 > 0.02
    assert not within_guard(_report(risk=0.95, exposure=0.0), both)  # the margin alone
    assert within_guard(_report(risk=0.95, exposure=0.0), BlendConfig(max_exposure=0.02))
    assert within_guard(_report(exact=True, risk=0.0, exposure=None), both)


def test_guard_mode_sets_the_exposure_limit_and_checks_it():
    assert RequestOptions.parse({"recompute_ratio": "guard"}).blend().max_exposure == GUARD_MAX_EXPOSURE
    assert RequestOptions.parse({"recompute_ratio": "guard", "max_exposure": 0.5}).blend().max_exposure == 0.5
    assert RequestOptions.parse({}).blend().max_exposure is None
    assert RequestOptions.parse({"max_risk": 0.9}).blend().max_exposure is None  # the guard on the margin alone
    assert RequestOptions.parse({"method": "reuse", "max_exposure": 0.1}).blend().max_exposure is None
    for bad in (-0.1, 1.5, "high", True):
        with pytest.raises(CacheBlendError, match="max_exposure"):
            RequestOptions.parse({"max_exposure": bad})
    assert parse_spec("blend@guard:max_exposure=0.03").options["max_exposure"] == 0.03
    assert parse_spec("blend@0.15:max_exposure=none").options["max_exposure"] is None


def test_measuring_the_exposure_leaves_the_answer_alone(default_engine):
    handles = default_engine.ingest(PASSAGES)
    plain = default_engine.generate(QUERY, handles, max_new_tokens=4)
    measured = default_engine.generate(QUERY, handles, max_exposure=1.0, max_new_tokens=4)
    assert plain.stats.exposure is None  # not asked for: not measured
    assert 0.0 < measured.stats.exposure < 1.0 and not measured.stats.escalated
    assert measured.token_ids == plain.token_ids
    torch.testing.assert_close(measured.first_token_logits, plain.first_token_logits)
    assert measured.metadata()["fidelity"]["exposure"] == measured.stats.exposure
    exact = default_engine.generate(QUERY, handles, recompute_ratio=1.0, max_exposure=1.0, max_new_tokens=1)
    assert exact.stats.exact and exact.stats.exposure == 0.0


def test_an_exposure_limit_of_zero_escalates_to_full_prefill(default_engine):
    handles = default_engine.ingest(PASSAGES)
    full = default_engine.generate(QUERY, handles, method="full", max_new_tokens=8)
    guarded = default_engine.generate(QUERY, handles, max_exposure=0.0, max_new_tokens=8)
    assert guarded.stats.escalated and guarded.stats.exact and guarded.stats.exposure == 0.0
    assert guarded.token_ids == full.token_ids
    torch.testing.assert_close(guarded.first_token_logits, full.first_token_logits, atol=1e-3, rtol=1e-3)


def test_samples_of_older_studies_still_load():
    old = dict(dataset="musique", example=0, variant="blend@0.15", agree=1.0, kl=0.01, p_full=0.6, margin=0.2,
               output_f1=1.0, quality=0.5, ttft_s=0.7, ratio_used=0.15, risk=0.8, escalated=False, exact=False)
    assert Sample(**old).exposure is None
