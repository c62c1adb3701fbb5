"""Packed projection weights (fused, stored ``[in, out]``; ``models/packed.py``) against
transformers' ``nn.Linear`` layout, in one process, interleaved: decode ms/token and full
prefill time on the same prompts.

    .venv/bin/python benchmarks/decode_weights.py --limit 3 --steps 32 --rounds 3 --data ../shared/data

The model is loaded twice (one decoder packs, one runs the HF modules).  For each 6-passage
musique dev prompt: each decoder runs a full prefill (timed, alternating which goes first),
then ``--rounds`` rounds in which each decodes ``--steps`` greedy tokens from the same
prefilled cache (the module decoder's; the cache is rewound between runs).  Prints the
medians, the ratio, and whether both chose the same tokens.  Issue 15, deliverables 2-3.
"""

from __future__ import annotations

import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from decode_attention import decode_arguments, greedy_decode  # a sibling script

from cacheblend import Engine
from cacheblend.blend.fusor import KVCache, Segment, fused_prefill
from cacheblend.config import BlendConfig
from cacheblend.datasets import QA_PREAMBLE, load_qa
from cacheblend.models.decoder import Decoder
from cacheblend.models.loader import load_model


def prefill(dec: Decoder, ids: list[int], capacity: int) -> tuple[float, KVCache, int]:
    kv = KVCache(dec.shape, capacity, "cpu")
    t = time.perf_counter()
    first = int(fused_prefill(dec, [Segment(ids)], kv, BlendConfig()).logits.argmax())
    return time.perf_counter() - t, kv, first


def main() -> None:
    args = decode_arguments(__doc__.split("\n")[0]).parse_args()
    engine = Engine.load(args.model, store="memory")  # its decoder packs (the default)
    decoders = {"packed": engine.decoder, "modules": Decoder(load_model(args.model).model, pack=False)}
    assert engine.decoder.packed is not None, "this model's layers cannot be packed"
    decode_ms: dict[str, list[float]] = {k: [] for k in decoders}
    prefill_s: dict[str, list[float]] = {k: [] for k in decoders}
    same = True
    for i, ex in enumerate(load_qa("musique", "dev", limit=args.limit, passages=6, data=args.data)):
        prompt = engine.prompts.build(ex.query, [engine.prompts.chunk_ids(p) for p in ex.passages], None,
                                      QA_PREAMBLE)
        ids, capacity = prompt.all_ids, len(prompt.all_ids) + args.steps + 2
        with torch.inference_mode():
            order = list(decoders) if i % 2 == 0 else list(decoders)[::-1]
            firsts = {}
            for name in order:
                seconds, kv, firsts[name] = prefill(decoders[name], ids, capacity)
                prefill_s[name].append(seconds)
            same &= firsts["packed"] == firsts["modules"]
            for dec in decoders.values():  # warm up
                greedy_decode(dec, kv, len(ids), firsts["modules"], 4)
            for _ in range(args.rounds):
                tokens = {}
                for name in order:
                    ms, tokens[name] = greedy_decode(decoders[name], kv, len(ids), firsts["modules"], args.steps)
                    decode_ms[name].append(ms)
                same &= tokens["packed"] == tokens["modules"]
        print(f"{len(ids)} tokens: prefill packed {prefill_s['packed'][-1]:.2f} s, modules "
              f"{prefill_s['modules'][-1]:.2f} s; decode packed {decode_ms['packed'][-1]:.1f}, modules "
              f"{decode_ms['modules'][-1]:.1f} ms/token", flush=True)
    summary = {"decode_ms_per_token": {k: statistics.median(v) for k, v in decode_ms.items()},
               "prefill_s": {k: statistics.median(v) for k, v in prefill_s.items()}}
    d, p = summary["decode_ms_per_token"], summary["prefill_s"]
    print(f"median decode ms/token: packed {d['packed']:.1f}, modules {d['modules']:.1f} "
          f"({d['modules'] / d['packed']:.2f}x); median full prefill: packed {p['packed']:.2f} s, "
          f"modules {p['modules']:.2f} s ({p['modules'] / p['packed']:.2f}x); same tokens: {same}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**summary, "decode_runs": decode_ms, "prefill_runs": prefill_s, "same_tokens": same,
                       "steps": args.steps, "torch_threads": torch.get_num_threads()}, f, indent=1)


if __name__ == "__main__":
    main()
