"""TTFT and decode with each decode step run as one compiled graph (``compile_decode``)
against the eager layer-by-layer step, in one process, interleaved.

    .venv/bin/python benchmarks/compiled_decode.py --limit 3 --ratios 0.15 --rounds 2 \
        --answer-tokens 32 --data ../shared/data [--dtype bfloat16] [--with-prefill]

Two engines on the same model, one per setting, alternating request by request on 6-passage
musique dev prompts (see ``ab_args.engine_ab``).  The compiled engine pays its compile (or
its disk-cache load) on an untimed warm-up request first.  ``--with-prefill`` adds a third
engine that also compiles the prefill's elementwise parts (``compile=True``; its products run
on MKL's packed weights).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ab_args import ab_arguments, engine_ab

SETTINGS = {"eager step": {}, "compiled step": {"compile_decode": True}}


if __name__ == "__main__":
    args = ab_arguments(__doc__, lambda ap: ap.add_argument(
        "--with-prefill", action="store_true", help="a third engine with compile=True as well"))
    settings = dict(SETTINGS)
    if args.with_prefill:
        settings["compiled prefill + step"] = {"compile": True, "compile_decode": True}
    engine_ab(args, settings, "compiled_decode.py")
