"""TTFT and decode with the native attention kernels (``cacheblend.native``: the decode step's,
and the float32 prefill's by position) against PyTorch's kernels, in one process, interleaved.

    .venv/bin/python benchmarks/native_attention.py --limit 3 --ratios 0.15 --rounds 2 \
        --answer-tokens 32 --data ../shared/data [--dtype bfloat16] [--compile-decode]

Two engines on the same model that differ only in ``native_attention``, alternating request
by request on 6-passage musique dev prompts (see ``ab_args.engine_ab``); ``--compile-decode``
runs both with the compiled decode step.  In bf16 only the decode step changes (the prefill
keeps PyTorch's kernels), so TTFT should tie there.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ab_args import ab_arguments, engine_ab

if __name__ == "__main__":
    args = ab_arguments(__doc__, lambda ap: ap.add_argument(
        "--compile-decode", action="store_true", help="both engines run the compiled decode step"))
    both = {"compile_decode": True} if args.compile_decode else {}
    engine_ab(args, {"PyTorch attention": {**both, "native_attention": False},
                     "native attention": {**both, "native_attention": True}}, "native_attention.py")
