"""The unit the KV store holds: one chunk's position-free K/V for every layer."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class ChunkKV:
    """Keys before RoPE and values of a chunk's tokens, ``[layers, kv_heads, tokens, head_dim]``.

    Keys are stored un-rotated so one entry serves the chunk at any offset in a prompt;
    the fusor applies RoPE for the real positions (paper §5, re-positioning).
    """

    k: Tensor
    v: Tensor

    def __post_init__(self) -> None:
        if self.k.shape != self.v.shape or self.k.dim() != 4:
            raise ValueError(f"ChunkKV needs k and v of one 4-d shape, got {self.k.shape}, {self.v.shape}")

    @property
    def num_tokens(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
