"""TTFT with the fused KV buffer kept between requests (``reuse_kv_buffer``, the default)
against a fresh buffer per request, in one process, interleaved.

    .venv/bin/python benchmarks/kv_reuse.py --limit 3 --ratios 0.05,0.15 --rounds 2 --data ../shared/data

Two engines on the same model, one per setting.  For each 6-passage musique dev prompt
(chunk caches in memory) and each round, each engine answers one token with full prefill
and at each ratio, alternating engines request by request, after one warm-up request per
engine and prompt.  A fresh buffer's pages are mapped on first write, so the difference is
the page faults of each request's K/V (issue 15; docs/internals/latency.md).  Prints the
median TTFT per setting and method, the speed-up of each blend over its own engine's full
prefill, and whether both settings gave the same first-token logits.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ab_args import ab_arguments, engine_ab

SETTINGS = {"fresh buffer per request": {"reuse_kv_buffer": False}, "kept buffer": {"reuse_kv_buffer": True}}


if __name__ == "__main__":
    engine_ab(ab_arguments(__doc__), SETTINGS, "kv_reuse.py")
