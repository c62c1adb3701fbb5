"""The decode step as it was (queries and keys rotated apart, transformers' RMSNorm module)
against today's (one RoPE over both, the fused RMSNorm), in one process, interleaved.

    .venv/bin/python benchmarks/decode_step_ops.py --limit 3 --steps 32 --rounds 3 --dtype bfloat16 \
        --data ../shared/data

Both run the same engine's weights and cache; only the per-layer ops differ (fewer ops per
layer, the same bits).  For each 6-passage musique dev prompt: full prefill, then
``--rounds`` rounds in which each variant decodes ``--steps`` greedy tokens from the same
prefilled cache.  Prints median ms/token per variant and whether the tokens were equal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from cacheblend import Engine
from cacheblend.blend.attention import AttentionPlans
from cacheblend.blend.fusor import KVCache, Segment, fused_prefill
from cacheblend.config import BlendConfig
from cacheblend.datasets import QA_PREAMBLE, load_qa
from cacheblend.generate.decode import append_and_attend, decode_step
from cacheblend.models import kernels


def _eight_op_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers' module computes it, op by op (the step's norm before)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def before_step(dec, kv: KVCache, token_id: int) -> torch.Tensor:
    """The decode step before: the op-by-op norm (the input norm, the MLP's and the final
    one), queries and keys rotated apart."""
    fused, dec.kernels.norm, kernels.rms_norm = dec.kernels.norm, _eight_op_norm, _eight_op_norm
    try:
        pos = kv.length
        positions = torch.tensor([pos])
        cos, sin = dec.rope_tables(positions)
        h = dec.embed(torch.tensor([token_id]))
        plans = AttentionPlans(positions, dec.shape.dtype, dec.shape.groups)
        for layer in range(dec.shape.num_layers):
            q, k, v = dec.qkv(layer, h)
            out = append_and_attend(dec, kv, layer, dec.rope(q, cos, sin), dec.rope(k, cos, sin), v, pos, plans)
            h = dec.finish(layer, h, out)
        kv.length = pos + 1
        return dec.logits(h)[0]
    finally:
        dec.kernels.norm = kernels.rms_norm = fused


def greedy(step, dec, kv: KVCache, start: int, first: int, steps: int) -> tuple[float, list[int]]:
    kv.length = start
    token, tokens = first, []
    t = time.perf_counter()
    for _ in range(steps):
        token = int(step(dec, kv, token).argmax())
        tokens.append(token)
    return 1000 * (time.perf_counter() - t) / steps, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--data", default=None)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    engine = Engine.load(args.model, store="memory", dtype=args.dtype)
    dec = engine.decoder
    steps = {"before": before_step, "now": decode_step}
    ms: dict[str, list[float]] = {k: [] for k in steps}
    same = True
    for i, ex in enumerate(load_qa("musique", "dev", limit=args.limit, passages=6, data=args.data)):
        ids = engine.prompts.build(ex.query, [engine.prompts.chunk_ids(p) for p in ex.passages], None,
                                   QA_PREAMBLE).all_ids
        kv = KVCache(dec.shape, len(ids) + args.steps + 2, "cpu")
        with torch.inference_mode():
            first = int(fused_prefill(dec, [Segment(ids)], kv, BlendConfig()).logits.argmax())
            for step in steps.values():
                greedy(step, dec, kv, len(ids), first, 4)  # warm
            for r in range(args.rounds):
                order = list(steps) if (i + r) % 2 == 0 else list(steps)[::-1]
                tokens = {}
                for name in order:
                    t, tokens[name] = greedy(steps[name], dec, kv, len(ids), first, args.steps)
                    ms[name].append(t)
                same &= tokens["before"] == tokens["now"]
        print(f"{len(ids)} tokens: before {ms['before'][-1]:.1f}, now {ms['now'][-1]:.1f} ms/token", flush=True)
    b, n = statistics.median(ms["before"]), statistics.median(ms["now"])
    print(f"median ms/token: before {b:.1f}, now {n:.1f} ({b / n:.3f}x); same tokens: {same}; "
          f"dtype {dec.shape.dtype}")


if __name__ == "__main__":
    main()
