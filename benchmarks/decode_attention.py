"""Decode ms/token with the split-key attention (two halves of the keys in one kernel
call, merged by log-sum-exp) against the single-call plan, in one process, interleaved.

    .venv/bin/python benchmarks/decode_attention.py --limit 3 --steps 32 --data ../shared/data

For each 6-passage musique dev prompt: full prefill once, then ``--rounds`` rounds in which
each variant decodes ``--steps`` greedy tokens from the same prefilled cache (the cache is
rewound between runs).  Prints ms/token per variant (median over rounds and prompts) and
whether both variants chose the same tokens.  Issue 15, deliverable 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from cacheblend import Engine
from cacheblend.blend.attention import split_key_attention
from cacheblend.blend.fusor import KVCache, Segment, fused_prefill
from cacheblend.config import BlendConfig
from cacheblend.datasets import QA_PREAMBLE, load_qa
from cacheblend.generate.decode import decode_step
from cacheblend.models.decoder import Decoder

SPLIT_ON = split_key_attention.MIN_KEYS
SPLIT_OFF = 1 << 62


def greedy_decode(dec: Decoder, kv: KVCache, n: int, first: int, steps: int) -> tuple[float, list[int]]:
    """Rewind ``kv`` to the prompt's ``n`` tokens and decode ``steps`` greedy tokens; ms/token."""
    kv.length, token, tokens = n, first, []
    t = time.perf_counter()
    for _ in range(steps):
        token = int(decode_step(dec, kv, token).argmax())
        tokens.append(token)
    return (time.perf_counter() - t) * 1000 / steps, tokens


def decode(engine: Engine, kv: KVCache, n: int, first: int, steps: int, min_keys: int) -> tuple[float, list[int]]:
    """:func:`greedy_decode` with the split applied from ``min_keys`` keys."""
    split_key_attention.MIN_KEYS = min_keys
    return greedy_decode(engine.decoder, kv, n, first, steps)


def decode_arguments(description: str) -> argparse.ArgumentParser:
    """The options every decode benchmark here takes."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--limit", type=int, default=3, help="musique dev prompts")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", default=None, help="data folder (default: $CACHEBLEND_DATA)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None, help="JSON output")
    return ap


def main() -> None:
    args = decode_arguments(__doc__.split("\n")[0]).parse_args()
    engine = Engine.load(args.model, store="memory")
    times: dict[str, list[float]] = {"split keys": [], "one call": []}
    same = True
    for ex in load_qa("musique", "dev", limit=args.limit, passages=6, data=args.data):
        prompt = engine.prompts.build(ex.query, [engine.prompts.chunk_ids(p) for p in ex.passages], None,
                                      QA_PREAMBLE)
        ids = prompt.all_ids
        kv = KVCache(engine.decoder.shape, len(ids) + args.steps + 2, engine.device)
        with torch.inference_mode():
            first = int(fused_prefill(engine.decoder, [Segment(ids)], kv, BlendConfig()).logits.argmax())
            decode(engine, kv, len(ids), first, 4, SPLIT_ON)  # warm both paths
            decode(engine, kv, len(ids), first, 4, SPLIT_OFF)
            for _ in range(args.rounds):
                ms_split, tok_split = decode(engine, kv, len(ids), first, args.steps, SPLIT_ON)
                ms_one, tok_one = decode(engine, kv, len(ids), first, args.steps, SPLIT_OFF)
                times["split keys"].append(ms_split)
                times["one call"].append(ms_one)
                same &= tok_split == tok_one
        print(f"{len(ids)} tokens: split {ms_split:.1f} ms/token, one call {ms_one:.1f} ms/token", flush=True)
    split_key_attention.MIN_KEYS = SPLIT_ON
    summary = {k: statistics.median(v) for k, v in times.items()}
    print(f"median ms/token: split keys {summary['split keys']:.1f}, one call {summary['one call']:.1f} "
          f"({summary['one call'] / summary['split keys']:.2f}x); same tokens: {same}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ms_per_token": summary, "runs": times, "same_tokens": same, "steps": args.steps,
                       "torch_threads": torch.get_num_threads()}, f, indent=1)


if __name__ == "__main__":
    main()
