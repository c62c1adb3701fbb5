"""TTFT with the fused KV buffer kept between requests (``reuse_kv_buffer``, the default)
against a fresh buffer per request, in one process, interleaved.

    .venv/bin/python benchmarks/kv_reuse.py --limit 3 --ratios 0.05,0.15 --rounds 2 --data ../shared/data

Two engines on the same model, one per setting.  For each 6-passage musique dev prompt
(chunk caches in memory) and each round, each engine answers one token with full prefill
and at each ratio, alternating engines request by request, after one warm-up request per
engine and prompt.  A fresh buffer's pages are mapped on first write, so the difference is
the page faults of each request's K/V (issue 15; docs/internals/latency.md).  Prints the
median TTFT per setting and method, the speed-up of each blend over its own engine's full
prefill, and whether both settings gave the same first-token logits.
"""

from __future__ import annotations

import json
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from ab_args import ab_arguments

from cacheblend import Engine
from cacheblend.datasets import QA_PREAMBLE, load_qa

SETTINGS = {"fresh buffer per request": False, "kept buffer": True}


def main() -> None:
    args = ab_arguments(__doc__)
    methods = [("full", dict(method="full"))] + [
        (f"blend@{float(r):g}", dict(recompute_ratio=float(r))) for r in args.ratios.split(",")]
    engines = {name: Engine.load(args.model, store="memory", reuse_kv_buffer=keep)
               for name, keep in SETTINGS.items()}
    ttft: dict[str, dict[str, list[float]]] = {name: {} for name in SETTINGS}
    same, compared = 0, 0
    for ex in load_qa("musique", "dev", limit=args.limit, passages=6, data=args.data):
        for engine in engines.values():
            engine.ingest(ex.passages)
            engine.generate(ex.query, ex.passages, preamble=QA_PREAMBLE, max_new_tokens=1)  # warm-up
        for _ in range(args.rounds):
            for label, options in methods:
                logits = []
                for name, engine in engines.items():
                    r = engine.generate(ex.query, ex.passages, preamble=QA_PREAMBLE, max_new_tokens=1, **options)
                    ttft[name].setdefault(label, []).append(r.ttft_s)
                    logits.append(r.first_token_logits)
                same += bool(torch.equal(*logits))
                compared += 1
    summary = {}
    for name, per in ttft.items():
        full = statistics.median(per["full"])
        summary[name] = {label: {"ttft_s": statistics.median(v), "speedup_over_full": full / statistics.median(v),
                                 "runs": len(v)} for label, v in per.items()}
        for label, s in summary[name].items():
            print(f"{name:26s} {label:11s} {s['ttft_s'] * 1000:8.0f} ms  {s['speedup_over_full']:5.2f}x  "
                  f"({s['runs']} runs)")
    print(f"same first-token logits under both settings: {same}/{compared}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "benchmarks/kv_reuse.py " + " ".join(
                f"--{k} {v}" for k, v in vars(args).items() if v is not None),
                "threads": torch.get_num_threads(), "summary": summary,
                "same_first_token_logits": [same, compared], "ttft_s": ttft}, f, indent=2)


if __name__ == "__main__":
    main()
