"""The quality guard (fallback by risk): a blended prefill the guard does not trust is
prefilled again at a larger ratio, up to exact.

The guard's verdict (:func:`.exposure.within_guard`) reads what the fused prefill already
measured: the first token's margin risk and, under an exposure limit, how much it leans on
stale K/V.  Escalation costs a second prefill on the few risky requests, and its time
counts in their TTFT: the guard trades speed on those for fidelity (docs/fidelity.md).
"""

from __future__ import annotations

from dataclasses import replace

from ..config import BlendConfig
from ..models.decoder import Decoder
from .exposure import within_guard
from .fusor import FusionReport, KVCache, Segment, fused_prefill

__all__ = ["guarded_prefill"]


def guarded_prefill(decoder: Decoder, segments: list[Segment], kv: KVCache, blend: BlendConfig, *,
                    prefetch: bool | None = True, deadline: float | None = None) -> FusionReport:
    """The fused prefill; with the guard on (``blend.max_risk`` or ``blend.max_exposure``), a
    result it does not trust is prefilled again at each larger ratio of ``blend.guard_ladder``
    until it is trusted (the last rung, 1.0, is exact).  The report's ``compute_s`` counts
    every pass."""
    report = fused_prefill(decoder, segments, kv, blend, prefetch=prefetch, deadline=deadline)
    if blend.max_risk is None and blend.max_exposure is None:
        return report  # (at ratio 0 no chunk token is computed, so only the risk limit can act)
    spent = report.compute_s + report.load_s
    for ratio in blend.guard_ladder:
        if within_guard(report, blend):
            break
        if ratio <= blend.recompute_ratio:
            continue
        report = fused_prefill(decoder, segments, kv, replace(blend, recompute_ratio=ratio), prefetch=prefetch,
                               deadline=deadline)
        report.escalated = True
        spent += report.compute_s + report.load_s
    report.compute_s = spent - report.load_s
    return report
