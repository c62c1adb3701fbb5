"""Pool several fidelity studies run separately (one data set each) into one report.

A long study is safer run one data set at a time: each command writes its own JSON, so an
interrupted run loses one data set, not all of them.  This reads their samples, checks they
ran the same variants on the same split and model, and summarises them as one study would
have: per data set and pooled, each metric with its 95 % bootstrap interval and the paired
differences against the baseline (and against full reuse).

    for d in musique wikimqa hotpotqa samsum multi_news; do
      cacheblend bench --fidelity-only --dataset $d --split test --limit 50 --json test-$d.json --plots ''
    done
    python benchmarks/fidelity_merge.py test-*.json --json test.json --plots test-plots
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cacheblend.bench.fidelity import Sample, summarise, table
from cacheblend.bench.plots import fidelity_frontier


def load(paths: list[Path]) -> tuple[dict, list[Sample], float]:
    """The first study's settings, every sample, and the seconds all of them took."""
    first: dict | None = None
    samples: list[Sample] = []
    seconds = 0.0
    for path in paths:
        report = json.loads(path.read_text())
        study = report["study"]
        if first is None:
            first = study
        for key in ("split", "model", "chunks", "chunk_sink", "baselines"):
            if study[key] != first[key]:
                raise SystemExit(f"{path}: {key} is {study[key]!r}, the first study's is {first[key]!r}")
        samples += [Sample(**s) for s in report["samples"]]
        seconds += report.get("seconds", 0.0)
    assert first is not None
    return first, samples, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("studies", type=Path, nargs="+", help="JSON written by cacheblend bench --fidelity-only --json")
    ap.add_argument("--json", type=Path, default=None, help="write the pooled report here")
    ap.add_argument("--plots", type=Path, default=None, help="folder for fidelity_frontier.png")
    args = ap.parse_args()
    study, samples, seconds = load(args.studies)
    variants = list(dict.fromkeys(s.variant for s in samples if s.variant != "full"))
    datasets = list(dict.fromkeys(s.dataset for s in samples))
    per = {d: summarise([s for s in samples if s.dataset == d], variants, study["baselines"]) for d in datasets}
    pooled = summarise(samples, variants, study["baselines"])
    for d, recs in per.items():
        print(table(recs, f"{d} ({study['split']}, {study['chunks']} chunks, {study['model']})") + "\n")
    print(table(pooled, f"all data sets pooled ({study['split']}), {seconds / 60:.0f} min in all"))
    if args.json:
        merged = {**study, "datasets": per, "all": pooled}
        args.json.write_text(json.dumps({"command": "benchmarks/fidelity_merge.py " + " ".join(map(str, args.studies)),
                                         "study": merged, "samples": [vars(s) for s in samples],
                                         "seconds": seconds}, indent=2))
        print(f"records: {args.json}")
    if args.plots:
        args.plots.mkdir(parents=True, exist_ok=True)
        print(f"plot: {fidelity_frontier(pooled, args.plots / 'fidelity_frontier.png')}")


if __name__ == "__main__":
    main()
