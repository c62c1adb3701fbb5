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

    def as_dict(self) -> dict:
        return asdict(self)


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
        tokens whose K/V came from a cache (reused chunks not recomputed, exact prefix)."""
        s = self.stats
        return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.new_tokens,
                "total_tokens": s.prompt_tokens + s.new_tokens, "cached_tokens": s.reused_tokens}

    def metadata(self) -> dict[str, Any]:
        """TTFT, finish reason and the blend stats, for a framework's response metadata."""
        return {"ttft_s": self.ttft_s, "finish_reason": self.finish_reason, **self.stats.as_dict()}
