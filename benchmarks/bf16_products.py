"""A bfloat16 engine's ingestion and full prefill against transformers' own bfloat16 forward on
the same prompt (about 680 tokens), phase by phase, with packed weights and without.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bf16_products.py [--tokens 552]

On a CPU without bfloat16 products in oneDNN (AVX2), the engine keeps transformers'
``[out, in]`` weights (``models/packed.packing_pays``). Packed ``[in, out]`` weights, which
``pack_weights=True`` forced before, ran ATen's fallback gemm about 12x slower
(docs/internals/latency.md). ``--force-pack`` measures that layout anyway.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch

from cacheblend import Engine
from cacheblend.models import packed
from cacheblend.models.loader import load_model, resolve_model_dir
from conftest import PASSAGES, QUERY


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=552, help="the passage's least length in tokens")
    ap.add_argument("--force-pack", action="store_true", help="pack the weights even where it does not pay")
    args = ap.parse_args()
    if args.force_pack:
        packed.bf16_products_native = lambda: True  # type: ignore[assignment] - the old rule
    folder = resolve_model_dir(None)
    engine = Engine.load(folder, dtype="bfloat16", store="memory")
    print(f"products: {engine.decoder.products}, attention: {engine.decoder.attention}, "
          f"bf16 products native: {packed.bf16_products_native()}")
    text = " ".join(PASSAGES)
    while len(engine.tokenizer(text)["input_ids"]) < args.tokens:
        text += " " + " ".join(PASSAGES)
    t = time.perf_counter()
    handles = engine.ingest([text])
    print(f"ingest             {time.perf_counter() - t:7.1f} s")
    t = time.perf_counter()
    result = engine.generate(QUERY, handles, method="full", max_new_tokens=1)
    print(f"full prefill       {time.perf_counter() - t:7.1f} s")
    prompt = engine.prompts.build(QUERY, [list(h.token_ids) for h in handles], None).all_ids
    hf = load_model(folder, dtype="bfloat16").model.eval()
    t = time.perf_counter()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[0, -1]
    print(f"transformers       {time.perf_counter() - t:7.1f} s  ({len(prompt)} tokens; "
          f"same first token: {int(logits.argmax()) == result.token_ids[0]})")


if __name__ == "__main__":
    main()
