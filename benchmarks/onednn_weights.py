"""TTFT and decode with every product on oneDNN-reordered weights (``onednn_weights``, the
default) against the packed ``[in, out]`` weights through MKL, in one process, interleaved.

    .venv/bin/python benchmarks/onednn_weights.py --limit 3 --ratios 0.05,0.15 --rounds 2 \
        --answer-tokens 32 --data ../shared/data

Two engines on the same model, one per setting, alternating request by request on 6-passage
musique dev prompts (see ``ab_args.engine_ab``).  oneDNN takes a weight reordered once into
its blocked layout, where MKL re-packs the weight inside every product
(docs/internals/latency.md).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ab_args import ab_arguments, engine_ab

SETTINGS = {"MKL, packed [in, out]": {"onednn_weights": False}, "oneDNN, reordered": {"onednn_weights": True}}


if __name__ == "__main__":
    engine_ab(ab_arguments(__doc__), SETTINGS, "onednn_weights.py")
