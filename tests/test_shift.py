"""Chunk shift correction (``shift_share``, cacheblend/blend/shift.py): the evenly spaced
sample, the shift it estimates from its fresh K/V, and what that does to the rows of the
fused cache a blend leaves stale."""

from __future__ import annotations

import pytest
import torch

from cacheblend.blend.fusor import KVCache, Segment, fused_prefill
from cacheblend.blend.selection import BlendConfig
from cacheblend.blend.shift import evenly_spaced, segment_shrunk_means
from cacheblend.config import RequestOptions
from cacheblend.datasets import load_qa
from cacheblend.errors import CacheBlendError
from conftest import PASSAGES, QUERY


def shrunk_mean(diff: torch.Tensor) -> torch.Tensor:
    """Reference for one chunk, written directly from the formula (the library computes all
    chunks at once): the mean over rows, times max(0, 1 − σ²/(m‖mean‖²)) per head, none
    for a single row."""
    m = diff.shape[1]
    mean = diff.mean(1, keepdim=True)
    if m < 2:
        return torch.zeros_like(mean)
    spread = diff.var(1, keepdim=True).sum(-1, keepdim=True)
    power = mean.pow(2).sum(-1, keepdim=True)
    factor = torch.where(power > 0, 1.0 - spread / (m * power), torch.zeros_like(power))  # no mean: no shift
    return mean * factor.clamp(0.0, 1.0)

def test_evenly_spaced_takes_the_centres_of_equal_parts():
    got = evenly_spaced([(0, 10), (10, 13)], 0.2, 15, torch.device("cpu"))
    assert torch.nonzero(got).squeeze(1).tolist() == [2, 7, 11]  # 2 of 10, and at least 1 of 3
    assert bool(evenly_spaced([(3, 7)], 1.0, 8, torch.device("cpu"))[3:7].all())
    assert int(evenly_spaced([(0, 1000)], 0.03, 1000, torch.device("cpu")).sum()) == 30


def test_bad_shift_shares_are_refused():
    for bad in (-0.1, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match="shift_share"):
            BlendConfig(shift_share=bad)
        with pytest.raises(CacheBlendError, match="shift_share"):
            RequestOptions.parse({"shift_share": bad})


def _prompt(engine, passages=PASSAGES, query=QUERY):
    handles = engine.ingest(passages)
    prompt = engine.prompts.build(query, [list(h.token_ids) for h in handles], None)
    caches = [engine.store.get(h.key) for h in handles]
    segs = [Segment(prompt.prefix)] + [Segment(h.token_ids, c) for h, c in zip(handles, caches, strict=True)]
    segs.append(Segment(prompt.suffix))
    spans, start = [], len(prompt.prefix)
    for h in handles:
        spans.append((start, start + h.num_tokens))
        start += h.num_tokens
    return prompt, caches, segs, spans


@pytest.mark.parametrize("selection", [{}, {"selection": "probe", "probe_share": 0.5}], ids=["hkvd", "probe-half"])
def test_stale_rows_carry_the_mean_shift_of_their_chunks_sample(default_engine, selection):
    """Rebuilt by hand from the fresh K/V the fusor computed: every stale row of a chunk
    holds its cached value plus the (shrunk) mean of (fresh − cached) over the chunk's
    sample, at each layer after the check layer; the sample is recomputed within the
    budget.  After a probe pass too, which has already placed the unshifted caches.
    Behind the frame sink (SmolLM2's default) the first chunk follows the very frame it was
    precomputed behind: its cache is exact up to rounding, so its sample's difference can
    be zero in a head (the reference once divided 0 by 0 there) and its shift is no real
    correction; every later chunk's is."""
    dec = default_engine.decoder
    ex = load_qa("musique", "dev", limit=1, passages=4)[0]
    prompt, caches, segs, spans = _prompt(default_engine, ex.passages, ex.question)
    n = len(prompt.all_ids)
    fresh: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def capture(layer, positions, k, v):
        fresh[layer] = (positions.clone(), v.float().clone())

    kv = KVCache(dec.shape, n, "cpu")
    with torch.inference_mode():
        got = fused_prefill(dec, segs, kv, BlendConfig(recompute_ratio=0.2, shift_share=0.05, **selection),
                            capture=capture)
    n_cand = sum(b - a for a, b in spans)
    assert got.recomputed_tokens == round(0.2 * n_cand)
    sample = torch.nonzero(evenly_spaced(spans, 0.05, n, torch.device("cpu"))).squeeze(1)
    recomputed = set(got.hkvd_positions.tolist())
    assert set(sample.tolist()) <= recomputed
    for layer in (2, 15, dec.shape.num_layers - 1):
        positions, v = fresh[layer]
        for (a, b), cache in zip(spans, caches, strict=True):
            cached = cache.v[layer].float()
            mine = sample[(sample >= a) & (sample < b)]
            rows = torch.searchsorted(positions, mine)
            shift = shrunk_mean(v[:, rows] - cached[:, mine - a])
            stale = torch.tensor([p for p in range(a, b) if p not in recomputed])
            torch.testing.assert_close(kv.v[layer][:, stale].float(), (cached + shift)[:, stale - a],
                                       atol=1e-5, rtol=1e-5)
            if a > spans[0][0] or default_engine.chunk_sink != "frame":
                assert float(shift.abs().max()) > 1e-3  # a real correction, not a shrunk-away one


def test_the_shift_moves_stale_rows_towards_full_prefill(default_engine):
    """Against full prefill's own K/V, the stale rows' error (keys after RoPE and values,
    every layer after the check layer) is smaller with the shift than without, on a dev
    prompt of real size (four musique passages, about 2,400 tokens)."""
    dec = default_engine.decoder
    ex = load_qa("musique", "dev", limit=1, passages=4)[0]
    prompt, _, segs, spans = _prompt(default_engine, ex.passages, ex.question)
    n = len(prompt.all_ids)
    caches = {}
    with torch.inference_mode():
        for name, config in (("full", BlendConfig(recompute_ratio=1.0)),
                             ("plain", BlendConfig(recompute_ratio=0.15, shift_share=0.0)),
                             ("shift", BlendConfig(recompute_ratio=0.15, shift_share=0.03))):
            kv = KVCache(dec.shape, n, "cpu")
            report = fused_prefill(dec, segs if name != "full" else [Segment(prompt.all_ids)], kv, config)
            caches[name] = (kv, set(report.hkvd_positions.tolist()))
    stale = torch.tensor([p for a, b in spans for p in range(a, b)
                          if p not in caches["plain"][1] and p not in caches["shift"][1]])
    full = caches["full"][0]

    def error(name, part):
        kv = caches[name][0]
        return float((getattr(kv, part)[2:, :, stale] - getattr(full, part)[2:, :, stale]).pow(2).sum())

    for part in ("k", "v"):
        # measured: keys 0.71, values 0.92 of the plain blend's error
        assert error("shift", part) < (0.8 if part == "k" else 0.95) * error("plain", part), part


def test_shift_parts_moves_only_the_named_half(default_engine):
    """``shift_parts="v"`` leaves the stale rows' keys exactly as the re-positioned cache at
    every layer; at the first shifted layer (before the shift has touched any fresh row)
    each half it moves equals the full shift's, the other equals no shift."""
    dec = default_engine.decoder
    prompt, caches, segs, spans = _prompt(default_engine)
    n = len(prompt.all_ids)
    runs, recomputed = {}, {}
    with torch.inference_mode():
        for parts in ("kv", "k", "v"):
            kv = KVCache(dec.shape, n, "cpu")
            report = fused_prefill(dec, segs, kv, BlendConfig(recompute_ratio=0.3, shift_share=0.2, shift_parts=parts,
                                                             check_pool=1.0))  # shifted from layer 2
            runs[parts], recomputed[parts] = kv, set(report.hkvd_positions.tolist())
        cos, sin = dec.rope_tables(torch.arange(n))
    first = BlendConfig().check_layers[0] + 1
    (a, b), cache = spans[-1], caches[-1]
    stale = torch.tensor([p for p in range(a, b) if p not in recomputed["v"]])
    for layer in range(first, dec.shape.num_layers):
        placed = dec.rope(cache.k[layer], cos[a:b], sin[a:b])[:, stale - a]
        torch.testing.assert_close(runs["v"].k[layer][:, stale], placed, atol=1e-6, rtol=1e-6)
    for part in ("k", "v"):
        full = getattr(runs["kv"], part)[first, :, a:b]
        assert torch.equal(getattr(runs[part], part)[first, :, a:b], full), part
        assert not torch.equal(getattr(runs["v" if part == "k" else "k"], part)[first, :, a:b], full), part
    for bad in ("q", "", "KV"):
        with pytest.raises(ValueError, match="shift_parts"):
            BlendConfig(shift_parts=bad)
        with pytest.raises(CacheBlendError, match="shift_parts"):
            RequestOptions.parse({"shift_parts": bad})


def test_shift_values_from_leaves_early_values_unshifted(default_engine):
    """``shift_values_from=0.5``: below half the depth the stale rows' values are the
    cached ones exactly, from there on they are shifted; keys are shifted throughout."""
    dec = default_engine.decoder
    prompt, caches, segs, spans = _prompt(default_engine)
    n, layers = len(prompt.all_ids), dec.shape.num_layers
    kv = KVCache(dec.shape, n, "cpu")
    with torch.inference_mode():
        report = fused_prefill(dec, segs, kv, BlendConfig(recompute_ratio=0.3, shift_share=0.2, shift_values_from=0.5))
        cos, sin = dec.rope_tables(torch.arange(n))
    recomputed = set(report.hkvd_positions.tolist())
    (a, b), cache = spans[-1], caches[-1]
    stale = torch.tensor([p for p in range(a, b) if p not in recomputed])
    start = round(0.5 * layers)
    for layer in range(BlendConfig().check_layers[0] + 1, layers):
        values_kept = torch.equal(kv.v[layer][:, stale], cache.v[layer][:, stale - a])
        assert values_kept == (layer < start), layer
        placed = dec.rope(cache.k[layer], cos[a:b], sin[a:b])[:, stale - a]
        assert not torch.allclose(kv.k[layer][:, stale], placed, atol=1e-6), layer
    for bad in (-0.1, 1.5, True, "0.3"):
        with pytest.raises(ValueError, match="shift_values_from"):
            BlendConfig(shift_values_from=bad)


def test_segment_shrunk_means_equal_shrunk_mean_per_segment():
    """The batched shift (one pass over all chunks) is the per-chunk shrunk mean, including
    a one-row segment (no correction) and a segment whose spread swamps its mean."""
    g = torch.Generator().manual_seed(0)
    sizes = [5, 1, 12, 3]
    parts = [torch.randn(3, m, 8, generator=g) * (0.2 + j) + (j - 1.5) for j, m in enumerate(sizes)]
    parts[3] = torch.randn(3, 3, 8, generator=g) * 10.0  # mean ~0 against a large spread: shrunk to 0
    segment = torch.cat([torch.full((m,), j) for j, m in enumerate(sizes)])
    got = segment_shrunk_means(torch.cat(parts, 1), segment, torch.tensor(sizes))
    for j, part in enumerate(parts):
        torch.testing.assert_close(got[:, j : j + 1], shrunk_mean(part), rtol=1e-5, atol=1e-6)
    assert bool((got[:, 1] == 0).all())


def test_in_memory_caches_give_the_shift_of_the_per_layer_reads(monkeypatch):
    """Sources in memory have their sampled rows gathered for every layer at once; the
    shifts equal those of the per-layer reads a disk or Redis source gives (same bits)."""
    from cacheblend.blend.shift import ChunkShift
    from cacheblend.store import ChunkKV

    g = torch.Generator().manual_seed(2)
    spans = [(3, 43), None, (50, 110)]
    sources = [ChunkKV(torch.randn(4, 2, b - a, 8, generator=g), torch.randn(4, 2, b - a, 8, generator=g), {})
               if (a, b) != (0, 0) else None for a, b in (s or (0, 0) for s in spans)]
    sample = evenly_spaced([s for s in spans if s is not None], 0.1, 120, torch.device("cpu"))
    active = torch.nonzero(sample | (torch.arange(120) >= 110)).squeeze(1)
    held, read = ChunkShift(spans, sample, sources=sources), ChunkShift(spans, sample)
    monkeypatch.setattr(held, "_sampled", lambda *_: pytest.fail("the in-memory sources were read per layer"))
    for layer in range(4):
        k, v = torch.randn(2, active.numel(), 8, generator=g), torch.randn(2, active.numel(), 8, generator=g)
        cached = [s.layer(layer) if s is not None else None for s in sources]
        pairs = zip(held.deltas(active, k, v, cached, layer), read.deltas(active, k, v, cached, layer), strict=True)
        for a, b in pairs:
            assert (a is None and b is None) or all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
