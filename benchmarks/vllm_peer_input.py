"""Build an input file for ``cacheblend.bench.vllm_peer`` from a QA data set, with our own prompt layout.

The peer must see exactly the token ids our engine prefills, so the prompts are assembled
with ``cacheblend.prompt.PromptBuilder`` (chat-template prefix, chunks tokenized on their
own, question suffix).  ``warm`` is what a prefix cache could legitimately hold before the
question arrives: the system prefix and the first chunk.  Passages are repeated until the
prompt reaches ``--tokens``, so the prompt length can be chosen independently of the data.

    HF_HUB_OFFLINE=1 .venv-vllm/bin/python benchmarks/vllm_peer_input.py --n 2 --tokens 2000 \
        --data ../shared/data --out bench-out/vllm_peer_in.json

The data directory comes from ``--data DIR``, else ``$CACHEBLEND_DATA``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoTokenizer  # noqa: E402

from cacheblend.datasets import QA_PREAMBLE, data_file  # noqa: E402
from cacheblend.models.loader import resolve_model_dir  # noqa: E402
from cacheblend.prompt import PromptBuilder  # noqa: E402


def passages_of(example: dict) -> list[str]:
    """The example's passages as plain strings (the data sets store ``ctxs``)."""
    return [c["text"] for c in example["ctxs"] if c.get("text", "").strip()]


def build_prompt(builder: PromptBuilder, example: dict, tokens: int, index: int) -> dict:
    """One prompt of at most about ``tokens`` ids: passages cycled while they fit (at
    least one), so the length is chosen independently of the data."""
    texts = passages_of(example)
    chunks: list[list[int]] = []
    total = 0
    while texts:
        ids = builder.chunk_ids(texts[len(chunks) % len(texts)])
        if chunks and total + len(ids) > tokens:
            break
        chunks.append(ids)
        total += len(ids)
    question = example.get("question", "")
    prompt = builder.build(f"Question: {question}\nAnswer:", chunks, system=None, preamble=QA_PREAMBLE)
    return {"id": f"ex{index}", "ids": prompt.all_ids, "warm": prompt.prefix + chunks[0]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--data", default=None, metavar="DIR", help="the data directory; default: $CACHEBLEND_DATA")
    ap.add_argument("--file", default="musique_s.json", help="a QA file of the data directory (with ctxs)")
    ap.add_argument("--model", default=None, help="HF folder; default: the core's default model")
    ap.add_argument("--n", type=int, default=2, help="number of prompts")
    ap.add_argument("--tokens", type=int, default=2000, help="approximate prompt length")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        data = data_file(args.file, args.data)
    except FileNotFoundError as e:
        raise SystemExit(f"vllm_peer_input: {e}") from None

    model = str(resolve_model_dir(args.model))
    builder = PromptBuilder(AutoTokenizer.from_pretrained(model))
    examples = json.loads(data.read_text())[: args.n]
    prompts = [build_prompt(builder, ex, args.tokens, k) for k, ex in enumerate(examples)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": model, "dtype": "float32", "prompts": prompts}))
    print(f"{args.out}: {[len(p['ids']) for p in prompts]} tokens, warm {[len(p['warm']) for p in prompts]}")


if __name__ == "__main__":
    main()
