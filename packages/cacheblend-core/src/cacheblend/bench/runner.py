"""Run every method on the same prompts, interleaved per example, and summarise.

All methods run in one process on the same prompts so their ratios hold on a noisy
machine.  Each example's chunks are ingested and its prefix caches stored before any
timing: TTFT then covers what a RAG server with a warm KV store pays (tokenization,
store lookups, fused prefill, first token).  Full prefill runs first on every example
and is the reference for the fidelity figures.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from tqdm import tqdm

from ..config import BlendConfig
from ..engine import Engine
from .latency import AnswerTiming, answer_latency
from .metrics import kl_first_token, mean, output_f1, p90, quality
from .tasks import Example, Task


@dataclass(frozen=True)
class Variant:
    """A method and its recompute ratio (None for methods without one)."""

    method: str
    ratio: float | None = None

    @property
    def name(self) -> str:
        return f"{self.method}@{self.ratio:g}" if self.method == "blend" else self.method


def variants(methods: list[str], ratios: list[float]) -> list[Variant]:
    out = [Variant("full")]
    out += [Variant(m) for m in ("prefix", "reuse") if m in methods]
    if "blend" in methods:
        out += [Variant("blend", r) for r in ratios]
    return out


@dataclass
class Sample:
    """One method on one prompt."""

    variant: str
    ttft_s: float
    quality: float
    agree: float
    kl: float
    output_f1: float
    prompt_tokens: int
    reused_tokens: int
    recomputed_tokens: int
    hits: int
    lookups: int
    first_token: int
    text: str = field(repr=False, default="")
    answer: AnswerTiming | None = None  # the fixed-length answer's timing (``answer_tokens``)


@dataclass
class BlendOptions:
    check_layers: tuple[int, ...] = (1,)
    gradual: bool = False


def run_examples(engine: Engine, task: Task, examples: list[Example], variants_: list[Variant],
                 options: BlendOptions, desc: str = "", answer_tokens: int = 0,
                 after_each: Callable[[dict], object] | None = None) -> tuple[list[Sample], list[dict]]:
    """Samples of every variant on every example, and the prompts as token ids (for peers).
    With ``answer_tokens``, each variant also answers once with exactly that many tokens
    (end to end: TTFT, decode ms per token, total time, memory).  ``after_each`` is called
    with each example's prompt once its variants ran (an interleaved peer times it then)."""
    samples: list[Sample] = []
    prompts: list[dict] = []
    common = dict(preamble=task.preamble, stop=task.stop)
    bar = tqdm(total=len(examples) * len(variants_), desc=desc or task.name, unit="run")
    for i, ex in enumerate(examples):
        handles = engine.ingest(ex.passages)  # ingestion, not timed
        if any(v.method == "prefix" for v in variants_):  # store the prefix caches each method reads
            engine.generate(ex.query, handles, method="prefix", max_new_tokens=1, **common)
        engine.generate(ex.query, handles, method="reuse", max_new_tokens=1, **common)
        prompt = engine.prompts.build(ex.query, [list(h.token_ids) for h in handles], None, task.preamble)
        first = len(prompt.prefix) + (handles[0].num_tokens if handles else 0)
        # one KV buffer for every method, before any is timed: else full prefill, timed
        # first, pays the larger buffer's page faults and holds two buffers in its peak
        n = len(prompt.all_ids)
        engine.kv_pool.reserve(engine.decoder.shape, n + min(max(task.max_new_tokens, answer_tokens),
                                                             engine.context_length - n), engine.device)
        prompts.append({"id": f"{task.name}-{i}", "ids": prompt.all_ids, "warm": prompt.all_ids[:first]})
        full = None
        for v in variants_:
            ratio = v.ratio if v.ratio is not None else BlendConfig.recompute_ratio
            blend = dict(method=v.method, recompute_ratio=ratio, check_layers=options.check_layers,
                         gradual=options.gradual)
            r = engine.generate(ex.query, handles, max_new_tokens=task.max_new_tokens, **blend, **common)
            answer = answer_latency(engine, ex.query, handles, answer_tokens, task.preamble, **blend) \
                if answer_tokens else None
            if full is None:
                full = r
            assert r.first_token_logits is not None and full.first_token_logits is not None
            s = r.stats
            samples.append(Sample(
                variant=v.name, ttft_s=r.ttft_s, quality=quality(task.metric, r.text, ex.answers),
                agree=float(int(r.first_token_logits.argmax()) == int(full.first_token_logits.argmax())),
                kl=kl_first_token(full.first_token_logits, r.first_token_logits),
                output_f1=output_f1(r.text, full.text), prompt_tokens=s.prompt_tokens,
                reused_tokens=s.reused_tokens, recomputed_tokens=s.recomputed_tokens,
                hits=s.store_hits, lookups=s.store_hits + s.store_misses,
                first_token=int(r.first_token_logits.argmax()), text=r.text, answer=answer,
            ))
            bar.update()
        if after_each is not None:
            after_each(prompts[-1])
    bar.close()
    return samples, prompts


def summarise(samples: list[Sample], variants_: list[Variant], base: dict) -> list[dict]:
    """One JSON record per variant: the issue's fields plus token counts."""
    full_ttft = statistics.median(s.ttft_s for s in samples if s.variant == "full")
    records = []
    for v in variants_:
        mine = [s for s in samples if s.variant == v.name]
        ttft = [s.ttft_s for s in mine]
        lookups = sum(s.lookups for s in mine)
        records.append({
            **base,
            "method": v.method,
            "recompute_ratio": {"full": 1.0, "prefix": None, "reuse": 0.0}.get(v.method, v.ratio),
            "variant": v.name,
            "examples": len(mine),
            "ttft_median_s": statistics.median(ttft),
            "ttft_p90_s": p90(ttft),
            "speedup_vs_full": full_ttft / statistics.median(ttft),
            "quality": mean([s.quality for s in mine]),
            "first_token_agreement": mean([s.agree for s in mine]),
            "kl_first_token": mean([s.kl for s in mine]),
            "output_f1_vs_full": mean([s.output_f1 for s in mine]),
            "store_hit_rate": (sum(s.hits for s in mine) / lookups) if lookups else None,
            "mean_prompt_tokens": mean([s.prompt_tokens for s in mine]),
            "mean_reused_tokens": mean([s.reused_tokens for s in mine]),
            "mean_recomputed_tokens": mean([s.recomputed_tokens for s in mine]),
            **answer_summary([s.answer for s in mine if s.answer is not None]),
        })
    return records


def answer_summary(answers: list[AnswerTiming]) -> dict:
    """Medians of the fixed-length answers (empty when none were timed)."""
    if not answers:
        return {}
    med = statistics.median
    return {"answer_tokens": answers[0].tokens,
            "answer_ttft_median_s": med(a.ttft_s for a in answers),
            "decode_ms_per_token": med(a.decode_ms_per_token for a in answers),
            "answer_total_median_s": med(a.total_s for a in answers),
            "peak_rss_mib": max(a.peak_rss_mib for a in answers),
            "rss_growth_mib": med(a.rss_growth_mib for a in answers)}
