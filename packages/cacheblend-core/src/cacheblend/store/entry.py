"""The unit the KV store holds: one chunk's position-free K/V for every layer."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import blake3
import torch
from torch import Tensor

from ..errors import CacheBlendError


class CorruptEntry(Exception):
    """A stored entry failed verification while being read; it must be recomputed."""


class LayerSource(Protocol):
    """A stored chunk whose layers can be read one at a time (for pipelined loading)."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def meta(self) -> dict[str, str]: ...

    @property
    def tier(self) -> str:
        """Where the layers come from ("memory", "disk", "redis"): the loader reads a tier
        whose reads wait on a socket ahead of the fusor, and one whose reads are CPU work not."""
        ...

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
        if self.k.dtype != self.v.dtype or self.k.device != self.v.device:
            raise ValueError(f"ChunkKV needs k and v of one dtype and device, got {self.k.dtype} on {self.k.device} "
                             f"and {self.v.dtype} on {self.v.device}")
        if self.k.shape[0] == 0 or self.k.shape[2] == 0:
            raise ValueError(f"ChunkKV needs at least one layer and one token, got shape {tuple(self.k.shape)}")

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


class PrefixView:
    """The first ``num_tokens`` tokens of a stored chunk, as a source of their own.

    Attention is causal, so the K/V of a chunk's first n tokens do not depend on what
    follows them: the cache of ``passage + "\\n\\n"`` holds, exactly, the cache of the
    passage alone.  One stored entry thus serves a passage followed by a blank line (as
    the engine joins chunks) and one followed by anything else (as a template may)."""

    def __init__(self, source: LayerSource, num_tokens: int) -> None:
        if not 0 < num_tokens <= source.num_tokens:
            raise ValueError(f"a view of {num_tokens} tokens of a {source.num_tokens}-token entry")
        self.source, self.num_tokens = source, num_tokens
        self.num_layers, self.meta = source.num_layers, source.meta
        self.tier = source.tier

    def layer(self, index: int) -> tuple[Tensor, Tensor]:
        k, v = self.source.layer(index)
        return k[:, : self.num_tokens], v[:, : self.num_tokens]


class ShapeChecked:
    """A stored source whose every layer must be ``[kv_heads, tokens, head_dim]`` of the
    model reading it.  Digests prove the bytes are what was written, not that the writer
    wrote this model's shape: a mismatch is found before any tensor math, the entry is
    dropped (``on_bad``) and the read fails as a damaged one does (it is recomputed)."""

    def __init__(self, source: LayerSource, kv_heads: int, head_dim: int, on_bad) -> None:
        self.source, self.shape, self._on_bad = source, (kv_heads, source.num_tokens, head_dim), on_bad
        self.num_tokens, self.num_layers, self.meta = source.num_tokens, source.num_layers, source.meta
        # every source of a store object the engine was handed passes here: one written
        # before the protocol named its tier still serves (read as a tier of unknown cost)
        self.tier: str = getattr(source, "tier", "unknown")

    def layer(self, index: int) -> tuple[Tensor, Tensor]:
        k, v = self.source.layer(index)
        if tuple(k.shape) != self.shape or tuple(v.shape) != self.shape:
            self._on_bad()
            raise CorruptEntry(f"layer {index} has shape {tuple(k.shape)}, the model needs {self.shape}")
        return k, v


def _raw(t: Tensor):
    """A zero-copy byte view of ``t`` (any dtype, bfloat16 included)."""
    return t.contiguous().view(torch.uint8).numpy()


def layer_bytes(k: Tensor, v: Tensor) -> bytes:
    """The raw bytes of one layer (k then v), as stored and checksummed."""
    return _raw(k).tobytes() + _raw(v).tobytes()


# What new entries are checked with: BLAKE3 is a cryptographic hash (a signed entry's
# digests must resist forgery) that runs about 2.6x faster than SHA-256 even where the CPU
# has SHA instructions (169 MB, a 6-passage prompt's float32 K/V: 37 against 98 ms on a
# 2-core EPYC), and a disk or Redis read hashes every layer it serves.
DIGEST = "blake3"
_HASHES: dict[str, Callable[[Any], Any]] = {"blake3": blake3.blake3, "sha256": hashlib.sha256}
# Entries written before the choice was recorded carry ``layer_sha256`` and no ``digest``.
LEGACY_DIGEST, LEGACY_FIELD, DIGESTS_FIELD = "sha256", "layer_sha256", "layer_digests"


def layer_digest(k: Tensor, v: Tensor, algorithm: str = DIGEST) -> str:
    """The digest of :func:`layer_bytes`, hashed from the tensors' memory without copying
    (it runs on the request path for every layer read from disk or Redis)."""
    h = _HASHES[algorithm](_raw(k))
    h.update(_raw(v))
    return h.hexdigest()


def digest_of(meta: dict) -> tuple[str, str]:
    """Which algorithm an entry's layer digests use, and the meta field holding them.
    Raises :class:`CorruptEntry` for an algorithm this version does not know."""
    if "digest" not in meta:
        return LEGACY_DIGEST, LEGACY_FIELD
    algorithm = meta["digest"]
    if algorithm not in _HASHES:
        raise CorruptEntry(f"unknown layer digest {algorithm!r}")
    return algorithm, DIGESTS_FIELD


def stack_layers(layers: list[tuple[Tensor, Tensor]], meta: dict[str, str]) -> ChunkKV:
    return ChunkKV(torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers]), dict(meta))


def read_entry(source: LayerSource | None) -> ChunkKV | None:
    """Every layer of ``source`` (each verified by its tier), or None if any fails."""
    if source is None:
        return None
    try:
        return stack_layers([source.layer(i) for i in range(source.num_layers)], source.meta)
    except CorruptEntry:
        return None


KEY_SAMPLE = 8  # entries whose signatures verify looks at before it drops anything


def verify_entries(tier, progress=None) -> dict[str, int]:
    """Read every entry of ``tier`` fully; the tier drops those that fail.  A signed tier
    whose sampled entries all fail their signature is left alone, with an error: the key
    given is most likely not the one they were written with, and verifying would have
    dropped every entry (a shared Redis tier's, for every replica)."""
    keys = tier.keys()
    if getattr(tier, "signer", None) is not None and keys:
        _refuse_a_wrong_key(tier, keys[:KEY_SAMPLE])
    dropped = sum(tier.get(k) is None for k in (progress(keys) if progress else keys))
    return {"checked": len(keys), "dropped": dropped}


def _refuse_a_wrong_key(tier, sample: list[str]) -> None:
    before = tier.unsigned
    tier.condemning = False  # look only
    try:
        for key in sample:
            tier.open(key)
    finally:
        tier.condemning = True
    failed, tier.unsigned = tier.unsigned - before, before
    if failed == len(sample):
        raise CacheBlendError(
            f"the first {failed} entries all fail their signature: the key given (key= or CACHEBLEND_STORE_KEY) "
            "is most likely not the one they were written with, or they were written unsigned; nothing was dropped")
