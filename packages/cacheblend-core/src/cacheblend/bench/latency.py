"""End-to-end latency of one answer: TTFT, decode ms per token, total time and memory.

TTFT alone hides the token loop: a blended prefill that saves 5 s is worth little if the
answer's 64 tokens then decode slower than a peer's.  So the bench also runs each method
once more with a fixed-length answer (``ignore_eos``, no stop strings: every method and
every peer decodes exactly ``tokens`` tokens after the same prompt) and times the whole
request.  Memory is the process's resident set, sampled while the request runs: its peak,
and how far it rose over the resident set before the request (the request's own KV cache
and activations; the static caches are sized from the prompt and ``tokens``), read from the
kernel's own high-water mark where Linux offers it (:class:`PeakRSS`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
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
    """This process's peak resident set while the block runs.

    On Linux the kernel keeps the peak itself (``VmHWM`` in ``/proc/self/status``), and
    writing 5 to ``/proc/self/clear_refs`` resets it: exact, and nothing runs beside the
    request.  Elsewhere a thread samples the resident set every ``interval_s``; its wake-ups
    cost the request about a millisecond per decoded token on 2 cores (measured), so the
    sampler is only the fall-back."""

    STATUS = Path("/proc/self/status")
    CLEAR = Path("/proc/self/clear_refs")

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.process = psutil.Process()
        self.before = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._kernel = False

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def _high_water(self) -> int | None:
        """The kernel's peak resident set in bytes (None: not readable here)."""
        try:
            for line in self.STATUS.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def __enter__(self) -> PeakRSS:
        self.before = self.peak = self.process.memory_info().rss
        try:
            self.CLEAR.write_text("5")  # the peak starts again from the current resident set
            self._kernel = self._high_water() is not None
        except OSError:
            self._kernel = False
        if not self._kernel:
            self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        kernel_peak = self._high_water() if self._kernel else None
        self.peak = max(self.peak, kernel_peak or 0, self.process.memory_info().rss)


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
