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

``--earlier`` adds the variants of a study run before on the same prompts (the previous
default's test run, say), so that a new setting is compared with it without running it
again.  Full prefill is deterministic, so its samples must match this study's (the same
first-token margin on every shared prompt, or the merge stops) and are dropped; an
earlier variant's TTFT is rescaled by the two full prefills' TTFTs, so its speed-up stays
the one measured against its own run's full prefill.  ``--rename OLD=NEW`` renames
earlier variants whose meaning has changed (``blend@0.15`` before a default moved), and
``--baselines`` sets the variants paired differences are taken against.
"""

from __future__ import annotations

import argparse
import json
import sys
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


def parse_renames(pairs: list[str], variants: set[str]) -> dict[str, str]:
    """``OLD=NEW`` pairs; OLD may itself hold ``=`` (``blend@0.15:shift_share=0=hkvd``), so
    the split is the one whose left side is a variant of the earlier studies."""
    renames = {}
    for pair in pairs:
        cuts = [i for i, c in enumerate(pair) if c == "=" and pair[:i] in variants]
        if not cuts:
            raise SystemExit(f"--rename {pair!r}: no earlier variant before an '='; they are {sorted(variants)}")
        renames[pair[: cuts[-1]]] = pair[cuts[-1] + 1 :]
    return renames


def add_earlier(samples: list[Sample], paths: list[Path], pairs: list[str]) -> list[Sample]:
    """The earlier studies' variants on this study's prompts (see the module docstring)."""
    full = {(s.dataset, s.example): s for s in samples if s.variant == "full"}
    _, earlier, _ = load(paths)
    renames = parse_renames(pairs, {s.variant for s in earlier})
    their_full = {(s.dataset, s.example): s for s in earlier if s.variant == "full"}
    for key, mine in full.items():
        theirs = their_full.get(key)
        if theirs is not None and abs(theirs.margin - mine.margin) > 1e-4:
            raise SystemExit(f"{key}: full prefill's first-token margin is {theirs.margin:.6f} in the earlier "
                             f"study and {mine.margin:.6f} here: not the same prompt, model or code")
    names = {s.variant for s in samples}
    out = []
    for s in earlier:
        key = (s.dataset, s.example)
        if s.variant == "full" or key not in full or key not in their_full:
            continue
        name = renames.get(s.variant, s.variant)
        if name in names:
            raise SystemExit(f"earlier variant {s.variant!r} would be {name!r}, which this study ran: --rename it")
        scale = full[key].ttft_s / their_full[key].ttft_s
        out.append(Sample(**{**vars(s), "variant": name, "ttft_s": s.ttft_s * scale}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("studies", type=Path, nargs="+", help="JSON written by cacheblend bench --fidelity-only --json")
    ap.add_argument("--json", type=Path, default=None, help="write the pooled report here")
    ap.add_argument("--plots", default="", help="folder for fidelity_frontier.png ('': none)")
    ap.add_argument("--earlier", type=Path, action="append", default=[],
                    help="a study run before on the same prompts; its variants join this report")
    ap.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                    help="rename a variant of the --earlier studies")
    ap.add_argument("--baselines", default=None,
                    help="','-separated variants to take paired differences against (default: the studies')")
    args = ap.parse_args()
    study, samples, seconds = load(args.studies)
    if args.earlier:
        samples += add_earlier(samples, args.earlier, args.rename)
    if args.baselines:
        study = {**study, "baselines": [b.strip() for b in args.baselines.split(",") if b.strip()]}
    variants = list(dict.fromkeys(s.variant for s in samples if s.variant != "full"))
    datasets = list(dict.fromkeys(s.dataset for s in samples))
    per = {d: summarise([s for s in samples if s.dataset == d], variants, study["baselines"]) for d in datasets}
    pooled = summarise(samples, variants, study["baselines"])
    for d, recs in per.items():
        print(table(recs, f"{d} ({study['split']}, {study['chunks']} chunks, {study['model']})") + "\n")
    print(table(pooled, f"all data sets pooled ({study['split']}), {seconds / 60:.0f} min in all"))
    if args.json:
        merged = {**study, "datasets": per, "all": pooled}
        command = "benchmarks/fidelity_merge.py " + " ".join(sys.argv[1:])
        args.json.write_text(json.dumps({"command": command,
                                         "study": merged, "samples": [vars(s) for s in samples],
                                         "seconds": seconds}, indent=2))
        print(f"records: {args.json}")
    if args.plots:
        plots = Path(args.plots)
        plots.mkdir(parents=True, exist_ok=True)
        print(f"plot: {fidelity_frontier(pooled, plots / 'fidelity_frontier.png')}")


if __name__ == "__main__":
    main()
