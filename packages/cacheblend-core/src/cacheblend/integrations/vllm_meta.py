"""What passes between the vLLM connector's halves, and what a request asks of it.

The scheduler side sends the worker :class:`CacheBlendMeta` each step (which requests to
blend, which chunk caches to save or release); the worker sends back
:class:`BlendReceipts`: the fidelity receipt of each request it blended, which the
scheduler side returns in that request's response marker.  A request's own hints
(``kv_transfer_params``) are checked here: a malformed hint is ignored, never fatal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from ..config import BlendConfig

__all__ = ["BlendLoad", "BlendReceipts", "CacheBlendMeta", "ChunkSave", "int_list", "request_params", "valid_spans"]


@dataclass
class BlendLoad:
    """One request whose K/V the worker writes: tokens ``[start, len(token_ids) - 1)``."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    spans: list[tuple[int, int]]
    blend: BlendConfig  # the HKVD selection: the server's defaults with the request's options


@dataclass
class ChunkSave:
    """An ingest request: vLLM computes ``token_ids`` (``sink`` sink ids, then the chunk) and
    the worker stores the chunk's K/V from ``block_ids`` after the forward."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    sink: int


@dataclass
class CacheBlendMeta(KVConnectorMetadata):
    loads: list[BlendLoad] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)
    releases: list[list[int]] = field(default_factory=list)  # chunk ids whose entries go


def request_params(request: Any) -> dict:
    """The request's ``kv_transfer_params`` (a dict, or empty)."""
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, dict) else {}


def valid_spans(spans: Any, n: int) -> list[tuple[int, int]] | None:
    """Client-given chunk spans, if they are sorted, disjoint, non-empty and end before the
    last prompt token (which vLLM must compute); None otherwise (the spans are then ignored:
    the scheduler must never fail a request over its hints)."""
    try:
        out = [(int(a), int(b)) for a, b in spans]
    except (TypeError, ValueError, OverflowError):  # e.g. [[0, 1e400]]
        return None
    prev = 0
    for a, b in out:
        if not (prev <= a < b <= n - 1):
            return None
        prev = b
    return out


def int_list(value: Any) -> list[int] | None:
    """``value`` as token ids, or None if it is not a list of integers."""
    ok = isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    return list(value) if ok else None


@dataclass
class BlendReceipts(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: the fidelity receipt of every request blended in
    it (``Result.stats.receipt()``'s fields), by request id."""

    receipts: dict[str, dict[str, Any]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> BlendReceipts:
        merged = dict(self.receipts)
        merged.update(getattr(other, "receipts", {}))
        return BlendReceipts(merged)

