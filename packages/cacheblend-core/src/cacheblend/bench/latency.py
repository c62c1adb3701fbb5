"""End-to-end latency of one answer: TTFT, decode ms per token, total time and memory.

TTFT alone hides the token loop: a blended prefill that saves 5 s is worth little if the
answer's 64 tokens then decode slower than a peer's.  So the bench also runs each method
once more with a fixed-length answer (``ignore_eos``, no stop strings: every method and
every peer decodes exactly ``tokens`` tokens after the same prompt) and times the whole
request.  Memory is the process's resident set, sampled while the request runs: its peak,
and how far it rose over the resident set before the request (the request's own KV cache
and activations; the static caches are sized from the prompt and ``tokens``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

import psutil

from ..engine import Engine
from ..results import ChunkHandle

MIB = 1024 * 1024


@dataclass(frozen=True)
class AnswerTiming:
    """One fixed-length answer: when its first token came, how fast the rest came, when
    it was done, and the resident memory while it ran."""

    tokens: int
    ttft_s: float
    decode_ms_per_token: float  # (total − TTFT) / (tokens − 1): the token loop alone
    total_s: float
    peak_rss_mib: float
    rss_growth_mib: float  # peak over the resident set before the request


class PeakRSS:
    """Samples this process's resident set every ``interval_s`` while the block runs."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.process = psutil.Process()
        self.before = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self) -> PeakRSS:
        self.before = self.peak = self.process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


def timed_answer(run: Callable[[], tuple[float, int]], tokens: int) -> AnswerTiming:
    """Time ``run`` (which returns its TTFT and the number of tokens it decoded)."""
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        ttft, made = run()
        total = time.perf_counter() - t0
    if made != tokens:
        raise RuntimeError(f"asked for a {tokens}-token answer, got {made} tokens")
    return AnswerTiming(tokens=tokens, ttft_s=ttft, decode_ms_per_token=1000 * (total - ttft) / max(1, tokens - 1),
                        total_s=total, peak_rss_mib=rss.peak / MIB, rss_growth_mib=(rss.peak - rss.before) / MIB)


def answer_latency(engine: Engine, query: str, handles: Sequence[ChunkHandle], tokens: int,
                   preamble: str | None, **options) -> AnswerTiming:
    """A ``tokens``-long answer to ``query`` over ``handles`` with the request ``options``."""

    def run() -> tuple[float, int]:
        r = engine.generate(query, handles, preamble=preamble, max_new_tokens=tokens, ignore_eos=True, **options)
        return r.ttft_s, len(r.token_ids)

    return timed_answer(run, tokens)
