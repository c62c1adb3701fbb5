"""Quality against gold (SQuAD F1, Rouge-L) and fidelity to full prefill (first-token
agreement and KL, token F1 of the greedy outputs)."""

from __future__ import annotations

import statistics

import torch

from ..datasets import best_f1, token_f1


def quality(metric: str, prediction: str, answers: list[str]) -> float:
    if metric == "f1":
        return best_f1(prediction, answers)
    if metric == "rougeL":
        return max((_rouge().score(gold, prediction)["rougeL"].fmeasure for gold in answers), default=0.0)
    raise ValueError(f"unknown metric {metric!r}")


_SCORER = None


def _rouge():
    global _SCORER
    if _SCORER is None:
        from rouge_score import rouge_scorer  # the reference implementation the field uses

        _SCORER = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return _SCORER


def kl_first_token(full_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(full ‖ method) of the first generated token's distribution."""
    p = torch.log_softmax(full_logits.float(), -1)
    q = torch.log_softmax(logits.float(), -1)
    return float((p.exp() * (p - q)).sum())


def output_f1(prediction: str, reference: str) -> float:
    """Token F1 of a greedy output against full prefill's greedy output: 1.0 for the same
    text, also one that normalises to no tokens (an article, a full stop), which token F1
    alone scores 0."""
    if prediction.strip() == reference.strip():
        return 1.0
    return token_f1(prediction, reference)


def p90(values: list[float]) -> float:
    """The nearest-rank 90th percentile: the ceil(0.9 n)-th smallest value."""
    ordered = sorted(values)
    return ordered[max(0, -(-9 * len(ordered) // 10) - 1)]


def mean(values: list[float]) -> float | None:
    return statistics.mean(values) if values else None
