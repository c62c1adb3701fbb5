"""Several tiers behind one interface, fastest first (paper §6: the KV cache store)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from .entry import ChunkKV


class Tier(Protocol):
    def get(self, key: str) -> ChunkKV | None: ...
    def put(self, key: str, kv: ChunkKV) -> bool: ...
    def delete(self, key: str) -> bool: ...
    def clear(self) -> None: ...


@dataclass
class TierStats:
    hits: list[int] = field(default_factory=list)
    misses: int = 0


class TieredStore:
    """Reads walk the tiers and promote a hit into every faster tier; writes go to all."""

    def __init__(self, tiers: list[Tier]) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.tiers = tiers
        self.stats = TierStats(hits=[0] * len(tiers))

    def get(self, key: str) -> ChunkKV | None:
        for i, tier in enumerate(self.tiers):
            kv = tier.get(key)
            if kv is not None:
                self.stats.hits[i] += 1
                for faster in self.tiers[:i]:
                    faster.put(key, kv)
                return kv
        self.stats.misses += 1
        return None

    def put(self, key: str, kv: ChunkKV) -> bool:
        stored = [tier.put(key, kv) for tier in self.tiers]
        return any(stored)

    def delete(self, key: str) -> bool:
        return any([tier.delete(key) for tier in self.tiers])

    def clear(self) -> None:
        for tier in self.tiers:
            tier.clear()
