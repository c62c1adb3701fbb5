"""Blend TTFT with the split attention plan (the keys before each bucket's first query
attended unmasked, merged by log-sum-exp) against one masked call per bucket, in one
process, interleaved.

    .venv/bin/python benchmarks/blend_attention.py --limit 3 --ratios 0.05,0.15 --rounds 2 --data ../shared/data

For each 6-passage musique dev prompt (chunk caches in memory): full prefill's TTFT (the
best of two), then ``--rounds`` rounds in which each plan answers one token at each ratio
after a warm-up answer.  Prints the median TTFT per plan and ratio, the speed-up over full
prefill, and whether both plans gave the same first token.  Issue 15, deliverable 4.
"""

from __future__ import annotations

import json
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from ab_args import ab_arguments

from cacheblend import Engine
from cacheblend.blend.attention import AttentionPlan
from cacheblend.datasets import QA_PREAMBLE, load_qa

PLANS = {"one masked call per bucket": False, "split at the first query": True}


def main() -> None:
    args = ab_arguments(__doc__)
    ratios = [float(r) for r in args.ratios.split(",")]
    engine = Engine.load(args.model, store="memory")
    ttft: dict[str, list[float]] = {}
    same, compared, prompt_tokens = 0, 0, []
    for ex in load_qa("musique", "dev", limit=args.limit, passages=6, data=args.data):
        engine.ingest(ex.passages)

        def answer(ex=ex, **options):
            return engine.generate(ex.query, ex.passages, preamble=QA_PREAMBLE, max_new_tokens=1, **options)

        answer(method="full")
        fulls = [answer(method="full") for _ in range(2)]
        ttft.setdefault("full", []).append(min(r.ttft_s for r in fulls))
        prompt_tokens.append(fulls[0].stats.prompt_tokens)
        for ratio in ratios:
            first = {}
            for _ in range(args.rounds):
                for name, split in PLANS.items():
                    AttentionPlan.SPLIT_PREFIX = split
                    answer(recompute_ratio=ratio)
                    result = answer(recompute_ratio=ratio)
                    ttft.setdefault(f"{name} @ {ratio}", []).append(result.ttft_s)
                    first[name] = result.token_ids[:1]
            same += len({tuple(t) for t in first.values()}) == 1
            compared += 1
    AttentionPlan.SPLIT_PREFIX = True
    full = statistics.median(ttft["full"])
    summary = {name: {"ttft_s": statistics.median(v), "speedup_over_full": full / statistics.median(v), "runs": len(v)}
               for name, v in ttft.items()}
    for name, s in summary.items():
        print(f"{name:40s} {s['ttft_s'] * 1000:8.0f} ms  {s['speedup_over_full']:5.2f}x  ({s['runs']} runs)")
    print(f"same first token under both plans: {same}/{compared}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "benchmarks/blend_attention.py " + " ".join(
                f"--{k} {v}" for k, v in vars(args).items() if v is not None),
                "threads": torch.get_num_threads(), "prompt_tokens": prompt_tokens, "summary": summary,
                "same_first_token": [same, compared], "ttft_s": ttft}, f, indent=2)


if __name__ == "__main__":
    main()
