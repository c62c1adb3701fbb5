"""What a drop-in prompt with passages the engine has never seen costs on the first call.

A framework template pastes retrieved passages into one prompt (``"Context: {c}\\nQuestion: {q}"``).
The engine finds no cache for them: it computes them in place (as full prefill would) and
stores their caches in the background, so the next prompt that holds them reuses them.
Per musique dev example, in one process and one run (ratios hold on a noisy machine):

* ``full``   — ``method="full"`` on the same prompt (the reference cost);
* ``first``  — the first call with learning on (the passages are unseen);
* ``second`` — the same prompt again, after the background precompute finished.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/learn_first_call.py --data ../shared/data --limit 5
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from cacheblend import Engine
from cacheblend.datasets import load_qa


def _ttft(engine: Engine, messages: list[dict[str, str]], **options) -> tuple[float, dict]:
    run = engine.start_chat(messages, max_new_tokens=1, **options)
    for _ in run.pieces:
        pass
    assert run.result is not None
    return run.result.ttft_s, run.result.stats.as_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="the data folder (default: $CACHEBLEND_DATA)")
    ap.add_argument("--limit", type=int, default=5, help="musique dev examples")
    ap.add_argument("--passages", type=int, default=2, help="unseen passages per prompt")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.load(store="memory")
    rows = []
    for i, ex in enumerate(load_qa("musique", "dev", limit=args.limit, passages=args.passages, data=args.data)):
        context = "\n\n".join(p.strip() for p in ex.passages)
        messages = [{"role": "user", "content": f"Context: {context}\nQuestion: {ex.question}"}]
        first, stats = _ttft(engine, messages)
        engine.chunks.wait_learning()
        full, _ = _ttft(engine, messages, method="full")
        second, again = _ttft(engine, messages)
        rows.append({"example": i, "prompt_tokens": stats["prompt_tokens"], "learned": stats["chunks_learned"],
                     "full_s": full, "first_s": first, "second_s": second, "second_hits": again["store_hits"]})
        print(json.dumps(rows[-1]), flush=True)
    med = {k: statistics.median(r[k] for r in rows) for k in ("full_s", "first_s", "second_s")}
    print(json.dumps({"median": med, "first_over_full": med["first_s"] / med["full_s"],
                      "full_over_second": med["full_s"] / med["second_s"]}))


if __name__ == "__main__":
    main()
