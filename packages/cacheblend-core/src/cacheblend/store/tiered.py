"""Several tiers behind one interface, fastest first (paper §6: the KV cache store).

Reads walk the tiers; a hit in a slower tier is promoted into every faster one once all
its layers have been read (so a layer-wise, pipelined read promotes too).  Writes go to
the fastest tier at once and to the slower ones on a background thread, off the request
path; ``flush()`` waits for them (and runs at interpreter exit).  ``delete`` does not wait
for the queue: a write queued before it is skipped, and only a write of the same key that
is landing at that moment is waited for.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from .entry import ChunkKV, LayerSource


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


class _Deletions:
    """What the background writer needs to know of deletes: each deleted key's generation
    (a write queued under an older one is skipped, so a queued put cannot bring a deleted
    entry back) and the key it is writing now (a delete of that key waits for it).

    Why not flush the queue before a delete: a request that drops a damaged entry would
    wait behind every queued write to a slow tier (a remote Redis), for other keys too.

    The generations matter only while a write is queued or landing: once none is, they
    are forgotten, so a long-running server that releases many chunks does not keep a
    number for every key it ever deleted."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.generation: dict[str, int] = {}  # deleted keys, while writes are pending
        self.pending = 0  # writes queued and not yet started or skipped
        self.writing: str | None = None

    def queued(self, key: str, count: int) -> int:
        """The generation ``count`` writes of ``key`` about to be queued carry."""
        with self.changed:
            self.pending += count
            return self.generation.get(key, 0)

    def start(self, key: str, generation: int) -> bool:
        """Whether a write queued under ``generation`` may still land; if so it is marked
        as landing until :meth:`done`."""
        with self.changed:
            self.pending -= 1
            if self.generation.get(key, 0) != generation:
                self._forget()
                return False
            self.writing = key
            return True

    def done(self) -> None:
        with self.changed:
            self.writing = None
            self._forget()
            self.changed.notify_all()

    def delete(self, key: str) -> None:
        """Skip the key's queued writes, and wait for one that is landing."""
        with self.changed:
            if not self.pending and self.writing is None:
                return  # nothing queued can bring the key back
            self.generation[key] = self.generation.get(key, 0) + 1
            while self.writing == key:
                self.changed.wait()

    def _forget(self) -> None:
        if not self.pending and self.writing is None:
            self.generation.clear()


class _PromotingSource:
    """Reads layers from a slower tier into one whole-entry buffer; when the last one
    arrives, hands that entry to the faster tiers.  A source with ``layer_into`` (the disk
    tier) copies each layer straight into the buffer, so a cold read copies its bytes once,
    not once per layer and again to stack them (about 40 ms of a 6-passage prompt's blend).
    The layers served are views of the buffer, as a memory-tier hit's are of its entry.

    A layer read before is served from the buffer, never read again: a second pass over the
    same prompt (the guard's ladder, the question probe) must not copy unchecked bytes into
    an entry the faster tiers already hold (the digest is checked after the copy), nor hand
    that entry to them once more per layer."""

    def __init__(self, store: TieredStore, key: str, source: LayerSource, faster: list[Tier]) -> None:
        self._store, self.key, self._source, self._faster = store, key, source, faster
        self.num_layers, self.num_tokens, self.meta = source.num_layers, source.num_tokens, source.meta
        self.tier: str = getattr(source, "tier", "unknown")  # a tier object written before the protocol named it
        self._into = getattr(source, "layer_into", None)  # copies into a given buffer (the disk tier)
        self._read: set[int] = set()
        self._k: Tensor | None = None
        self._v: Tensor | None = None

    def layer(self, index: int) -> tuple[Tensor, Tensor]:
        if index in self._read and self._k is not None and self._v is not None:
            return self._k[index], self._v[index]  # checked when it was read
        if self._k is not None and self._v is not None and self._into is not None:
            k, v = self._into(index, self._k[index], self._v[index])
        else:
            k, v = self._source.layer(index)
            if self._k is None or self._v is None:
                self._k = k.new_empty((self.num_layers, *k.shape))
                self._v = v.new_empty((self.num_layers, *v.shape))
            if k.shape != self._k.shape[1:] or v.shape != self._v.shape[1:] or k.dtype != self._k.dtype \
                    or v.dtype != self._v.dtype:
                return k, v  # a layer unlike the first: served as read (the reader checks it), not promoted
            k, v = self._k[index].copy_(k), self._v[index].copy_(v)
        self._read.add(index)
        if len(self._read) == self.num_layers:
            whole = ChunkKV(self._k, self._v, dict(self.meta))
            for tier in self._faster:
                tier.put(self.key, whole)
        return k, v


class TieredStore:
    def __init__(self, tiers: list[Tier], background: bool = True) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.tiers = tiers
        self.stats_counts = TierStats(hits=[0] * len(tiers))
        self._queue: queue.Queue | None = None
        self._deletions = _Deletions()
        if background and len(tiers) > 1:
            self._queue = queue.Queue()
            ref = weakref.ref(self)
            threading.Thread(target=_write_behind, args=(self._queue, self.stats_counts, self._deletions),
                             name="cacheblend-store-writer", daemon=True).start()
            weakref.finalize(self, self._queue.put, None)  # a store nobody holds stops its writer
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
        # counted as queued before the first tier is written: a delete that sees the entry
        # there must also see the writes to come, and skip them
        generation = self._deletions.queued(key, len(self.tiers) - 1 if self._queue is not None else 0)
        first = self.tiers[0].put(key, kv)
        for tier in self.tiers[1:]:
            if self._queue is not None:
                self._queue.put((tier, key, kv, generation))
            elif not tier.put(key, kv):
                self.stats_counts.failed_writes += 1
        return first

    def flush(self) -> None:
        """Wait until every background write has landed."""
        if self._queue is not None:
            self._queue.join()

    def delete(self, key: str) -> bool:
        self._deletions.delete(key)
        return any([tier.delete(key) for tier in self.tiers])

    def clear(self) -> None:
        self.flush()
        for tier in self.tiers:
            tier.clear()

    def stats(self) -> dict:
        c = self.stats_counts
        d = self._deletions
        return {"tiers": [t.stats() for t in self.tiers], "hits": list(c.hits), "misses": c.misses,
                "background_writes": c.background_writes, "failed_writes": c.failed_writes,
                "queued_writes": d.pending, "deletes_tracked": len(d.generation)}


def _write_behind(jobs: queue.Queue, counts: TierStats, deletions: _Deletions) -> None:
    """The store's background writer.  It holds the queue and the counters, not the store,
    so a store that nobody uses any more is collected (with the tensors of its memory tier)
    and its finalizer's ``None`` ends this thread after the writes queued before it."""
    while (job := jobs.get()) is not None:
        tier, key, kv, generation = job
        if deletions.start(key, generation):
            try:
                ok = tier.put(key, kv)
            except Exception:  # a tier's failure must never take the writer down
                ok = False
            finally:
                deletions.done()
            counts.background_writes += 1
            counts.failed_writes += not ok
        del job, tier, kv  # not held while waiting for the next job
        jobs.task_done()
    jobs.task_done()


def _flush_at_exit(ref: weakref.ref[TieredStore]) -> None:
    """Write what is queued before the interpreter exits (the store may be gone already)."""
    store = ref()
    if store is not None:
        store.flush()
