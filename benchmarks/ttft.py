"""TTFT and first-token fidelity of full / prefix / reuse / blend on one set of prompts.

All methods run in ONE process on the same prompts, interleaved per example, so their
ratios are robust to a noisy shared machine.  Chunks (and the prefix caches) are stored
before timing: TTFT then covers tokenization, store lookups, fused prefill and the first
token, which is what a RAG server with a warm KV store pays.

    .venv/bin/python benchmarks/ttft.py --dataset musique --split dev --limit 10 --passages 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from tqdm import tqdm

from cacheblend import Engine
from cacheblend.datasets import QA_PREAMBLE, load_qa


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.float(), -1)
    q = torch.log_softmax(q_logits.float(), -1)
    return float((p.exp() * (p - q)).sum())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="musique")
    ap.add_argument("--split", default="dev", choices=["dev", "test"])
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--passages", type=int, default=6)
    ap.add_argument("--methods", default="full,prefix,reuse,blend", help="comma-separated; full is always run")
    ap.add_argument("--ratios", default="0.15,0.05", help="blend recompute ratios, comma-separated")
    ap.add_argument("--check-layers", default="1")
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the summary here")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    engine = Engine.load(args.model, store="memory")  # no background disk writes during timing
    examples = load_qa(args.dataset, args.split, limit=args.limit, passages=args.passages)
    check = tuple(int(x) for x in args.check_layers.split(","))
    methods = set(args.methods.split(",")) | {"full"}
    variants = [(m, {}) for m in ("full", "prefix", "reuse") if m in methods]
    if "blend" in methods:
        variants += [(f"blend@{float(r):g}", {"recompute_ratio": float(r), "check_layers": check})
                     for r in args.ratios.split(",")]
    rows: dict[str, dict[str, list[float]]] = {name: {"ttft": [], "agree": [], "kl": []} for name, _ in variants}
    prompt_tokens = []
    for ex in tqdm(examples, desc="examples", file=sys.stderr):
        handles = engine.ingest(ex.passages)  # ingestion, not timed
        common = dict(preamble=QA_PREAMBLE, max_new_tokens=1)
        engine.generate(ex.query, handles, method="prefix", **common)  # store the prefix caches
        engine.generate(ex.query, handles, method="reuse", **common)
        full_logits = None
        for name, opts in variants:
            method = name.split("@")[0]
            r = engine.generate(ex.query, handles, method=method, **common, **opts)
            if method == "full":
                full_logits = r.first_token_logits
                prompt_tokens.append(r.stats.prompt_tokens)
            row = rows[name]
            row["ttft"].append(r.ttft_s)
            row["agree"].append(float(int(r.first_token_logits.argmax()) == int(full_logits.argmax())))
            row["kl"].append(kl(full_logits, r.first_token_logits))

    full_median = statistics.median(rows["full"]["ttft"])
    summary = {
        "dataset": args.dataset, "split": args.split, "examples": len(examples), "passages": args.passages,
        "mean_prompt_tokens": statistics.mean(prompt_tokens), "threads": args.threads,
        "model": engine.model_name, "methods": {},
    }
    print(f"\n{args.dataset} {args.split}: {len(examples)} prompts, {args.passages} passages, "
          f"mean {summary['mean_prompt_tokens']:.0f} tokens, {args.threads} threads, model {engine.model_name}")
    print(f"{'method':<12}{'median TTFT s':>14}{'p90 s':>9}{'speed-up':>10}{'1st-token agree':>17}{'mean KL':>10}")
    for name, _ in variants:
        row = rows[name]
        med = statistics.median(row["ttft"])
        p90 = sorted(row["ttft"])[max(0, int(round(0.9 * len(row["ttft"]))) - 1)]
        rec = {"ttft_median_s": med, "ttft_p90_s": p90, "speedup_vs_full": full_median / med,
               "first_token_agreement": statistics.mean(row["agree"]), "kl_first_token": statistics.mean(row["kl"])}
        summary["methods"][name] = rec
        print(f"{name:<12}{med:>14.3f}{p90:>9.3f}{rec['speedup_vs_full']:>9.2f}x"
              f"{rec['first_token_agreement']:>16.0%}{rec['kl_first_token']:>10.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    main()
