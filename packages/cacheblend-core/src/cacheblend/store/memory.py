"""In-process memory tier: least-recently-used eviction by bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict

from .entry import ChunkKV


class MemoryStore:
    """A dict of ``key -> ChunkKV`` that never holds more than ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError("memory capacity must be positive")
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[str, ChunkKV] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[str]:
        """The stored keys, least recently used first."""
        with self._lock:
            return list(self._items)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: str) -> ChunkKV | None:
        with self._lock:
            kv = self._items.get(key)
            if kv is not None:
                self._items.move_to_end(key)
            return kv

    def put(self, key: str, kv: ChunkKV) -> bool:
        """Store ``kv``; returns False when it alone exceeds the capacity (not stored)."""
        size = kv.nbytes
        if self.capacity_bytes is not None and size > self.capacity_bytes:
            return False
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._items[key] = kv
            self._bytes += size
            while self.capacity_bytes is not None and self._bytes > self.capacity_bytes:
                evicted = self._items.pop(self._victim(key))
                self._bytes -= evicted.nbytes
                self.evictions += 1
        return True

    def _victim(self, new: str) -> str:
        """The least recently used learned chunk (found in a prompt, not ingested), else the
        least recently used entry; never ``new``, the entry being stored (a learned one was
        its own victim after others had been evicted for it, and ``put`` said True)."""
        others = [(k, kv) for k, kv in self._items.items() if k != new]
        return next((k for k, kv in others if kv.meta.get("origin") == "learned"), others[0][0])

    def open(self, key: str) -> ChunkKV | None:
        """Layer-wise access: an in-memory entry already is one."""
        return self.get(key)

    def stats(self) -> dict:
        with self._lock:
            tokens = sum(kv.num_tokens for kv in self._items.values())
            learned = sum(kv.meta.get("origin") == "learned" for kv in self._items.values())
        return {"tier": "memory", "entries": len(self), "learned_entries": learned, "bytes": self._bytes,
                "bytes_per_token": round(self._bytes / tokens) if tokens else None,
                "capacity_bytes": self.capacity_bytes, "evictions": self.evictions}

    def delete(self, key: str) -> bool:
        with self._lock:
            kv = self._items.pop(key, None)
            if kv is not None:
                self._bytes -= kv.nbytes
            return kv is not None

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0
