"""Where the time goes: full prefill, blended prefill and one decode step, by phase and op.

    .venv/bin/python benchmarks/latency_profile.py --limit 3 --out docs/profile.json

On 6-passage musique dev prompts (the bench's main setting; ``--dataset`` for the
others), with the chunk caches in memory, each path runs once to warm up, then under
``torch.profiler``:

- **full prefill** and **blend at 15 %** (``--ratios`` for others) through ``Engine.generate`` with one new token
  (what TTFT is), with the engine's own phase timings (tokenize, lookup, load, prefill);
- **one decode step** after the full prompt (mean over ``--steps`` steps).

Ops are grouped into matmul (projections and MLP), attention, norm, elementwise (RoPE,
SiLU, residuals), indexing and copies, and other; "outside ops" is wall time no op
accounts for (Python, dispatch, the loader thread's hand-offs).  The engine's own kernels
(``cacheblend.native``) are not PyTorch ops, so the script labels each call
(``cacheblend::<name>``, :func:`label_native`) and counts them in their groups.  Figures go to the
console as tables and to ``--out`` as JSON; docs/performance.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from cacheblend import Engine, native
from cacheblend.bench.tasks import load_task
from cacheblend.blend.fusor import KVCache, Segment, fused_prefill
from cacheblend.config import BlendConfig
from cacheblend.datasets import QA_PREAMBLE
from cacheblend.generate.decode import decode_step
from cacheblend.native import LayerOps

GROUPS = {
    "matmul": ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::_mkldnn", "aten::mkldnn",
               "mkldnn::"),  # oneDNN's products on reordered weights (models/onednn.py)
    "attention": ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product", "aten::softmax",
                  "aten::_softmax", "aten::bmm", "aten::baddbmm", "aten::masked_fill",
                  "cacheblend::positional_attention", "cacheblend::decode_attention"),
    "norm": ("aten::rsqrt", "aten::pow", "aten::mean", "aten::var", "cacheblend::rms_norm"),
    "elementwise": ("aten::mul", "aten::add", "aten::silu", "aten::neg", "aten::sub", "aten::div", "aten::sigmoid",
                    "cacheblend::rope", "cacheblend::silu_mul", "cacheblend::reposition"),
    "indexing and copies": ("aten::index", "aten::index_put", "aten::index_select", "aten::gather", "aten::copy_",
                            "aten::cat", "aten::clone", "aten::contiguous", "aten::to", "aten::_to_copy",
                            "aten::slice", "aten::select", "aten::view", "aten::empty", "aten::zeros", "aten::stack",
                            "aten::repeat_interleave", "aten::expand", "aten::reshape", "aten::nonzero",
                            "aten::topk", "aten::sort"),
}


def group_of(name: str) -> str:
    for group, prefixes in GROUPS.items():
        if name.startswith(prefixes):
            return group
    return "other"


def profiled(fn, repeats: int = 1) -> dict:
    """Wall time of ``fn`` (mean over ``repeats``) and its ops' self CPU time by group."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        wall = (time.perf_counter() - t) / repeats
    ops = [e for e in prof.key_averages() if e.key.startswith(("aten::", "mkldnn::", "cacheblend::"))]
    groups: dict[str, float] = defaultdict(float)
    for e in ops:
        groups[group_of(e.key)] += e.self_cpu_time_total / 1e6 / repeats
    top = sorted(ops, key=lambda e: -e.self_cpu_time_total)[:12]
    in_ops = sum(groups.values())
    return {"wall_s": wall, "groups_s": dict(groups), "outside_ops_s": max(0.0, wall - in_ops),
            "top_ops": [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6 / repeats, "calls": e.count // repeats}
                        for e in top]}


def labelled(name: str, fn):
    """``fn`` run under a profiler label, so its time is counted (it is not a PyTorch op)."""
    def call(*args):
        with record_function(f"cacheblend::{name}"):
            return fn(*args)
    return call


def label_native(engine: Engine) -> None:
    """Label the decoder's native kernels and layer pieces, where they run."""
    dec = engine.decoder
    for attr, label in (("decode_attention", "decode_attention"), ("prefill_attention", "positional_attention")):
        if getattr(dec, attr) is not None:
            setattr(dec, attr, labelled(label, getattr(dec, attr)))
    ops = native.layer_ops()
    if dec.kernels.native and ops is not None:
        pieces = ("rms_norm", "rope", "rope_into", "silu_mul", "reposition")
        dec.kernels.use_native(LayerOps(*(labelled(f, getattr(ops, f)) for f in pieces)))


def blend_path(ratio: float) -> str:
    return f"blend {ratio * 100:g} %"


def run(engine: Engine, ex, steps: int, ratios: tuple[float, ...] = (0.15,), preamble: str = QA_PREAMBLE) -> dict:
    engine.ingest(ex.passages)
    out = {}
    paths = [("full prefill", {"method": "full"})] + [(blend_path(r), {"recompute_ratio": r}) for r in ratios]
    for name, opts in paths:
        def gen(o=opts):
            return engine.generate(ex.query, ex.passages, preamble=preamble, max_new_tokens=1, **o)

        gen()  # warm
        result: list = []
        out[name] = profiled(lambda g=gen, keep=result: keep.append(g()))
        out[name]["phases_s"] = {k: round(v, 4) for k, v in result[-1].stats.seconds.items()}
        out[name]["ttft_s"] = result[-1].ttft_s
    prompt = engine.prompts.build(ex.query, [engine.prompts.chunk_ids(p) for p in ex.passages], None, preamble)
    ids, shape = prompt.all_ids, engine.decoder.shape
    kv = KVCache(shape, len(ids) + steps + 2, engine.device)
    with torch.inference_mode():
        report = fused_prefill(engine.decoder, [Segment(ids)], kv, BlendConfig())
        token = int(report.logits.argmax())
        decode_step(engine.decoder, kv, token)  # warm
        out["decode step"] = profiled(lambda: decode_step(engine.decoder, kv, token), repeats=steps)
    out["prompt_tokens"] = len(ids)
    return out


def summarise(runs: list[dict]) -> dict:
    paths = [k for k in runs[0] if k != "prompt_tokens"]
    summary = {}
    for path in paths:
        rows = [r[path] for r in runs]
        groups = {g: statistics.median(r["groups_s"].get(g, 0.0) for r in rows) for g in (*GROUPS, "other")}
        summary[path] = {"wall_s": statistics.median(r["wall_s"] for r in rows), "groups_s": groups,
                         "outside_ops_s": statistics.median(r["outside_ops_s"] for r in rows),
                         "top_ops": rows[0]["top_ops"]}
        if "phases_s" in rows[0]:
            keys = rows[0]["phases_s"]
            summary[path]["phases_s"] = {k: statistics.median(r["phases_s"].get(k, 0.0) for r in rows) for k in keys}
    return summary


def print_tables(summary: dict) -> None:
    for path, s in summary.items():
        wall = s["wall_s"]
        print(f"\n## {path}: {wall * 1000:.1f} ms (median)")
        for g, v in sorted(s["groups_s"].items(), key=lambda kv: -kv[1]):
            print(f"  {g:22s} {v * 1000:9.1f} ms  {v / wall:6.1%}")
        print(f"  {'outside ops':22s} {s['outside_ops_s'] * 1000:9.1f} ms  {s['outside_ops_s'] / wall:6.1%}")
        if "phases_s" in s:
            print("  phases: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in s["phases_s"].items()))
        top = s["top_ops"][:6]
        print("  top ops: " + ", ".join(f"{o['op']} {o['self_s'] * 1000:.1f} ms/{o['calls']}" for o in top))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=3, help="dev prompts")
    ap.add_argument("--dataset", default="musique", help="the bench's data set (musique, hotpotqa, samsum, ...)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps to average")
    ap.add_argument("--data", default=None, help="data folder (default: $CACHEBLEND_DATA)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None, help="JSON output")
    ap.add_argument("--compile", action="store_true", help="Engine.load(compile=True)")
    ap.add_argument("--dtype", default=None, help="Engine.load(dtype=...), e.g. bfloat16")
    ap.add_argument("--ratios", default="0.15", help="blend recompute ratios, comma-separated")
    args = ap.parse_args()
    engine = Engine.load(args.model, store="memory", compile=args.compile, dtype=args.dtype)
    label_native(engine)
    task, examples = load_task(args.dataset, "dev", args.limit, 6, args.data)
    ratios = tuple(float(r) for r in args.ratios.split(","))
    runs = [run(engine, ex, args.steps, ratios, task.preamble) for ex in examples]
    summary = summarise(runs)
    print_tables(summary)
    if args.out:
        with open(args.out, "w") as f:
            given = " ".join(f"--{k} {v}" if v is not True else f"--{k}" for k, v in vars(args).items()
                             if v is not None and v is not False)
            json.dump({"command": f"benchmarks/latency_profile.py {given}", "threads": torch.get_num_threads(),
                       "prompt_tokens": [r["prompt_tokens"] for r in runs], "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
