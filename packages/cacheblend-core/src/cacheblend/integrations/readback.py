"""The self-check's last step: vLLM's own attention reads a reference chunk back.

:func:`~cacheblend.integrations.paged.self_check` proves that K/V written through vLLM's
cache-update op land where the derived layout says.  It does not prove that the backend's
attention *reads* them from there, with the same head order, K/V halves and positions:
that is what would decide a wrong answer.  So, still at start-up, the core's reference
chunk is written into a scratch block of every layer, and the backend's own attention
runs on it as a short prefill of that chunk (one request, causal, its queries seeded
random numbers), through the backend's own metadata builder: whatever vLLM's attention
makes of the block is compared with the attention the core computes in float32 from the
same K/V.  A difference beyond the cache dtype's rounding turns blending off.

Backend-independent by construction: the request is described to the backend as vLLM's
model runner describes one (``CommonAttentionMetadata``), and the backend builds its own
metadata from it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..blend.attention import positional_attention
from ..store import ChunkKV
from .paged import SCRATCH_BLOCK, LayoutCheck, PagedKV, backend_name, self_check

# largest |vLLM - reference| / max|reference| accepted, by cache dtype (rounding of the
# cache and of the kernel's accumulation; a misread block is off by order one)
TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def reference_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """The core's causal attention of ``q`` ``[n, heads, d]`` over ``k``, ``v`` ``[kv_heads,
    n, d]``, in float32: ``[n, heads, d]``."""
    n = q.shape[0]
    return positional_attention(q.float().transpose(0, 1), k.float(), v.float(), torch.arange(n), scale).transpose(0, 1)


def mismatch(out: Tensor, ref: Tensor) -> float:
    """Largest absolute difference, relative to the reference's largest magnitude."""
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def one_request(block_ids: list[int], n: int, block_size: int, device: torch.device) -> Any:
    """vLLM's description of one request prefilling ``n`` tokens held in ``block_ids``."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    start = torch.tensor([0, n], dtype=torch.int32)
    table = torch.tensor([block_ids], dtype=torch.int32)
    pos = torch.arange(n)
    slots = table[0, pos // block_size].long() * block_size + pos % block_size
    return CommonAttentionMetadata(
        query_start_loc=start.to(device), query_start_loc_cpu=start, seq_lens=torch.tensor([n], dtype=torch.int32,
                                                                                            device=device),
        num_reqs=1, num_actual_tokens=n, max_query_len=n, max_seq_len=n, block_table_tensor=table.to(device),
        slot_mapping=slots.to(device), causal=True)


def attention_readback(paged: PagedKV, names: list[str], vllm_config: Any, kv_cache_config: Any,
                       probe_k: Tensor, probe_v: Tensor, block: int = SCRATCH_BLOCK) -> str | None:
    """Run every layer's attention on the reference ``probe_k``/``probe_v`` ``[layers,
    kv_heads, n, head_dim]`` written into ``block``; None when all of them match the core's
    float32 attention, else why not.  ``block`` is the block the attention is told to read
    (a test points it elsewhere to see the check fail)."""
    groups = {name: g.kv_cache_spec for g in kv_cache_config.kv_cache_groups for name in g.layer_names}
    n, cache = probe_k.shape[2], paged.caches[0]
    tol = TOLERANCE.get(cache.dtype, 5e-2)
    gen = torch.Generator().manual_seed(0)
    with paged.scratch() as scratch:
        paged.write([scratch], 0, probe_k, probe_v)
        built: dict[int, Any] = {}
        for i, (name, layer) in enumerate(zip(names, paged.layers, strict=True)):
            impl, spec = layer.impl, groups[name]
            if id(spec) not in built:  # one metadata per KV cache group, built by the backend
                builder = layer.attn_backend.get_builder_cls()(spec, [name], vllm_config, cache.device)
                built[id(spec)] = builder.build(0, one_request([block], n, paged.block_size, cache.device))
            q = torch.randn(n, impl.num_heads, probe_k.shape[3], generator=gen).to(cache.dtype)
            out = torch.zeros_like(q)
            empty = torch.empty(n, impl.num_kv_heads, probe_k.shape[3], dtype=cache.dtype)
            impl.forward(layer, q, empty, empty, paged.caches[i], built[id(spec)], out)
            ref = reference_attention(q, probe_k[i].to(cache.dtype), probe_v[i].to(cache.dtype), impl.scale)
            err = mismatch(out, ref)
            if not err <= tol:
                return (f"vLLM's attention read the reference chunk back wrong at layer {i} "
                        f"({err:.2g} off, tolerance {tol:g})")
    return None


def verify(paged: PagedKV, names: list[str], vllm_config: Any, kv_cache_config: Any,
           probe_k: Tensor, probe_v: Tensor) -> LayoutCheck:
    """The connector's whole start-up self-check: the layout (:func:`self_check`: derived
    from vLLM's op, a round trip of the reference chunk), then vLLM's attention reading the
    reference back.  Sets ``paged.layout`` only when every step holds."""
    check = self_check(paged, probe_k, probe_v)
    if not check.ok:
        return check
    try:
        problem = attention_readback(paged, names, vllm_config, kv_cache_config, probe_k, probe_v)
    except Exception as e:  # noqa: BLE001 - a backend the check cannot drive is not verified
        problem = f"vLLM's attention could not run on the reference chunk: {type(e).__name__}: {e}"
    if problem:
        paged.layout = None
        return LayoutCheck(False, check.backend, problem)
    return LayoutCheck(True, check.backend, f"{check.reason}; vLLM's attention read it back as the core computes it")


def start_up_check(paged: PagedKV, names: list[str], vllm_config: Any, kv_cache_config: Any,
                   reference: Callable[[], ChunkKV], rope: Callable[[], str | None]) -> LayoutCheck:
    """The verdict a worker reports at start-up: :func:`verify` on the reference chunk K/V
    that ``reference()`` computes (the core engine loads on first call), then ``rope()``,
    which says why vLLM's RoPE differs from the core's, if it does
    (:func:`.rope_check.rope_problem`); never an exception.
    The worker's fused prefill runs on the CPU, so KV caches on another device (a CUDA
    backend) are refused before anything loads, and a check that cannot run at all is a
    failed check: either way the server answers as plain vLLM, with the reason in its log."""
    backend = backend_name(paged.layers[0])
    devices = sorted({str(c.device) for c in paged.caches})
    if devices != ["cpu"]:
        return LayoutCheck(False, backend, f"vLLM's KV caches are on {', '.join(devices)}; the connector's "
                                           "worker blends on the CPU only")
    try:
        probe = reference()
        check = verify(paged, names, vllm_config, kv_cache_config, probe.k, probe.v)
        if not check.ok:
            return check
        problem = rope()
        if problem:
            paged.layout = None
            return LayoutCheck(False, check.backend, problem)
        return LayoutCheck(True, check.backend, f"{check.reason}; vLLM's RoPE rotates as the core's")
    except Exception as e:  # noqa: BLE001 - a worker that cannot check its layout must not blend, nor crash
        paged.layout = None
        return LayoutCheck(False, backend, f"the self-check could not run: {type(e).__name__}: {e}")
