"""Positional attention: exact causality by absolute position, against a dense reference."""

from __future__ import annotations

import pytest
import torch

from cacheblend.blend.attention import AttentionPlan, positional_attention, split_key_attention


def _reference(q, k, v, pos, scale, window=None):
    groups = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(groups, 0)
    v = v.repeat_interleave(groups, 0)
    scores = (q @ k.transpose(1, 2)) * scale
    j = torch.arange(k.shape[1])[None, :]
    ok = j <= pos[:, None]
    if window is not None:
        ok &= j > pos[:, None] - window
    scores = scores.masked_fill(~ok, float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("m", [1, 7, 300])
@pytest.mark.parametrize("window", [None, 50])
def test_matches_dense_masked_reference(m, window):
    torch.manual_seed(0)
    n = 400
    q = torch.randn(4, m, 16)
    k, v = torch.randn(2, n, 16), torch.randn(2, n, 16)
    pos = torch.randperm(n)[:m].sort().values
    out = positional_attention(q, k, v, pos, 0.25, window)
    torch.testing.assert_close(out, _reference(q, k, v, pos, 0.25, window), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("first", [0, 37])
def test_keys_before_each_bucket_are_attended_unmasked_and_merged_exactly(first):
    """Without a window, each bucket attends to the keys before its first query in one
    unmasked kernel call and to its own span under a mask, merged by log-sum-exp; a bucket
    that starts at position 0 has no unmasked part.  Both must equal the dense reference."""
    torch.manual_seed(3)
    n = 900
    pos = torch.cat([torch.tensor([first]), first + 1 + torch.randperm(n - first - 1)[:399].sort().values])
    plan = AttentionPlan(pos, torch.float32, None, 3)
    assert plan.split and len(plan.buckets) == 8
    assert plan.buckets[0].start == first and all(b.start == int(pos[b.rows.start]) for b in plan.buckets)
    q, k, v = torch.randn(6, pos.numel(), 16), torch.randn(2, n, 16), torch.randn(2, n, 16)
    torch.testing.assert_close(plan(q, k, v, 0.25), _reference(q, k, v, pos, 0.25), atol=1e-5, rtol=1e-4)
    half = plan(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.25)  # a float32 plan: bf16 inputs attended in float32
    assert half.dtype == torch.bfloat16 and plan.compute_dtype == torch.float32
    ref = _reference(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), pos, 0.25)
    torch.testing.assert_close(half.float(), ref, atol=2e-2, rtol=2e-2)
    bf16 = AttentionPlan(pos, torch.bfloat16, None, 3)  # a bf16 plan: attended natively, in fewer buckets
    assert bf16.compute_dtype == torch.bfloat16 and bf16.split and len(bf16.buckets) == 4
    torch.testing.assert_close(bf16(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.25).float(), ref,
                               atol=3e-2, rtol=3e-2)
    assert AttentionPlan(pos, torch.float16, None, 3).compute_dtype == torch.float32  # float16: upcast


def test_all_positions_is_plain_causal():
    torch.manual_seed(1)
    q, k, v = torch.randn(4, 64, 16), torch.randn(2, 64, 16), torch.randn(2, 64, 16)
    out = positional_attention(q, k, v, torch.arange(64), 0.25)
    torch.testing.assert_close(out, _reference(q, k, v, torch.arange(64), 0.25), atol=1e-5, rtol=1e-4)


def test_later_keys_do_not_leak_into_earlier_queries():
    """A bottom-right causal mask would let the early query at position 10 see keys up to
    the last query's position; ours must not."""
    torch.manual_seed(2)
    n = 300
    pos = torch.tensor([10, 150, 299])
    q, k, v = torch.randn(2, 3, 8), torch.randn(2, n, 8), torch.randn(2, n, 8)
    before = positional_attention(q, k, v, pos, 0.3)
    k2, v2 = k.clone(), v.clone()
    k2[:, 11:], v2[:, 11:] = torch.randn(2, n - 11, 8), torch.randn(2, n - 11, 8)
    after = positional_attention(q, k2, v2, pos, 0.3)
    torch.testing.assert_close(after[:, 0], before[:, 0])
    assert not torch.allclose(after[:, 2], before[:, 2])


@pytest.mark.parametrize("n", [512, 513, 2049])
def test_split_key_decode_attention_matches_the_reference_and_ignores_unwritten_slots(n):
    """The decode step's split-key path reads the cache past the last key when ``n`` is
    odd; whatever that unwritten slot holds (NaN here) must not reach the answer."""
    torch.manual_seed(2)
    capacity = n + 3
    k, v = torch.randn(3, capacity, 16), torch.randn(3, capacity, 16)
    k[:, n:], v[:, n:] = float("nan"), float("nan")
    q = torch.randn(9, 1, 16)
    assert split_key_attention.fits(torch.float32, n, capacity)
    out = split_key_attention(q, k, v, n, 0.25)
    torch.testing.assert_close(out, _reference(q, k[:, :n], v[:, :n], torch.tensor([n - 1]), 0.25),
                               atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(k[:, :n].isnan().any(), torch.tensor(False))  # the keys are untouched


def test_split_key_attention_stays_off_where_it_cannot_apply():
    assert not split_key_attention.fits(torch.float32, 511, 4096)  # too few keys to pay
    assert not split_key_attention.fits(torch.float32, 1001, 1001)  # no padding slot inside the cache
    assert split_key_attention.fits(torch.float32, 1000, 1000)  # even: no padding needed
    assert split_key_attention.fits(torch.bfloat16, 1000, 4096)
    assert not split_key_attention.fits(torch.float16, 1000, 4096)  # float16 keeps the float32 plan


def test_split_key_decode_attention_in_bfloat16_returns_bfloat16():
    """The halves' weights come from the float32 log-sum-exp: the merged output must be cast
    back (a float32 output would meet bfloat16 weights in the output projection)."""
    torch.manual_seed(4)
    n, capacity = 1001, 1010
    k, v = torch.randn(3, capacity, 16).bfloat16(), torch.randn(3, capacity, 16).bfloat16()
    q = torch.randn(9, 1, 16).bfloat16()
    out = split_key_attention(q, k, v, n, 0.25)
    assert out.dtype == torch.bfloat16
    ref = _reference(q.float(), k[:, :n].float(), v[:, :n].float(), torch.tensor([n - 1]), 0.25)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
