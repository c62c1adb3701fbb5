"""What passes between the vLLM connector's halves, and what a request asks of it.

The scheduler side sends the worker :class:`CacheBlendMeta` each step (which requests to
blend, which chunk caches to save or release); the worker sends back
:class:`BlendReceipts`: the fidelity receipt of each request it blended, which the
scheduler side returns in that request's response marker.  A request's own hints
(``kv_transfer_params``) are checked in :mod:`.kv_params`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from ..config import BlendConfig

__all__ = ["BlendLoad", "BlendReceipts", "CacheBlendMeta", "ChunkSave", "LayoutReport", "request_params"]


@dataclass
class BlendLoad:
    """One request whose K/V the worker writes: tokens ``[start, len(token_ids) - 1)``."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    spans: list[tuple[int, int]]
    blend: BlendConfig  # the HKVD selection: the server's defaults with the request's options
    prefix: int = 0  # a prompt without spans: its first tokens, read from the prefix cache


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


@dataclass
class BlendReceipts(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: the fidelity receipt of every request blended in
    it (``Result.stats.receipt()``'s fields), by request id."""

    receipts: dict[str, dict[str, Any]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> BlendReceipts:
        merged = dict(self.receipts)
        merged.update(getattr(other, "receipts", {}))
        return BlendReceipts(merged)



@dataclass
class LayoutReport(KVConnectorHandshakeMetadata):
    """Worker -> scheduler, once at start-up (vLLM's connector handshake): the KV layout
    self-check's verdict (:func:`.paged.self_check`); not ``ok`` turns blending off."""

    ok: bool
    backend: str
    reason: str
