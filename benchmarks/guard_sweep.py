"""Choose the quality guard's risk limit on dev, from a fidelity study's samples.

The guard runs a blend, and if its first-token risk (one minus the top-two margin) is
above ``max_risk`` it runs again at each rung of its ladder.  Every rung is a variant the
study already ran on the same prompts, so the guard's outcome at any limit can be read
off the samples without running it: the answer of the first rung whose risk is within
the limit (full prefill at the top: exact), and the TTFT of every rung it climbed.

    cacheblend bench --fidelity-only --split dev ... --variants "reuse;blend@0.15;blend@0.3" --json dev.json
    python benchmarks/guard_sweep.py dev.json --base "blend@0.15" --ladder "blend@0.3"

With ``--max-exposure`` it replays the guard's second limit too, on risk × exposure
(:mod:`cacheblend.blend.exposure`), which the base variant must have measured.

Prints, per limit, first-token agreement and KL against full prefill (95 % bootstrap
intervals), the share of prompts escalated and the median speed-up over full prefill.
Spearman's rho of the base variant's risk against its KL says how well the risk ranks
prompts.

Several studies (one per model) are replayed side by side.  ``--max-escalated`` then
picks the pair of limits the way the guard's defaults were picked: among the pairs that
escalate at most that share of the prompts in every study, the one with the highest
agreement in its worst study, then the fewest escalations.  The cap is what keeps the
median speed-up: once half the prompts escalate, the median is an escalated prompt's.

    python benchmarks/guard_sweep.py smol-dev.json qwen-dev.json --base "blend@0.15:max_exposure=1" \
        --max-exposure 0.015,0.02,0.025 --max-escalated 0.4
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

from cacheblend.bench.stats import bootstrap, spearman
from cacheblend.blend.exposure import within_guard
from cacheblend.config import BlendConfig

LIMITS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0)


def by_prompt(samples: list[dict]) -> dict[tuple[str, int], dict[str, dict]]:
    out: dict[tuple[str, int], dict[str, dict]] = defaultdict(dict)
    for s in samples:
        out[(s["dataset"], s["example"])][s["variant"]] = s
    return out


def trusted(s: dict, guard: BlendConfig) -> bool:
    """The engine's own test (:func:`cacheblend.blend.exposure.within_guard`) on one sample;
    a sample without a risk (no receipt) is taken as it is."""
    if s["risk"] is None:
        return True
    report = SimpleNamespace(exact=bool(s.get("exact")), risk=s["risk"], exposure=s.get("exposure"))
    return within_guard(report, guard)  # type: ignore[arg-type]


def simulate(prompts: dict, rungs: list[str], limit: float, max_exposure: float | None = None) -> dict:
    """The guard with ``rungs`` (base first; full prefill above the last) at ``limit`` (and
    ``max_exposure``: the base needs its exposure measured, ``...:max_exposure=1``)."""
    agree, kl, speed, escalated = [], [], [], 0
    guard = BlendConfig(max_risk=limit, max_exposure=max_exposure)
    for runs in prompts.values():
        spent = 0.0
        for name in rungs:
            s = runs[name]
            spent += s["ttft_s"]
            if trusted(s, guard):
                agree.append(s["agree"])
                kl.append(s["kl"])
                break
        else:  # every rung too risky: full prefill, exact
            spent += runs["full"]["ttft_s"]
            agree.append(1.0)
            kl.append(0.0)
        escalated += spent > runs[rungs[0]]["ttft_s"]
        speed.append(runs["full"]["ttft_s"] / spent)
    return {"limit": limit, "agree": bootstrap(agree), "kl": bootstrap(kl), "escalated": escalated / len(prompts),
            "speedup_median": statistics.median(speed)}


def choose(results: dict[tuple[float, float | None], list[dict]], max_escalated: float) -> tuple | None:
    """The pair of limits (max_risk, max_exposure) whose worst study agrees most, among
    those escalating at most ``max_escalated`` in every study; ties go to the pair with
    the fewest escalations (mean over the studies), then to the looser limits, which
    escalate less on prompts the studies did not see.  None when no pair is under the cap."""
    within = {pair: rs for pair, rs in results.items() if all(r["escalated"] <= max_escalated for r in rs)}
    if not within:
        return None
    return max(within, key=lambda pair: (min(r["agree"].mean for r in within[pair]),
                                         -statistics.mean(r["escalated"] for r in within[pair]),
                                         pair[0], math.inf if pair[1] is None else pair[1]))


def load(path: Path, rungs: list[str], dataset: str | None) -> dict:
    """One study's prompts that ran every rung and full prefill."""
    samples = json.loads(path.read_text())["samples"]
    if dataset:
        samples = [s for s in samples if s["dataset"] == dataset]
    prompts = {k: v for k, v in by_prompt(samples).items() if all(r in v for r in [*rungs, "full"])}
    if not prompts:
        raise SystemExit(f"{path}: no prompt has every variant of {rungs + ['full']}")
    return prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("study", type=Path, nargs="+",
                    help="JSON written by cacheblend bench --fidelity-only --json (several: one per model)")
    ap.add_argument("--base", default="blend@0.15", help="the variant the guard starts with")
    ap.add_argument("--ladder", default="", help="';'-separated variants climbed before full prefill")
    ap.add_argument("--dataset", default=None, help="only this data set")
    ap.add_argument("--max-exposure", default="", help="','-separated limits on risk × exposure to replay "
                    "with each max_risk (the base must have measured it: '...:max_exposure=1')")
    ap.add_argument("--max-escalated", type=float, default=None,
                    help="pick the pair of limits with the best worst-study agreement among those "
                         "escalating at most this share of prompts in every study")
    args = ap.parse_args()
    rungs = [args.base] + [r for r in args.ladder.split(";") if r]
    exposures: list[float | None] = [None, *(float(x) for x in args.max_exposure.split(",") if x)]
    studies = {path: load(path, rungs, args.dataset) for path in args.study}
    for path, prompts in studies.items():
        base = [p[args.base] for p in prompts.values()]
        rho = spearman([s["risk"] for s in base], [s["kl"] for s in base])
        print(f"{path}: {len(prompts)} prompts; rungs {rungs} then full prefill; "
              f"Spearman rho(risk, KL) of {args.base}: {rho:.2f}")
        if exposures[1:] and any(s.get("exposure") is None for s in base):
            raise SystemExit(f"{path}: {args.base} has no measured exposure; run it with ':max_exposure=1'")
        if exposures[1:]:
            rho_x = spearman([s["risk"] * s["exposure"] for s in base], [s["kl"] for s in base])
            print(f"Spearman rho(risk x exposure, KL): {rho_x:.2f}")
    names = [path.stem for path in studies] if len(studies) > 1 else [""]
    width = max(len(n) for n in names) + 2 if len(studies) > 1 else 0
    print(f"{'max_risk':>8}{'max_exp':>9}  {'':<{width}}{'1st agree':<24}{'KL':<24}{'escalated':>10}{'speed-up':>10}")
    results: dict[tuple[float, float | None], list[dict]] = {}
    for exposure in exposures:
        for limit in LIMITS:
            results[(limit, exposure)] = [simulate(p, rungs, limit, exposure) for p in studies.values()]
            for name, r in zip(names, results[(limit, exposure)], strict=True):
                print(f"{limit:>8.2f}{'-' if exposure is None else format(exposure, '.4f'):>9}  {name:<{width}}"
                      f"{r['agree']!s:<24}"
                      f"{r['kl']!s:<24}{r['escalated']:>10.0%}{r['speedup_median']:>9.2f}x")
    if args.max_escalated is not None:
        pair = choose(results, args.max_escalated)
        print(f"chosen (at most {args.max_escalated:.0%} escalated in every study): "
              + ("none" if pair is None else f"max_risk={pair[0]}, max_exposure={pair[1]}"))


if __name__ == "__main__":
    main()
