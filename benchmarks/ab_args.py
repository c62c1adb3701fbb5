"""The command line shared by the interleaved A/B scripts on musique dev prompts
(``blend_attention.py``, ``kv_reuse.py``)."""

from __future__ import annotations

import argparse


def ab_arguments(doc: str | None) -> argparse.Namespace:
    """``--limit`` prompts, ``--ratios``, ``--rounds``, ``--data``, ``--model``, ``--out``."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    ap.add_argument("--limit", type=int, default=3, help="musique dev prompts")
    ap.add_argument("--ratios", default="0.05,0.15")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--data", default=None, help="data folder (default: $CACHEBLEND_DATA)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None, help="JSON output")
    return ap.parse_args()
