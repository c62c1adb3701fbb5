"""One fused KV buffer kept from a finished request for the next one.

Why: every request fills a fresh :class:`KVCache` sized from its prompt and answer.
A fresh buffer of that size comes from ``mmap``, so the first write to each of its pages
is a page fault: on a 3.8K-token prompt with SmolLM2 (about 175 MB of K/V) that first
touch measured 36–48 ms, against 7 ms to write the same bytes again.  A blend at 5 % takes
about 1.2 s, so the faults were 3–4 % of its TTFT, paid inside the re-positioning of the
reused K/V (docs/internals/latency.md).  Handing the last request's buffer to the next
one removes them.

The pool holds at most one idle buffer (the largest given back), so its memory is
bounded by the largest request served; ``EngineConfig.reuse_kv_buffer=False`` turns it
off.  A buffer is handed to one request at a time: a request that finds none idle (another
request holds it, or it is too small) allocates its own, as before.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from ..models.decoder import ModelShape
from .decode import KVCache

__all__ = ["KVPool"]


class KVPool:
    """Lends :class:`KVCache` objects over kept storage (``enabled``) or fresh storage."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._idle: tuple[Tensor, Tensor] | None = None
        self._lock = threading.Lock()

    def take(self, shape: ModelShape, capacity: int, device: torch.device | str) -> KVCache:
        """A cache of ``capacity`` positions: over the idle storage when it is large enough
        (and of the same dtype and device), else over fresh storage."""
        numel = KVCache.size(shape, capacity)
        storage = None
        if self.enabled:
            with self._lock:
                idle = self._idle
                if idle is not None and idle[0].numel() >= numel and idle[0].dtype == shape.dtype \
                        and _same_device(idle[0].device, torch.device(device)):
                    storage, self._idle = idle, None
        return KVCache(shape, capacity, device, storage=storage)

    def give_back(self, kv: KVCache) -> None:
        """Keep ``kv``'s storage for the next request if it is larger than the idle one.
        The caller must not read or write ``kv`` afterwards."""
        if not self.enabled:
            return
        storage = kv.storage
        with self._lock:
            if self._idle is None or self._idle[0].numel() < storage[0].numel():
                self._idle = storage

    def reserve(self, shape: ModelShape, capacity: int, device: torch.device | str) -> None:
        """Make the idle buffer hold at least ``capacity`` positions, its pages written once.
        A benchmark's warm-up: otherwise the first method to need a larger buffer (full
        prefill, timed first) pays its page faults and a second buffer's resident memory,
        and the methods timed after it reuse that buffer for free."""
        if not self.enabled:
            return
        kv = self.take(shape, capacity, device)
        for part in kv.storage:
            part.zero_()
        self.give_back(kv)

    @property
    def idle_bytes(self) -> int:
        """Bytes held by the idle buffer (0 when none)."""
        idle = self._idle
        return 0 if idle is None else sum(t.numel() * t.element_size() for t in idle)


def _same_device(have: torch.device, want: torch.device) -> bool:
    """``cuda`` names the current CUDA device, which a buffer reports as ``cuda:0``: equal
    devices by the index each resolves to (``torch.device("cuda") != torch.device("cuda:0")``)."""
    if have.type != want.type:
        return False
    if want.index is None and want.type == "cuda":
        return have.index == torch.cuda.current_device()
    return have.index == want.index
