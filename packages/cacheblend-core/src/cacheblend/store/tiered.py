"""Several tiers behind one interface, fastest first (paper §6: the KV cache store).

Reads walk the tiers; a hit in a slower tier is promoted into every faster one once all
its layers have been read (so a layer-wise, pipelined read promotes too).  Writes go to
the fastest tier at once and to the slower ones on a background thread, off the request
path; ``flush()`` waits for them (and runs at interpreter exit).
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from dataclasses import dataclass, field
from typing import Protocol

from .entry import ChunkKV, LayerSource, stack_layers


class Tier(Protocol):
    def get(self, key: str) -> ChunkKV | None: ...
    def open(self, key: str) -> LayerSource | None: ...
    def put(self, key: str, kv: ChunkKV) -> bool: ...
    def delete(self, key: str) -> bool: ...
    def clear(self) -> None: ...
    def stats(self) -> dict: ...


@dataclass
class TierStats:
    hits: list[int] = field(default_factory=list)
    misses: int = 0
    background_writes: int = 0
    failed_writes: int = 0


class _PromotingSource:
    """Reads layers from a slower tier; when the last one arrives, hands the whole entry
    to the faster tiers."""

    def __init__(self, store: TieredStore, key: str, source: LayerSource, faster: list[Tier]) -> None:
        self._store, self.key, self._source, self._faster = store, key, source, faster
        self.num_layers, self.num_tokens, self.meta = source.num_layers, source.num_tokens, source.meta
        self.tier = getattr(source, "tier", "store")
        self._layers: dict[int, tuple] = {}

    def layer(self, index: int):
        kv = self._source.layer(index)
        self._layers[index] = kv
        if len(self._layers) == self.num_layers:
            whole = stack_layers([self._layers[i] for i in range(self.num_layers)], self.meta)
            for tier in self._faster:
                tier.put(self.key, whole)
        return kv


class TieredStore:
    def __init__(self, tiers: list[Tier], background: bool = True) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.tiers = tiers
        self.stats_counts = TierStats(hits=[0] * len(tiers))
        self._queue: queue.Queue | None = None
        if background and len(tiers) > 1:
            self._queue = queue.Queue()
            threading.Thread(target=self._writer, name="cacheblend-store-writer", daemon=True).start()
            ref = weakref.ref(self)
            atexit.register(_flush_at_exit, ref)

    # -- reads ---------------------------------------------------------------------
    def open(self, key: str) -> LayerSource | None:
        for i, tier in enumerate(self.tiers):
            source = tier.open(key)
            if source is not None:
                self.stats_counts.hits[i] += 1
                return source if i == 0 else _PromotingSource(self, key, source, self.tiers[:i])
        self.stats_counts.misses += 1
        return None

    def get(self, key: str) -> ChunkKV | None:
        for i, tier in enumerate(self.tiers):
            kv = tier.get(key)
            if kv is not None:
                self.stats_counts.hits[i] += 1
                for faster in self.tiers[:i]:
                    faster.put(key, kv)
                return kv
        self.stats_counts.misses += 1
        return None

    # -- writes --------------------------------------------------------------------
    def put(self, key: str, kv: ChunkKV) -> bool:
        first = self.tiers[0].put(key, kv)
        for tier in self.tiers[1:]:
            if self._queue is not None:
                self._queue.put((tier, key, kv))
            elif not tier.put(key, kv):
                self.stats_counts.failed_writes += 1
        return first

    def _writer(self) -> None:
        assert self._queue is not None
        while True:
            tier, key, kv = self._queue.get()
            try:
                ok = tier.put(key, kv)
            except Exception:  # a tier's failure must never take the writer down
                ok = False
            self.stats_counts.background_writes += 1
            if not ok:
                self.stats_counts.failed_writes += 1
            self._queue.task_done()

    def flush(self) -> None:
        """Wait until every background write has landed."""
        if self._queue is not None:
            self._queue.join()

    def delete(self, key: str) -> bool:
        self.flush()
        return any([tier.delete(key) for tier in self.tiers])

    def clear(self) -> None:
        self.flush()
        for tier in self.tiers:
            tier.clear()

    def stats(self) -> dict:
        c = self.stats_counts
        return {"tiers": [t.stats() for t in self.tiers], "hits": list(c.hits), "misses": c.misses,
                "background_writes": c.background_writes, "failed_writes": c.failed_writes}


def _flush_at_exit(ref: weakref.ref[TieredStore]) -> None:
    """Write what is queued before the interpreter exits (the store may be gone already)."""
    store = ref()
    if store is not None:
        store.flush()
