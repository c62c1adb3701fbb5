"""What the engine hands back: chunk handles, per-request stats, results.

Plain dataclasses without torch, shared by the in-process engine and the client of a
vLLM server, so a framework adapter reads the same fields from either backend."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ChunkHandle:
    """A stored chunk: ``key`` identifies its cache; the token ids let an evicted cache be
    recomputed instead of failing."""

    key: str
    num_tokens: int
    token_ids: tuple[int, ...] = field(default=(), repr=False)
    model_fingerprint: str = field(default="", repr=False)


@dataclass
class BlendStats:
    """What one request did: token counts by how their K/V were obtained, store traffic,
    seconds per phase, and (with ``recompute_ratio="auto"``) the loading controller's choice."""

    method: str
    recompute_ratio: float
    prompt_tokens: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    computed_tokens: int = 0
    store_hits: int = 0
    store_misses: int = 0
    store_rejected: int = 0  # entries found but not trusted (corrupt, foreign): recomputed
    chunks: int = 0  # chunks in the prompt (given, or found in its text)
    chunks_learned: int = 0  # of those, paragraphs not known before, now cached
    new_tokens: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    controller: dict | None = None  # what the loading controller chose and why
    # The fidelity receipt: was the prefill exact (equal to full prefill: full, prefix-only,
    # or every reused token recomputed), the share of approximately reused tokens actually
    # recomputed, the estimated fidelity risk of what stayed stale, and whether the guard
    # raised the ratio above the request's.
    exact: bool = True
    ratio_used: float = 0.0
    risk: float | None = None  # None: not known (a streamed answer from a vLLM server without the guard)
    exposure: float | None = None  # the first token's lean on stale K/V; None: not measured (no exposure limit)
    escalated: bool = False
    exact_cached_tokens: int = 0  # of reused_tokens: read from exact caches in the store (the prefix)
    approximate_tokens: int = 0  # of reused_tokens: from chunk caches, not recomputed (the approximation)
    # chunk tokens (then recomputed or left stale) that ran up to the check layer to be ranked:
    # the check pool, about half of them; all of them when a chunk was stored without a hint
    checked_tokens: int = 0

    def take_prefill(self, report: Any) -> None:
        """Token counts and the fidelity receipt of a fused prefill (a ``FusionReport``)."""
        self.prompt_tokens, self.reused_tokens = report.prompt_tokens, report.reused_tokens
        self.recomputed_tokens, self.computed_tokens = report.recomputed_tokens, report.computed_tokens
        self.exact, self.ratio_used, self.risk = report.exact, report.ratio_used, report.risk
        self.exposure = report.exposure
        self.escalated, self.exact_cached_tokens = report.escalated, report.exact_cached_tokens
        self.approximate_tokens = report.approximate_tokens
        self.checked_tokens = report.active_per_layer[0] - report.computed_tokens if report.active_per_layer else 0

    def receipt(self, counts: bool = False) -> dict[str, Any]:
        """The fidelity receipt, as adapters put it in their response metadata; with
        ``counts``, also the reused and recomputed token counts (a vLLM worker sends them to
        its client, whose own counts are of what it asked for)."""
        out = {"exact": self.exact, "method": self.method, "recompute_ratio": self.recompute_ratio,
               "ratio_used": self.ratio_used, "risk": self.risk, "exposure": self.exposure,
               "escalated": self.escalated,
               "exact_cached_tokens": self.exact_cached_tokens, "approximate_tokens": self.approximate_tokens}
        if counts:
            out |= {"reused_tokens": self.reused_tokens, "recomputed_tokens": self.recomputed_tokens}
        return out

    def adopt_receipt(self, receipt: dict[str, Any]) -> None:
        """Take another process's :meth:`receipt` of this request (a vLLM worker's: a guard
        escalation, the risk it measured, the tokens it read exactly) over the one of what
        was asked for.  A receipt with a field of the wrong type raises ``ValueError`` and
        nothing is taken.  Without counts (an older worker) the reused and recomputed tokens
        are worked out from what was asked for."""
        taken = {name: _checked(name, receipt[name]) for name in _ADOPTED if name in receipt}
        span = self.reused_tokens + self.recomputed_tokens  # chunks and prefix: loaded or recomputed
        for name, value in taken.items():
            setattr(self, name, value)
        if "reused_tokens" not in taken:
            self.reused_tokens = self.exact_cached_tokens + self.approximate_tokens
        if "recomputed_tokens" not in taken:
            self.recomputed_tokens = max(0, span - self.reused_tokens)

    def as_dict(self) -> dict:
        return asdict(self)


# What adopt_receipt takes, by kind; "method" and "recompute_ratio" stay what was asked.
_FLAGS = ("exact", "escalated")
_SHARES = ("ratio_used", "risk", "exposure")  # risk and exposure may be None (not measured)
_COUNTS = ("exact_cached_tokens", "approximate_tokens", "reused_tokens", "recomputed_tokens")
_ADOPTED = _FLAGS + _SHARES + _COUNTS


def _checked(name: str, value: Any) -> Any:
    """``value`` if it has the kind the receipt field ``name`` holds; else ValueError."""
    if name in _FLAGS and isinstance(value, bool):
        return value
    if name in _SHARES and (value is None and name != "ratio_used"
                            or isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0):
        return None if value is None else float(value)
    if name in _COUNTS and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ValueError(f"receipt field {name!r}: {value!r} is not what it holds")


@dataclass
class Result:
    """A finished answer."""

    text: str
    token_ids: list[int]
    ttft_s: float
    stats: BlendStats
    finish_reason: str = "length"
    first_token_logits: torch.Tensor | None = field(default=None, repr=False)
    hkvd_positions: list[int] = field(default_factory=list, repr=False)

    @property
    def usage(self) -> dict[str, int]:
        """Token counts as OpenAI-style APIs report them; ``cached_tokens`` are prompt
        tokens read from an exact cache (the prefix), ``approximate_tokens`` those reused
        from chunk caches without recompute (CacheBlend's approximation)."""
        s = self.stats
        return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.new_tokens,
                "total_tokens": s.prompt_tokens + s.new_tokens, "cached_tokens": s.exact_cached_tokens,
                "approximate_tokens": s.approximate_tokens}

    def metadata(self) -> dict[str, Any]:
        """TTFT, finish reason, the blend stats and the fidelity receipt (``"fidelity"``: was
        the answer computed exactly as full prefill would, and if not, how much was
        recomputed and how risky the rest is), for a framework's response metadata."""
        return {"ttft_s": self.ttft_s, "finish_reason": self.finish_reason, **self.stats.as_dict(),
                "fidelity": self.stats.receipt()}
