"""TTFT of selection variants against full prefill, in one process, interleaved.

    .venv/bin/python benchmarks/selection_ttft.py --limit 5 --rounds 3 --data ../shared/data \
        --variants "blend@0.15;blend@0.15:selection=probe;blend@0.2:selection=probe"

The fidelity study (``cacheblend bench --fidelity-only``) times each variant once per
prompt; to compare the speed of two selections at their budgets this script runs full
prefill and every variant (written as for the study) ``--rounds`` times per 6-passage
musique dev prompt, in turn, and prints the median TTFT and the median speed-up over full
prefill (the median over prompts of full's median TTFT / the variant's).  Issue 13:
a new default must be no slower than today's 15 % HKVD blend.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from cacheblend import Engine
from cacheblend.bench.fidelity import parse_spec
from cacheblend.bench.tasks import load_task


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="blend@0.15;blend@0.15:selection=probe")
    ap.add_argument("--dataset", default="musique")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--chunks", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", default=None, help="data folder (default: $CACHEBLEND_DATA)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None, help="JSON output")
    args = ap.parse_args()
    torch.set_num_threads(2)
    specs = [parse_spec("full")] + [parse_spec(v) for v in args.variants.split(";") if v.strip()]
    engine = Engine.load(args.model, store="memory")
    task, examples = load_task(args.dataset, "dev", args.limit, args.chunks, args.data)
    ttft: dict[str, list[list[float]]] = {s.name: [] for s in specs}
    for ex in examples:
        handles = engine.ingest(ex.passages)
        engine.generate(ex.query, handles, method="reuse", max_new_tokens=1, preamble=task.preamble)  # warm
        times: dict[str, list[float]] = {s.name: [] for s in specs}
        for _ in range(args.rounds):
            for s in specs:
                r = engine.generate(ex.query, handles, max_new_tokens=1, preamble=task.preamble, **s.options)
                times[s.name].append(r.ttft_s)
        for name, t in times.items():
            ttft[name].append(t)
    full = [statistics.median(t) for t in ttft["full"]]
    rows = []
    for s in specs:
        med = [statistics.median(t) for t in ttft[s.name]]
        speed = statistics.median(f / m for f, m in zip(full, med, strict=True))
        rows.append({"variant": s.name, "ttft_s": statistics.median(med), "speed_up": speed, "per_prompt": med})
        print(f"{s.name:45s} TTFT {statistics.median(med):7.3f} s   speed-up {speed:5.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
