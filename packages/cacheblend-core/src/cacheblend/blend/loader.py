"""Pipelined, layer-wise loading of reused caches (paper §5).

While the fusor works on layer l, a worker thread reads layer l+1 of every reused
chunk from its tier.  When loading a layer takes no longer than recomputing the HKVD
tokens of a layer, the load is hidden entirely; ``exposed_s`` is the time the fusor
actually waited.  Sources already in memory need no thread at all.

On a CPU host the thread only helps where it has a core of its own: see :func:`pipelined`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch
from torch import Tensor

from ..store.entry import ChunkKV, LayerSource

WAITING_TIERS = frozenset({"redis"})  # tiers whose reads mostly wait on a socket


def pipelined(prefetch: bool | None, tiers: Collection[str] = ()) -> bool:
    """Whether layers are read on a thread beside the fusor: ``prefetch`` where it is set;
    None: when this process may run on more cores than torch's compute threads use, or when
    a layer comes from one of ``tiers`` that waits on a socket (:data:`WAITING_TIERS`).

    Why: the paper pipelines loads that are transfers (disk or network to GPU memory), which
    take no compute.  Here reading a disk entry is CPU work (a copy and a digest per layer),
    and on a host whose cores all run torch's OpenMP threads the loader takes a core from
    one of them while the others wait for it at every barrier.  Measured on 2 cores, 2
    threads, 6-passage musique prompts from a disk store (``benchmarks/store_tiers.py``,
    docs/internals/performance-log.md): reading ahead first cost about 0.3 s more TTFT than
    reading each layer just before it is fused; with single-threaded copies
    (:mod:`cacheblend.store.disk_source`) the two tie.  A Redis read is mostly a wait for
    the socket, which leaves the cores to the fusor: there reading ahead was ahead in each
    of six runs on 2 cores, on 20 musique prompts 1.04 s against 1.11 s.  Memory-tier hits
    need no reading either way."""
    if prefetch is not None:
        return prefetch
    if WAITING_TIERS.intersection(tiers):
        return True
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call (macOS): every core the machine has
        cores = os.cpu_count() or 1
    return cores > torch.get_num_threads()


POLL_S = 0.05  # how often a fusor waiting for a prefetched layer checks its deadline


class LayerLoader:
    """Layers of every reused source, read ahead on one thread when ``prefetch``.

    ``check`` (the request's deadline and cancel check; None: it has neither) runs while
    the fusor waits for a layer, so a read that hangs (a stalled network mount, a Redis
    server that stopped answering) ends the request at its deadline or cancel rather than
    when the read returns.  Without prefetch such a request still reads on the thread, one
    layer at a time while the fusor waits (nothing runs beside the compute, so the cores
    stay the fusor's); a request with neither reads inline on its own thread."""

    def __init__(self, sources: Sequence[LayerSource], num_layers: int, prefetch: bool | None = True,
                 check: Callable[[], None] | None = None) -> None:
        self.sources = list(sources)
        prefetch = pipelined(prefetch, {s.tier for s in self.sources})
        self._check = check
        self.num_layers = num_layers
        self.load_s = 0.0  # time spent reading layers (in the worker, or inline)
        self.exposed_s = 0.0  # time the fusor waited for a layer
        lazy = any(not isinstance(s, ChunkKV) for s in self.sources)
        threaded = lazy and (prefetch or check is not None)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cacheblend-load") if threaded else None
        self._ahead = prefetch
        self._pending: dict[int, Future] = {}
        if self._pool is not None and self._ahead and num_layers:
            self._pending[0] = self._pool.submit(self._read, 0)

    def _read(self, layer: int) -> list[tuple[Tensor, Tensor]]:
        t = time.perf_counter()
        try:
            return [s.layer(layer) for s in self.sources]
        finally:
            self.load_s += time.perf_counter() - t

    def layer(self, layer: int) -> list[tuple[Tensor, Tensor]]:
        """K/V of ``layer`` for every source, and start fetching the next layer."""
        if self._pool is None:
            t = time.perf_counter()
            out = self._read(layer)
            self.exposed_s += time.perf_counter() - t
            return out
        future = self._pending.pop(layer, None) or self._pool.submit(self._read, layer)
        if self._ahead and layer + 1 < self.num_layers and layer + 1 not in self._pending:
            self._pending[layer + 1] = self._pool.submit(self._read, layer + 1)
        t = time.perf_counter()
        try:
            while self._check is not None and not wait([future], timeout=POLL_S).done:
                self._check()
            return future.result()
        finally:
            self.exposed_s += time.perf_counter() - t

    @property
    def hidden_s(self) -> float:
        return max(0.0, self.load_s - self.exposed_s)

    def close(self, wait_for_reads: bool = True) -> None:
        """Stop reading ahead.  ``wait_for_reads=False`` (a prefill that failed or ran out
        of time) leaves a read in flight to finish on its own thread, its layers unused: a
        source only ever fills buffers of its own, so nothing the request hands back is
        written to after it returns."""
        if self._pool is not None:
            for f in self._pending.values():
                f.cancel()
            self._pool.shutdown(wait=wait_for_reads)
            self._pool = None
