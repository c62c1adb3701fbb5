"""The fidelity study (``cacheblend bench --fidelity-only``): how close each variant's
answer is to full prefill's, with 95 % bootstrap intervals, on the same prompts.

A *variant* is a method plus request options, written ``method[@ratio][:field=value...]``,
e.g. ``blend@0.15``, ``blend@0.15:selection=impact:chunk_heads=2`` or
``blend@guard:max_risk=0.5``; fields are :class:`~cacheblend.config.RequestOptions`'
(``check_layers=1+2`` for several layers).  Every variant runs once per prompt right after
full prefill, which is the reference: first-token agreement, first-token KL(full ‖
variant), the probability the variant gives full prefill's first token, token F1 of the
greedy output against full prefill's, gold quality, TTFT, and the fidelity receipt
(ratio used, risk, guard escalation).  Timing is single-shot (speed-ups are medians of
ratios over many prompts, not repeated timings of one).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from tqdm import tqdm

from ..config import RATIO_MODES, RequestOptions
from ..errors import CacheBlendError
from .metrics import kl_first_token, output_f1, quality
from .stats import bootstrap, paired, spearman
from .tasks import Example, Task

METRICS = ("agree", "kl", "p_full", "output_f1", "quality")


@dataclass(frozen=True)
class Spec:
    """One variant: its name as written, and the request options it sets."""

    name: str
    options: dict[str, Any]

    @property
    def method(self) -> str:
        return str(self.options.get("method", "blend"))


def _value(field: str, text: str) -> Any:
    default = getattr(RequestOptions(), field)
    if field == "check_layers":
        return tuple(int(x) for x in text.split("+"))
    if field in ("max_risk", "max_exposure", "timeout"):
        return None if text == "none" else float(text)
    if isinstance(default, bool):
        if text not in ("true", "false"):
            raise CacheBlendError(f"{field} must be true or false, got {text!r}")
        return text == "true"
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float):
        return float(text)
    return text


def parse_spec(text: str) -> Spec:
    """``method[@ratio][:field=value...]`` -> Spec, checked by RequestOptions (a bad one is a
    one-line error before any model work)."""
    head, *rest = text.strip().split(":")
    method, _, ratio = head.partition("@")
    options: dict[str, Any] = {"method": method}
    try:
        if ratio:
            options["recompute_ratio"] = ratio if ratio in RATIO_MODES else float(ratio)
    except ValueError:
        raise CacheBlendError(f"variant {text!r}: the ratio must be a number, 'auto' or 'guard'") from None
    names = {f.name for f in fields(RequestOptions)}
    for part in rest:
        key, eq, value = part.partition("=")
        if not eq or key not in names:
            raise CacheBlendError(f"variant {text!r}: {part!r} is not field=value of a request option")
        try:
            options[key] = _value(key, value)
        except ValueError as e:
            raise CacheBlendError(f"variant {text!r}: {e}") from None
    RequestOptions.parse(options)
    return Spec(text.strip(), options)


@dataclass
class Sample:
    """One variant on one prompt."""

    dataset: str
    example: int
    variant: str
    agree: float
    kl: float
    p_full: float  # probability the variant gives full prefill's first token
    margin: float  # the variant's own top-1 minus top-2 first-token probability
    output_f1: float
    quality: float
    ttft_s: float
    ratio_used: float
    risk: float | None
    escalated: bool
    exact: bool
    exposure: float | None = None  # samples of studies before the exposure have none


def prompt_tokens(engine, task: Task, ex: Example, system: str | None = None) -> int:
    """Tokens of ``ex``'s full prompt, chunks precomputed behind the engine's sink included."""
    chunks = [engine.prompts.chunk_ids(p) for p in ex.passages]
    sink = len(engine.prompts.sink_ids(engine.chunk_sink))
    return len(engine.prompts.build(ex.query, chunks, system, task.preamble).all_ids) + sink


def run(engine, task: Task, examples: list[Example], specs: list[Spec], max_new_tokens: int | None = None,
        start: int = 0, system: str | None = None, skipped: list[dict] | None = None) -> list[Sample]:
    """Full prefill and every variant on every example (chunks ingested before timing).

    An example whose prompt and answer do not fit the model's context is skipped (and listed
    in ``skipped``) rather than ending the study: the same examples are skipped on every run
    with the same model and sink, so runs stay paired by prompt."""
    out: list[Sample] = []
    new_tokens = max_new_tokens or task.max_new_tokens
    common = dict(preamble=task.preamble, stop=task.stop, max_new_tokens=new_tokens, system=system)
    full = Spec("full", {"method": "full"})
    for i, ex in enumerate(tqdm(examples, desc=task.name, unit="prompt")):
        n = prompt_tokens(engine, task, ex, system)
        if n + new_tokens > engine.context_length:
            tqdm.write(f"{task.name} example {start + i}: {n} prompt tokens do not fit the model's context of "
                       f"{engine.context_length} with {new_tokens} to generate; skipped")
            if skipped is not None:
                skipped.append({"dataset": task.name, "example": start + i, "tokens": n})
            continue
        handles = engine.ingest(ex.passages)
        engine.generate(ex.query, handles, method="reuse", max_new_tokens=1, preamble=task.preamble,
                        system=system)  # the prefix
        engine.kv_pool.reserve(engine.decoder.shape, n + new_tokens, engine.device)  # every method alike
        ref = None
        for spec in [full, *specs]:
            r = engine.generate(ex.query, handles, **{**common, **spec.options})
            if ref is None:
                ref = r
            p, q = ref.first_token_logits, r.first_token_logits
            top = int(p.argmax())
            s = r.stats
            probs = torch.softmax(q.float(), -1)
            two = torch.topk(probs, 2).values
            out.append(Sample(
                dataset=task.name, example=start + i, variant=spec.name, agree=float(int(q.argmax()) == top),
                kl=kl_first_token(p, q), p_full=float(probs[top]), margin=float(two[0] - two[1]),
                output_f1=output_f1(r.text, ref.text), quality=quality(task.metric, r.text, ex.answers),
                ttft_s=r.ttft_s, ratio_used=s.ratio_used, risk=s.risk, exposure=s.exposure,
                escalated=s.escalated, exact=s.exact))
    return out


def _by(samples: list[Sample], variant: str) -> list[Sample]:
    return sorted((s for s in samples if s.variant == variant), key=lambda s: (s.dataset, s.example))


def summarise(samples: list[Sample], variants: list[str], baselines: list[str]) -> list[dict]:
    """Per variant: each metric with its interval, the median TTFT speed-up over full prefill
    (median over prompts of full's TTFT / the variant's), the guard's escalation rate, the
    risk's rank correlation with KL, and paired differences against each baseline."""
    full = {(s.dataset, s.example): s.ttft_s for s in samples if s.variant == "full"}
    records = []
    for v in variants:
        mine = _by(samples, v)
        rec: dict[str, Any] = {"variant": v, "prompts": len(mine)}
        for m in METRICS:
            rec[m] = bootstrap([getattr(s, m) for s in mine]).as_dict()
        rec["speedup_median"] = statistics.median(full[(s.dataset, s.example)] / s.ttft_s for s in mine)
        rec["ratio_used_mean"] = statistics.mean(s.ratio_used for s in mine)
        rec["escalated"] = statistics.mean(float(s.escalated) for s in mine)
        rec["exact"] = statistics.mean(float(s.exact) for s in mine)
        risky = [s for s in mine if s.risk is not None]
        rec["risk_spearman_kl"] = _rho_kl(risky, lambda s: s.risk)
        rec["exposure_spearman_kl"] = _rho_kl([s for s in risky if s.exposure is not None],
                                              lambda s: float(s.risk) * float(s.exposure))  # type: ignore[arg-type]
        rec["vs"] = {}
        for b in baselines:
            base = _by(samples, b)
            if b == v or len(base) != len(mine):
                continue
            rec["vs"][b] = {m: paired([getattr(s, m) for s in mine], [getattr(s, m) for s in base]).as_dict()
                            for m in ("agree", "kl", "output_f1")}
        records.append(rec)
    return records


def _rho_kl(samples: list[Sample], signal: Callable[[Sample], Any]) -> float | None:
    """Spearman's rho of ``signal`` against the first-token KL; None where undefined."""
    rho = spearman([float(signal(s)) for s in samples], [s.kl for s in samples]) if samples else math.nan
    return None if math.isnan(rho) else rho


def samples_as_dicts(samples: list[Sample]) -> list[dict]:
    return [asdict(s) for s in samples]


def table(records: list[dict], title: str) -> str:
    """The records as a fixed-width table (mean [95 % interval]); rho and rhoX: Spearman's
    rank correlation with KL of the risk and of risk × exposure."""
    def iv(d: dict) -> str:
        return f"{d['mean']:.3f} [{d['low']:.3f},{d['high']:.3f}]"

    lines = [title, f"{'variant':<48}{'n':>4}{'speed-up':>9}  {'1st agree':<22}{'KL':<22}{'out F1':<22}"
                    f"{'ratio':>6}{'esc':>5}{'rho':>6}{'rhoX':>6}"]
    for r in records:
        rho, rho_x = r["risk_spearman_kl"], r.get("exposure_spearman_kl")
        lines.append(f"{r['variant']:<48}{r['prompts']:>4}{r['speedup_median']:>8.2f}x  {iv(r['agree']):<22}"
                     f"{iv(r['kl']):<22}{iv(r['output_f1']):<22}{r['ratio_used_mean']:>6.2f}{r['escalated']:>5.0%}"
                     f"{'' if rho is None else format(rho, '.2f'):>6}"
                     f"{'' if rho_x is None else format(rho_x, '.2f'):>6}")
    return "\n".join(lines)


def _signed(d: dict) -> str:
    return f"{d['mean']:+.3f} [{d['low']:+.3f},{d['high']:+.3f}]"


def specs_of(variants: str | None, baseline: str) -> tuple[list[Spec], str]:
    """The variants to run, parsed and checked, and the baseline's name: a variant with the
    baseline's options is the baseline (it runs once); otherwise the baseline runs first."""
    from .command import DEFAULT_VARIANTS

    texts = [t for t in (variants or DEFAULT_VARIANTS).split(";") if t.strip()]
    specs = [parse_spec(t) for t in texts]
    base = parse_spec(baseline)
    same = [s for s in specs if RequestOptions.parse(s.options) == RequestOptions.parse(base.options)]
    if same:
        return specs, same[0].name
    return [base, *specs], base.name


def study(engine, args, datasets: list[str], chunks: int) -> dict[str, Any]:
    """Run the study over ``datasets`` and print a table per data set and pooled."""
    from .tasks import load_task

    specs, baseline = specs_of(args.variants, args.baseline)
    names = [s.name for s in specs]
    samples: list[Sample] = []
    skipped: list[dict] = []
    system = getattr(args, "system", None)
    for d in datasets:
        task, examples = load_task(d, args.split, args.skip + args.limit, chunks, args.data)
        samples += run(engine, task, examples[args.skip:], specs, args.max_new_tokens, start=args.skip,
                       system=system, skipped=skipped)
    baselines = [baseline] + (["reuse"] if "reuse" in names and baseline != "reuse" else [])
    ran = [d for d in datasets if any(s.dataset == d for s in samples)]  # all of one may be skipped
    if not ran:
        raise CacheBlendError("no prompt of the study fits the model's context")
    per = {d: summarise([s for s in samples if s.dataset == d], names, baselines) for d in ran}
    pooled = summarise(samples, names, baselines)
    for d, recs in per.items():
        print("\n" + table(recs, f"{d} ({args.split}, {chunks} chunks, {engine.model_name})"))
    if len(ran) > 1:
        print("\n" + table(pooled, f"all data sets pooled ({args.split})"))
    print(f"\npaired differences against {baselines[0]} (pooled): agreement, KL")
    for r in pooled:
        vs = r["vs"].get(baselines[0])
        if vs:
            print(f"  {r['variant']:<48} {_signed(vs['agree'])}  {_signed(vs['kl'])}")
    return {"study": {"split": args.split, "chunks": chunks, "model": engine.model_name,
                      "chunk_sink": engine.chunk_sink, "system": system, "datasets": per,
                      "all": pooled, "baselines": baselines, "skipped": skipped},
            "samples": samples_as_dicts(samples)}
