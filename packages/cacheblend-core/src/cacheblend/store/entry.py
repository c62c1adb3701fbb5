"""The unit the KV store holds: one chunk's position-free K/V for every layer."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor


class CorruptEntry(Exception):
    """A stored entry failed verification while being read; it must be recomputed."""


class LayerSource(Protocol):
    """A stored chunk whose layers can be read one at a time (for pipelined loading)."""

    num_tokens: int
    num_layers: int
    meta: dict[str, str]

    def layer(self, index: int) -> tuple[Tensor, Tensor]: ...


@dataclass(frozen=True)
class ChunkKV:
    """Keys before RoPE and values of a chunk's tokens, ``[layers, kv_heads, tokens, head_dim]``.

    Keys are stored un-rotated so one entry serves the chunk at any offset in a prompt;
    the fusor applies RoPE for the real positions (paper §5, re-positioning).  ``meta``
    records who made it (model fingerprint, precompute policy, token-ids hash).
    """

    k: Tensor
    v: Tensor
    meta: dict[str, str] = field(default_factory=dict, compare=False)
    tier = "memory"

    def __post_init__(self) -> None:
        if self.k.shape != self.v.shape or self.k.dim() != 4:
            raise ValueError(f"ChunkKV needs k and v of one 4-d shape, got {self.k.shape}, {self.v.shape}")

    @property
    def num_tokens(self) -> int:
        return self.k.shape[2]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def layer(self, index: int) -> tuple[Tensor, Tensor]:
        return self.k[index], self.v[index]


def layer_bytes(k: Tensor, v: Tensor) -> bytes:
    """The raw bytes of one layer (k then v), as stored and checksummed."""
    return k.contiguous().view(torch.uint8).numpy().tobytes() + v.contiguous().view(torch.uint8).numpy().tobytes()


def layer_digest(k: Tensor, v: Tensor) -> str:
    return hashlib.sha256(layer_bytes(k, v)).hexdigest()
