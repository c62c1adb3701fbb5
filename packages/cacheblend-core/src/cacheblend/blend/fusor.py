"""The fusor: layer-wise fused prefill over reused and fresh K/V (paper §4–5).

One routine serves every method, because they differ only in which segments arrive with
a cache and how many reused tokens are recomputed:

* ``full``   — no segment has a cache: every token is computed (plain prefill);
* ``prefix`` — the leading segment's cache is *exact* (computed at position 0);
* ``reuse``  — every chunk has a cache and nothing is recomputed (r = 0);
* ``blend``  — as reuse, but the HKVD tokens chosen at the check layer(s) are recomputed.

Per layer: write the re-positioned cached K/V of reused segments into the fused cache,
compute Q/K/V of the *active* tokens (all of them before the first check layer, then only
HKVD tokens plus every uncached token such as the question), overwrite their K/V with the
fresh ones, attend exactly causally by absolute position, and run the MLP for them only.
Exact-cached tokens (the system prefix) are never computed: their K/V are already what
full prefill would produce.  With the question probe (``selection="probe"``) a full-reuse
pass runs first and the recompute set comes from it (:mod:`cacheblend.blend.probe`).
Where the segments sit is :mod:`.layout`; what the check layer keeps is :mod:`.check`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from ..aio import cancellable, raise_if_cancelled
from ..generate.decode import KVCache
from ..models.decoder import Decoder
from .attention import AttentionPlans
from .check import keep_at_check, pool_for_check, question_attention, shift_sample
from .exposure import StaleExposure
from .layout import PromptLayout, Segment, layout_of
from .loader import LayerLoader
from .probe import QuestionProbe
from .selection import BlendConfig, Candidates, choose

__all__ = ["Attend", "Capture", "FusionReport", "KVCache", "Segment", "check_deadline", "first_token_risk",
           "fused_prefill"]

# capture(layer, positions, keys_before_rope, values): used by chunk precompute.
Capture = Callable[[int, Tensor, Tensor, Tensor], None]
# attend(layer, positions, queries, keys): the rotated queries [H, a, hd] of the tokens
# computed at a layer and every key [KVH, n, hd] they attend to (``engine.explain``).
Attend = Callable[[int, Tensor, Tensor, Tensor], None]


@dataclass
class FusionReport:
    """What the fused prefill produced and did."""

    logits: Tensor
    prompt_tokens: int
    reused_tokens: int
    recomputed_tokens: int
    computed_tokens: int
    hkvd_positions: Tensor = field(repr=False)
    active_per_layer: list[int] = field(default_factory=list, repr=False)
    load_s: float = 0.0
    load_exposed_s: float = 0.0
    compute_s: float = 0.0
    ratio_used: float = 0.0  # recomputed share of the approximate (reused, not exact) tokens
    risk: float = 0.0  # fidelity risk: see first_token_risk (0 when exact)
    exposure: float | None = None  # the first token's lean on stale K/V (.exposure); None: not measured
    escalated: bool = False  # the quality guard re-ran it at a larger ratio
    exact: bool = True  # every K/V is full prefill's: no approximately reused token stayed stale
    exact_cached_tokens: int = 0  # tokens read from exact caches in the store (a prefix), never computed
    approximate_tokens: int = 0  # reused tokens from chunk caches (not exact) that were not recomputed


def fused_prefill(
    dec: Decoder,
    segments: Sequence[Segment],
    kv: KVCache,
    config: BlendConfig,
    capture: Capture | None = None,
    prefetch: bool | None = True,
    deadline: float | None = None,
    attend: Attend | None = None,
) -> FusionReport:
    """Fill ``kv`` for the prompt ``segments`` and return the last position's logits.

    Reused caches are read layer by layer (the next layer is fetched while this one is
    fused when ``prefetch``; None: :func:`~.loader.pipelined` decides by the tiers); a
    source that fails verification raises ``CorruptEntry``.
    Past ``deadline`` (a ``time.perf_counter()`` value) the next layer raises ``TimeoutError``."""
    shape = dec.shape
    config.validate_for(shape.num_layers)
    lay = layout_of(segments, kv.capacity, kv.k.device)
    n, reused_spans = lay.ids.numel(), lay.reused_spans
    ratio = config.recompute_ratio if lay.n_candidates else 0.0
    t_start = time.perf_counter()
    probed = None
    if config.selection == "probe" and 0.0 < ratio < 1.0:
        probed = _probe(dec, segments, kv, config, lay, prefetch, deadline)
    cos, sin = dec.rope_tables(torch.arange(n, device=kv.k.device))
    chosen = probed.chosen if probed is not None else None
    direct = chosen is not None
    sample, shift = shift_sample(config, ratio, direct, lay, reused_spans, shape.num_layers)
    pool = None if chosen is not None else pool_for_check(config, ratio, lay, reused_spans, sample)
    if chosen is not None:  # the probe's tokens: recomputed from layer 0 on, no check layer
        active = torch.nonzero(lay.uncached | chosen).squeeze(1)
    else:
        active = torch.nonzero(lay.uncached | (lay.candidate if pool is None else pool) if ratio > 0
                               else lay.uncached).squeeze(1)
    # After a probe the fused cache already holds every re-positioned reused K/V; only a
    # check layer still reads the caches (deviation compares against them), and a chunk
    # shift, which moves the cached K/V of every layer.
    last_read = -1 if direct else config.check_layers[-1] if probed is not None and shift is None \
        else shape.num_layers - 1
    h = dec.embed(lay.ids[active])
    # The exposure costs about 2 % of a blend's TTFT, so only a guard with an exposure limit measures it.
    meter = StaleExposure(lay.candidate, shape.num_layers, shape.groups, dec.scaling) \
        if 0.0 < ratio < 1.0 and config.max_exposure is not None else None
    checks, active_per_layer = {layer: i for i, layer in enumerate(config.check_layers)}, []

    plans = AttentionPlans(active, shape.dtype, shape.groups, dec.prefill_attention)
    tables = cos[active], sin[active]  # the active rows' RoPE tables, gathered once per active set
    loader = LayerLoader([s.cached for _, _, s in reused_spans], last_read + 1, prefetch,  # type: ignore[misc]
                         check=None if deadline is None and not cancellable() else
                         lambda: check_deadline(deadline, "the fused prefill, waiting for a cached layer"))
    finished = False
    try:
        for layer in range(shape.num_layers):
            check_deadline(deadline, f"the fused prefill, before layer {layer}")
            x = dec.attn_input(layer, h)
            k, v = dec.keys_values(layer, x)
            if layer <= last_read:
                cached = loader.layer(layer)
                # stale from the layer after the check layer on, or from the check layer with a pool
                deltas = shift.deltas(active, k, v, cached, layer) \
                    if shift is not None and layer >= config.check_layers[0] + (pool is None) else None
                _reposition(dec, kv, layer, reused_spans, cached, cos, sin, deltas)
            if capture is not None:
                capture(layer, active, k, v)
            if meter is not None:  # before the fresh values replace the cached ones
                meter.values(active, v, kv.v[layer])
            _write(kv, layer, active, dec.rope(k, *tables), v)

            if layer in checks and 0.0 < ratio < 1.0 and not direct:
                approx_kv = [c for (_, _, s), c in zip(reused_spans, cached, strict=True) if not s.exact]
                q_att = probed.score if probed is not None else \
                    question_attention(dec, layer, x, active, lay, kv.k[layer, :, :n], cos, sin) \
                    if config.uses_attention else None
                keep = keep_at_check(config, checks[layer], active, lay, approx_kv, k, v, q_att, sample)
                if keep is not None:  # HKVD tokens (and uncached ones) go on; the rest keep fresh K/V here
                    active, h, x = active[keep], h[keep], x[keep]
                    plans = AttentionPlans(active, shape.dtype, shape.groups, dec.prefill_attention)
                    tables = cos[active], sin[active]
            active_per_layer.append(active.numel())
            rows, row_tables = active, tables
            if layer == shape.num_layers - 1 and attend is None and rows.numel() > 1:
                # Past the last layer only the last position is read (its logits); every
                # token's K/V is written above, so the other rows' attention and MLP are waste.
                rows, h, x = rows[-1:], h[-1:], x[-1:]
                plans = AttentionPlans(rows, shape.dtype, shape.groups, dec.prefill_attention)
                row_tables = cos[rows], sin[rows]
            q = dec.rope(dec.queries(layer, x), *row_tables)
            if meter is not None:
                meter.attention(active, q[:, -1], kv.k[layer, :, :n])
            if attend is not None:
                attend(layer, rows, q, kv.k[layer, :, :n])
            plan = plans[shape.windows[layer]]
            h = dec.finish(layer, h, plan(q, kv.k[layer, :, :n], kv.v[layer, :, :n], dec.scaling))
        finished = True
    finally:
        loader.close(wait_for_reads=finished)

    kv.length = n
    report = _report(lay, active, dec.logits(h[-1:])[0], loader, active_per_layer,
                     time.perf_counter() - t_start - loader.exposed_s, meter)
    if probed is not None:  # the probe's reading of the caches counts as this prefill's
        report.load_s += probed.report.load_s
        report.load_exposed_s += probed.report.load_exposed_s
        report.compute_s -= probed.report.load_exposed_s
    return report


@dataclass
class _Probed:
    score: Tensor  # per position: the question's attention summed over layers (0 off the candidates)
    chosen: Tensor | None  # bool per position: recompute (None: the check layer mixes in deviation)
    report: FusionReport  # the probe pass's own (full reuse)


def _probe(dec: Decoder, segments: Sequence[Segment], kv: KVCache, config: BlendConfig, lay: PromptLayout,
           prefetch: bool | None, deadline: float | None) -> _Probed:
    """Full reuse with the question probe listening (:mod:`cacheblend.blend.probe`).  Leaves every
    re-positioned reused K/V in ``kv`` and picks the tokens to recompute, or, when the probe
    shares the budget (``probe_share`` < 1), leaves its score to the check layer."""
    probe = QuestionProbe(lay.question, lay.candidate, dec.scaling)
    report = fused_prefill(dec, segments, kv, replace(config, recompute_ratio=0.0, selection="deviation"),
                           prefetch=prefetch, deadline=deadline, attend=probe)
    rows = torch.nonzero(lay.candidate).squeeze(1)
    score = torch.zeros(lay.ids.numel(), device=rows.device)
    score[rows] = probe.score
    if config.probe_share < 1.0:
        return _Probed(score, None, report)
    keep = round(config.recompute_ratio * lay.n_candidates)
    cands = Candidates(torch.zeros_like(probe.score), probe.score, lay.chunk_of[rows], lay.offset[rows])
    chosen = torch.zeros_like(lay.candidate)
    chosen[rows[choose(config, cands, keep)]] = True
    return _Probed(score, chosen, report)


def _report(lay: PromptLayout, active: Tensor, logits: Tensor, loader: LayerLoader, active_per_layer: list[int],
            compute_s: float, meter: StaleExposure | None) -> FusionReport:
    """What the fused prefill did, with its fidelity receipt: exact when no approximately
    reused token stayed stale, else the risk of the first token and its exposure."""
    n, n_uncached = lay.ids.numel(), int(lay.uncached.sum())
    hkvd = active[lay.candidate[active]]
    exact = hkvd.numel() == lay.n_candidates
    return FusionReport(
        logits=logits, prompt_tokens=n, reused_tokens=n - n_uncached - hkvd.numel(),
        recomputed_tokens=hkvd.numel(), computed_tokens=n_uncached, hkvd_positions=hkvd,
        active_per_layer=active_per_layer, load_s=loader.load_s, load_exposed_s=loader.exposed_s,
        compute_s=compute_s, ratio_used=hkvd.numel() / lay.n_candidates if lay.n_candidates else 1.0,
        risk=0.0 if exact else first_token_risk(logits), exact=exact,
        exposure=0.0 if exact else None if meter is None else meter.value,
        exact_cached_tokens=sum(b - a for a, b, s in lay.reused_spans if s.exact and s.stored),
        approximate_tokens=lay.n_candidates - hkvd.numel(),
    )


def _reposition(dec: Decoder, kv: KVCache, layer: int, spans: list[tuple[int, int, Segment]],
                cached: list[tuple[Tensor, Tensor]], cos: Tensor, sin: Tensor,
                deltas: list[tuple[Tensor | None, Tensor | None] | None] | None = None) -> None:
    """Write the reused K/V of one layer into the fused cache, RoPE applied at their real
    offsets, each span moved by its chunk shift when ``deltas`` has one (a half the shift
    leaves alone, ``shift_parts`` or ``shift_values_from``, is None).  Results go straight
    into the cache, every span in one native call where the kernels run: on a fresh
    request these writes are also the cache's first touch (:mod:`..generate.kv_pool`)."""
    dec.reposition(kv.k[layer], kv.v[layer], [a for a, _, _ in spans], cached,
                   deltas if deltas is not None else [None] * len(spans), cos, sin)


def first_token_risk(logits: Tensor) -> float:
    """How likely the greedy first token differs from full prefill's: one minus the margin
    between the two most probable tokens.  Measured on dev, blended answers part from full
    prefill on near-ties (the right token is a close second); a clear winner survives the
    approximation (docs/fidelity.md: Spearman against KL, agreement by risk bucket)."""
    top = torch.topk(torch.softmax(logits.float(), -1), 2).values
    return float(1.0 - (top[0] - top[1]))


def check_deadline(deadline: float | None, where: str) -> None:
    """Raise ``TimeoutError`` once ``deadline`` (``time.perf_counter()`` seconds) has passed,
    and :class:`~cacheblend.aio.CallCancelled` once the async call it works for is cancelled."""
    raise_if_cancelled()
    if deadline is not None and time.perf_counter() > deadline:
        raise TimeoutError(f"the request's timeout ran out during {where}")


def _write(kv: KVCache, layer: int, positions: Tensor, k: Tensor, v: Tensor) -> None:
    first, count = int(positions[0]), positions.numel()
    if int(positions[-1]) - first + 1 == count:  # contiguous: a plain slice copy
        kv.k[layer, :, first : first + count] = k
        kv.v[layer, :, first : first + count] = v
    else:
        kv.k[layer][:, positions] = k
        kv.v[layer][:, positions] = v


