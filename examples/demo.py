"""The main job: ingest a small corpus, then answer one question with full prefill and
with CacheBlend, printing each answer and its time-to-first-token.

Passages come from the musique dev split in the data directory ($CACHEBLEND_DATA, by
default ../shared/data beside the checkout: the paper's data); without it, the few
passages in examples/corpus/ are used.

    make demo            # or: .venv/bin/python examples/demo.py
"""

from __future__ import annotations

import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("CACHEBLEND_DATA", str(Path(__file__).resolve().parents[2] / "shared" / "data"))  # repo layout

import torch

from cacheblend import Engine
from cacheblend.datasets import QA_PREAMBLE, QA_QUERY, load_qa


def corpus() -> tuple[list[str], str, list[str]]:
    try:
        ex = load_qa("musique", "dev", limit=1, passages=6)[0]
        return ex.passages, ex.question, ex.answers
    except FileNotFoundError:
        folder = Path(__file__).parent / "corpus"
        passages = [p.read_text().strip() for p in sorted(folder.glob("*.txt"))]
        return passages, "Which river flows through the city where Ida Haendel was born?", ["Uherka"]


def main() -> None:
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    t = time.perf_counter()
    engine = Engine.load()  # SmolLM2-135M-Instruct, converted once into the cache dir
    print(f"model {engine.model_name} loaded in {time.perf_counter() - t:.1f} s")

    passages, question, gold = corpus()
    t = time.perf_counter()
    handles = engine.ingest(passages)  # KV precomputed once, stored (memory + disk)
    tokens = sum(h.num_tokens for h in handles)
    print(f"ingested {len(handles)} passages ({tokens} tokens) in {time.perf_counter() - t:.1f} s")
    print(f"\nQuestion: {question}\nGold: {' | '.join(gold)}\n")

    query = QA_QUERY.format(question=question)
    results = {}
    for method in ("full", "blend"):
        r = engine.generate(query, handles, preamble=QA_PREAMBLE, method=method,
                            recompute_ratio=0.15, max_new_tokens=24)
        results[method] = r
        s = r.stats
        print(f"[{method:>5}] TTFT {r.ttft_s:6.2f} s | {s.prompt_tokens} prompt tokens: "
              f"{s.reused_tokens} reused, {s.recomputed_tokens} recomputed, {s.computed_tokens} computed")
        print(f"        answer: {r.text.strip()!r}")
    speedup = results["full"].ttft_s / results["blend"].ttft_s
    print(f"\nCacheBlend TTFT is {speedup:.1f}x lower than full prefill on this prompt.")


if __name__ == "__main__":
    main()
