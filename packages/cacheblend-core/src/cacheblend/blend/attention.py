"""Attention of a subset of query positions against the fused KV cache.

The recomputed (HKVD) tokens are scattered through the prompt, so their attention must
be causal by *absolute* position: a token at position p sees keys 0..p and nothing
later.  A dense [m, N] mask is exact but costs about twice a causal kernel, because
every query scores every key.  We split the sorted queries into a few buckets and give
each bucket only the key prefix it can see (up to its last position).  The keys before a
bucket's first query are visible to all of its rows: they are attended in one unmasked
call, the bucket's own span in a second call under a mask, and the two are merged by their
log-sum-exp (exact).  A mask over the whole prefix would be as many bytes as the keys and
rule out no work: on 3.7K-token prompts the split made blend's TTFT 5–10 % shorter at
5 % and 15 % (docs/internals/performance-log.md).  All of this stays exact — unlike a
bottom-right-aligned causal mask, which lets an early recomputed token see later ones.

Where the engine has its own prefill kernel (:mod:`cacheblend.native`, float32), a plan
hands the sorted positions to it in one call instead: it masks by position itself, with no
buckets, and about a quarter faster per query–key pair than the buckets here.

The active set is the same on every layer after the last check layer, so the buckets
and their additive masks are built once (:class:`AttentionPlan`) and reused.  Grouped
query heads are folded into the query rows (``[KVH, groups × rows, hd]``) so the kernel
reads each K/V head once and works on taller query blocks (≈10 % faster than letting
SDPA expand K/V).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..native import PositionalAttention

# Buckets per plan, by compute dtype: on the AMX Xeon, blend at 15 % on 3.7K-token prompts
# (one engine, settings alternating request by request, 12 requests each) took 1.18 / 1.21 /
# 1.23 s with 8 / 6 / 4 buckets in float32, and 0.61 / 0.58 s with 8 / 4 in bf16, whose
# kernel calls are cheaper, so the fixed cost per call weighs more (docs/internals/latency.md).
_BUCKETS = 8
_BUCKETS_BF16 = 4
_MIN_BUCKET = 48
# Attention runs in the model's dtype, except float16, which runs in float32 (not measured
# on CPU).  bfloat16 runs natively: on an AMX Xeon with torch 2.13 the masked bucket path
# takes 9 ms per layer in bf16 against 18 ms upcast to float32 (570 queries, 3.8K keys;
# docs/internals/latency.md); an older torch was slower in bf16, hence the upcast it had.
_UPCAST = (torch.float16,)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, **kw) -> Tensor:
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], scale=scale, enable_gqa=q.shape[0] != k.shape[0], **kw
    )[0]


# The CPU flash kernel returns each query's log-sum-exp, which lets one query's attention be
# computed over two key ranges and merged exactly (``F.scaled_dot_product_attention`` drops it).
_FLASH: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)  # noqa: SLF001


@dataclass
class _Bucket:
    rows: slice
    start: int  # first key of the masked range: the first visible key (a window), the first query's (split), or 0
    end: int  # one past the last visible key
    mask: Tensor | None  # additive [groups × rows, end - start]; None when all keys are visible


class AttentionPlan:
    """Exact causal-by-position attention for queries at sorted positions ``q_pos``."""

    # Attend to the keys before each bucket's first query unmasked, merged by log-sum-exp
    # (False: one masked call per bucket, the plan before; kept to measure the difference).
    SPLIT_PREFIX = True

    def __init__(self, q_pos: Tensor, dtype: torch.dtype, window: int | None = None, groups: int = 1,
                 kernel: PositionalAttention | None = None) -> None:
        """``kernel``: our prefill kernel (:mod:`cacheblend.native`), used for float32 plans."""
        m = q_pos.numel()
        self.q_pos = q_pos
        self.groups = groups
        self.causal = bool(m > 1 and int(q_pos[-1]) == m - 1)  # q_pos == 0..m-1
        if window is not None and window >= int(q_pos[-1]) + 1:
            window = None
        self.window = window
        self.compute_dtype = torch.float32 if dtype in _UPCAST else dtype
        self.buckets: list[_Bucket] = []
        self.kernel = kernel if dtype == torch.float32 and q_pos.device.type == "cpu" else None
        if self.kernel is not None:
            self.q_pos = q_pos.to(torch.int64).contiguous()
            return  # one call, any positions and window: no buckets
        if self.causal and window is None:
            return  # the plain causal kernel is exact and fastest
        most = _BUCKETS_BF16 if self.compute_dtype == torch.bfloat16 else _BUCKETS
        n_buckets = max(1, min(most, m // _MIN_BUCKET))
        bounds = torch.linspace(0, m, n_buckets + 1).round().long().tolist()
        # Without a window, the keys before a bucket's first query are visible to all of its
        # rows: they go through the kernel unmasked, and only the bucket's own span carries a
        # mask (a mask over every key is as many bytes as the keys, and rules out no work).
        self.split = self.SPLIT_PREFIX and window is None and _FLASH is not None and q_pos.device.type == "cpu"
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            pos = q_pos[a:b]
            end = int(pos[-1]) + 1
            if self.split:  # keys before the first query: unmasked, outside the mask
                start = int(pos[0])
            else:
                start = 0 if window is None else max(0, int(pos[0]) - window + 1)
            j = torch.arange(start, end, device=q_pos.device)[None, :]
            hidden = j > pos[:, None]
            if window is not None:
                hidden |= j <= pos[:, None] - window
            mask = None
            if bool(hidden.any()):
                mask = torch.zeros(hidden.shape, dtype=self.compute_dtype, device=q_pos.device)
                mask = mask.masked_fill_(hidden, float("-inf")).repeat(groups, 1)
            self.buckets.append(_Bucket(slice(a, b), start, end, mask))

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """``q`` [H, m, hd]; ``k``, ``v`` [KVH, n, hd] for positions 0..n-1. Returns [H, m, hd]."""
        if self.kernel is not None:
            return self.kernel(q, k, v, self.q_pos, scale, self.window or 0)
        if not self.buckets:
            return _sdpa(q, k[:, : q.shape[1]], v[:, : q.shape[1]], scale, is_causal=True)
        kvh, g = k.shape[0], self.groups
        h, m, hd = q.shape
        if h != kvh * g:
            raise ValueError(f"plan built for {g} query heads per KV head, got {h}/{kvh}")
        cd = self.compute_dtype
        grouped = q.view(kvh, g, m, hd).to(cd)
        end = self.buckets[-1].end
        k, v = k[:, :end].to(cd), v[:, :end].to(cd)
        outs = []
        for b in self.buckets:
            rows = b.rows.stop - b.rows.start
            qb = grouped[:, :, b.rows].reshape(kvh, g * rows, hd)
            if self.split:
                out = _split_at(qb, k, v, b.start, b.end, b.mask, scale)
            else:
                out = _sdpa(qb, k[:, b.start : b.end], v[:, b.start : b.end], scale, attn_mask=b.mask)
            outs.append(out.view(kvh, g, rows, hd))
        return torch.cat(outs, dim=2).reshape(h, m, hd).to(q.dtype)


def _split_at(q: Tensor, k: Tensor, v: Tensor, split: int, end: int, mask: Tensor | None, scale: float) -> Tensor:
    """Attention of ``q`` [KVH, r, hd] over keys [0, end): [0, split) unmasked and [split, end)
    under ``mask``, in two kernel calls merged by their log-sum-exp (exact: the softmax of
    partial sums).  Returns [KVH, r, hd]."""
    out, lse = _FLASH(q[None], k[None, :, split:end], v[None, :, split:end], attn_mask=mask, scale=scale)
    if split == 0:
        return out[0]
    out_before, lse_before = _FLASH(q[None], k[None, :, :split], v[None, :, :split], scale=scale)
    weights = torch.softmax(torch.stack([lse_before, lse]), dim=0).unsqueeze(-1)
    return (out_before * weights[0] + out * weights[1])[0]


class _SplitKeyAttention:
    """Attention of one query (a decode step) over ``n`` cached keys, as two halves of the
    keys in one kernel call, merged by their log-sum-exp.

    Why: a decode step has one work item per KV head in the attention kernel (3 on
    SmolLM2), so on 2 threads one core idles a third of the time.  Splitting the keys in two
    gives 6 items.  The halves are views of the cache, never copies (a copy would double
    the step's K/V traffic, which is what a memory-bound step cannot afford); when ``n`` is
    odd the second half ends one slot past the last key, so that slot is zeroed (it is the
    next token's slot, overwritten by the next step) and masked.  Exact up to float
    rounding: the merge is the usual softmax-of-partial-sums identity.
    """

    MIN_KEYS = 512  # below this the kernel's fixed cost outweighs the idle core; without _FLASH the plan runs

    def fits(self, dtype: torch.dtype, n: int, capacity: int) -> bool:
        """Whether the split applies: float32 or bfloat16 caches (float16 attention runs
        through the float32 plan) with enough keys and the padding slot inside the cache."""
        return (_FLASH is not None and dtype in (torch.float32, torch.bfloat16) and n >= self.MIN_KEYS
                and n + (n % 2) <= capacity)

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, n: int, scale: float) -> Tensor:
        """``q`` [H, 1, hd]; ``k_cache``, ``v_cache`` [KVH, capacity, hd] holding keys 0..n-1.
        Returns [H, 1, hd]."""
        kvh, _, hd = k_cache.shape
        h = q.shape[0]
        half = (n + 1) // 2
        mask = None
        if n % 2:
            k_cache[:, n].zero_()
            v_cache[:, n].zero_()
            mask = torch.zeros(2, 1, 1, half, dtype=q.dtype, device=q.device)
            mask[1, :, :, -1] = float("-inf")
        # [2, KVH, half, hd] views: half 0 is keys [0, half), half 1 is keys [half, 2 half).
        k2 = k_cache[:, : 2 * half].view(kvh, 2, half, hd).transpose(0, 1)
        v2 = v_cache[:, : 2 * half].view(kvh, 2, half, hd).transpose(0, 1)
        q2 = q.reshape(kvh, h // kvh, hd).expand(2, kvh, h // kvh, hd)
        out, lse = _FLASH(q2, k2, v2, attn_mask=mask, scale=scale)
        weights = torch.softmax(lse, dim=0).unsqueeze(-1)  # [2, KVH, groups, 1]
        return (out * weights).sum(0).reshape(h, 1, hd).to(q.dtype)  # the weights are float32


split_key_attention = _SplitKeyAttention()


def positional_attention(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float, window: int | None = None
) -> Tensor:
    """One-off form of :class:`AttentionPlan`."""
    return AttentionPlan(q_pos, q.dtype, window, q.shape[0] // k.shape[0])(q, k, v, scale)


class AttentionPlans:
    """One :class:`AttentionPlan` per distinct sliding window, built on first use."""

    def __init__(self, q_pos: Tensor, dtype: torch.dtype, groups: int,
                 kernel: PositionalAttention | None = None) -> None:
        self.q_pos, self.dtype, self.groups, self.kernel = q_pos, dtype, groups, kernel
        self._plans: dict[int | None, AttentionPlan] = {}

    def __getitem__(self, window: int | None) -> AttentionPlan:
        plan = self._plans.get(window)
        if plan is None:
            plan = self._plans[window] = AttentionPlan(self.q_pos, self.dtype, window, self.groups, self.kernel)
        return plan
