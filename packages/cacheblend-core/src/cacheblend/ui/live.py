"""What the explorer asks of a backend: passages from the inputs and answers, streamed
with their cost.  Plain functions, usable (and tested) without a browser; :mod:`.app`
only wires them to widgets, the figures come from :mod:`cacheblend.explain`."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

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
    decode_s = result.stats.seconds.get("decode") if result is not None else None
    if decode_s is not None and result is not None and result.stats.new_tokens > 1:
        # the engine's own decode time per token: a streamed piece may hold several tokens
        answer.decode_ms_per_token = decode_s / (result.stats.new_tokens - 1) * 1000
    elif first is not None and count > 1:  # a server's answer: per streamed piece, the best there is
        answer.decode_ms_per_token = (time.perf_counter() - first) / (count - 1) * 1000
    if result is not None:
        answer.stats = result.stats.as_dict() | {"fidelity": result.metadata().get("fidelity")}
    yield answer
