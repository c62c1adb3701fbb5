"""What the explorer asks of the engine: answers (streamed), explanations and a small
speed sweep.  Plain functions over a backend, so they are usable (and tested) without a
browser; :mod:`.app` only wires them to widgets."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..datasets import token_f1

SEPARATOR = "---"  # a line of its own between passages in the text box


def split_passages(text: str, files: Sequence[str] = ()) -> list[str]:
    """Passages from the text box (separated by lines of ``---``) and uploaded text files
    (one passage each)."""
    parts: list[str] = []
    current: list[str] = []
    for line in (text or "").splitlines():
        if line.strip() == SEPARATOR:
            parts.append("\n".join(current))
            current = []
        else:
            current.append(line)
    parts.append("\n".join(current))
    for path in files or ():
        with open(path, encoding="utf-8", errors="replace") as f:
            parts.append(f.read())
    return [p.strip() for p in parts if p.strip()]


@dataclass
class Answer:
    """One streamed answer and what it cost."""

    method: str
    text: str = ""
    ttft_s: float | None = None
    decode_ms_per_token: float | None = None
    stats: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        if self.ttft_s is None:
            return f"**{self.method}**: …"
        s = self.stats
        parts = [f"**{self.method}**: TTFT {self.ttft_s * 1000:.0f} ms"]
        if self.decode_ms_per_token is not None:
            parts.append(f"decode {self.decode_ms_per_token:.0f} ms/token")
        parts.append(f"reused {s.get('reused_tokens', 0)} / recomputed {s.get('recomputed_tokens', 0)} tokens")
        parts.append(f"store hits {s.get('store_hits', 0)}, misses {s.get('store_misses', 0)}")
        if s.get("fidelity"):
            parts.append(f"fidelity receipt: {s['fidelity']}")
        return " · ".join(parts)


def stream_answer(backend: Any, query: str, passages: list[str], method: str, ratio: float,
                  max_new_tokens: int) -> Iterator[Answer]:
    """Yield the answer as it grows, then once more with its stats."""
    options: dict[str, Any] = {"method": method, "max_new_tokens": max_new_tokens}
    if method == "blend":
        options["recompute_ratio"] = ratio
    answer = Answer(method)
    run = backend.start(query, passages, **options)
    t0, first, count = time.perf_counter(), None, 0
    for piece in run.pieces:
        first = first or time.perf_counter()
        count += 1
        answer.text += piece
        yield answer
    result = run.result
    answer.ttft_s = result.ttft_s if result is not None else (first or t0) - t0
    if first is not None and count > 1:
        answer.decode_ms_per_token = (time.perf_counter() - first) / (count - 1) * 1000
    if result is not None:
        answer.stats = result.stats.as_dict() | {"fidelity": result.metadata().get("fidelity")}
    yield answer


def sweep(engine: Any, query: str, passages: list[str], methods: Sequence[str], ratio: float,
          max_new_tokens: int = 16, progress: Callable[[float, str], None] | None = None,
          repeats: int = 3) -> list[dict[str, Any]]:
    """Median TTFT over ``repeats`` runs of each method for the first 1..k passages (k =
    all), measured now on this engine, with the token F1 of each answer against full
    prefill's (the quality number under each bar).  Caches are ingested first, so TTFT
    is the request's own."""
    engine.ingest(passages)
    steps = [(k, m) for k in range(1, len(passages) + 1) for m in methods]
    records, full_text = [], {}
    for i, (k, method) in enumerate(steps):
        if progress is not None:
            progress(i / len(steps), f"{method}, {k} chunk(s)")
        opts: dict[str, Any] = {"method": method, "max_new_tokens": max_new_tokens}
        if method == "blend":
            opts["recompute_ratio"] = ratio
        runs = [engine.generate(query, passages[:k], **opts) for _ in range(repeats)]
        if method == "full":
            full_text[k] = runs[0].text
        records.append({"chunks": k, "method": method, "text": runs[0].text,
                        "ttft_median_s": statistics.median(r.ttft_s for r in runs)})
    for rec in records:
        ref = full_text.get(rec["chunks"])
        rec["output_f1_vs_full"] = None if ref is None else token_f1(rec["text"], ref)
    return records
