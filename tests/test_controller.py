"""The loading controller: recompute what loading hides, never below the quality floor."""

from __future__ import annotations

import pytest

from cacheblend import Engine
from cacheblend.blend.controller import LoadingController
from conftest import PASSAGES, QUERY, make_tiny_model


def test_ratio_rises_when_loading_is_slow_and_never_drops_below_floor():
    ctl = LoadingController(quality_floor=0.15)
    ctl.observe_compute(compute_s=1.0, token_layers=100_000)  # 10 us per token-layer
    ctl.observe_load("disk", nbytes=1_000_000_000, seconds=1.0)  # 1 GB/s
    slow = ctl.decide(candidates=3000, fixed_tokens=40, bytes_per_layer=10_000_000, tier="disk")  # 10 ms/layer
    assert slow.ratio == pytest.approx((0.010 / 1e-5 - 40) / 3000)
    assert slow.ratio > 0.15 and "raised" in slow.reason
    fast = ctl.decide(candidates=3000, fixed_tokens=40, bytes_per_layer=100_000, tier="disk")
    assert fast.ratio == 0.15 and "floor" in fast.reason


def test_suggests_the_slowest_tier_that_still_hides():
    ctl = LoadingController(quality_floor=0.15)
    ctl.observe_compute(1.0, 100_000)
    ctl.observe_load("memory", 50e9, 1.0)
    ctl.observe_load("disk", 2e9, 1.0)
    ctl.observe_load("redis", 0.1e9, 1.0)
    d = ctl.decide(3000, 40, 5_000_000, "memory")  # floor recompute: 4.9 ms/layer
    assert d.suggested_tier == "disk"  # redis would need 50 ms/layer


def test_engine_auto_ratio_reports_its_choice(tmp_path, default_model_dir):
    engine = Engine.load(make_tiny_model(tmp_path / "m", "llama", default_model_dir),
                         store=f"memory,disk:{tmp_path / 'kv'}")
    handles = engine.ingest(PASSAGES)
    engine.store.flush()
    first = engine.generate(QUERY, handles, recompute_ratio="auto", quality_floor=0.2, max_new_tokens=2)
    assert first.stats.controller["floor"] == 0.2 and first.stats.recompute_ratio >= 0.2
    assert engine.controller.compute_s_per_token_layer is not None
    engine.store.tiers[0].clear()  # next read comes from disk, layer by layer
    second = engine.generate(QUERY, handles, recompute_ratio="auto", quality_floor=0.2, max_new_tokens=2)
    assert second.stats.controller["tier"] == "disk"
    assert second.stats.seconds["load"] > 0
    assert "disk" in engine.controller.bandwidth
    assert second.stats.recompute_ratio >= 0.2 and second.stats.controller["reason"]


def test_an_escalated_prefill_does_not_teach_the_controller(default_engine):
    """An escalated report's compute time counts every pass and its active tokens only the
    last one's: fed to the controller, it inflated the compute speed estimate that picks
    ``auto`` ratios."""
    handles = default_engine.ingest(PASSAGES)
    ctl = default_engine.controller
    default_engine.generate(QUERY, handles, recompute_ratio=0.15, max_new_tokens=1)
    before = ctl.compute_s_per_token_layer
    r = default_engine.generate(QUERY, handles, recompute_ratio="guard", max_risk=0.0, max_new_tokens=1)
    assert r.stats.escalated and ctl.compute_s_per_token_layer == before
