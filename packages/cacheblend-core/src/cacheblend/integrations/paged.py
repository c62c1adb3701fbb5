"""vLLM's paged KV cache as the connector writes and reads it, for any attention backend.

**Writing** goes through the backend's own cache-update op (``impl.do_kv_cache_update``,
what vLLM's forward calls to store a layer's K/V), so blended K/V land exactly where that
backend's attention reads them: CPU ``vec`` and ``amx``, FlashAttention, FlashInfer,
Triton. Nothing here needs to know the layout to write.

**Reading** (an ingest request stores the K/V vLLM computed for a chunk) needs the layout.
:func:`derive_layout` finds it from the same op: index-coded probes (token + 1, head + 1,
dim + 1; K positive, V negative) are written into one scratch block, and every (token,
head, dim) of K and V is located in the block's memory.  Where a layout is also written
here from vLLM's source (``vec``, from ``cpu_attn.py``: K transposed per (block, head),
then V), the derived one must equal it.

:func:`self_check` runs at start-up, before any request: it derives the layout, compares
it with the source-written one, writes a known chunk's K/V (the core's reference) through
the op into every layer and reads it back.  Any mismatch, or a backend without the op,
turns blending off for the server (the connector tells its scheduler side), so requests run
as plain vLLM and never decode from misplaced K/V.  The scratch block is block 0 (vLLM's
null block), restored afterwards.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# (key [n, heads, head_dim], value [n, heads, head_dim], slot_mapping [n]) -> None
WriteFn = Callable[[Tensor, Tensor, Tensor], None]
_EXACT = 256  # largest index code every cache dtype we read (bf16 and wider) holds exactly
SCRATCH_BLOCK = 0  # vLLM's null block: never handed to a request; the checks restore it


def layer_order(kv_caches: Iterable[str]) -> list[str]:
    """vLLM's attention-layer names (``model.layers.N.self_attn.attn``) by N, so that layer
    10 comes after layer 9 (as strings it would follow layer 1)."""
    def index(name: str) -> int:
        m = re.search(r"layers\.(\d+)\.", name)
        return int(m.group(1)) if m else -1
    return sorted(kv_caches, key=index)


def paged_views(cache: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """``vec`` ISA (from vLLM's cpu_attn.py): K as ``[blocks, heads, head_dim, block_size]``
    and V as ``[blocks, heads, block_size, head_dim]``, views of one layer's cache
    ``[blocks, heads, block_size, 2*head_dim]`` whose (block, head) pages hold all K
    (transposed), then all V."""
    nb, heads = cache.shape[:2]
    halves = cache.view(nb, heads, 2, -1)
    head_dim = halves.shape[-1] // block_size
    return (halves[:, :, 0].unflatten(-1, (head_dim, block_size)),
            halves[:, :, 1].unflatten(-1, (block_size, head_dim)))


def vec_writer(cache: Tensor, block_size: int) -> WriteFn:
    """The ``vec`` layout written by hand: what :func:`self_check` compares vLLM's op with."""
    k_t, v_pg = paged_views(cache, block_size)

    def write(k: Tensor, v: Tensor, slots: Tensor) -> None:
        k_t[slots // block_size, :, :, slots % block_size] = k.to(cache.dtype)
        v_pg[slots // block_size, :, slots % block_size] = v.to(cache.dtype)
    return write


SOURCE_LAYOUTS: dict[str, Callable[[Tensor, int], WriteFn]] = {"vec": vec_writer}


@dataclass(frozen=True)
class BlockLayout:
    """Where one block keeps each (token, head, dim) of K and of V: offsets into the
    block's memory, flattened in its dimension order, ``[block_size, heads, head_dim]``."""

    k: Tensor
    v: Tensor

    def same_as(self, other: BlockLayout) -> bool:
        return torch.equal(self.k, other.k) and torch.equal(self.v, other.v)


def derive_layout(write: WriteFn, cache: Tensor, block_size: int, heads: int, head_dim: int) -> BlockLayout | None:
    """The layout ``write`` stores one block in, or None when the probes do not come back as
    exact codes (a quantized cache, or an op that writes elsewhere)."""
    if max(block_size, heads, head_dim) > _EXACT:
        return None
    grid = torch.meshgrid(torch.arange(block_size), torch.arange(heads), torch.arange(head_dim), indexing="ij")
    block, saved = cache[SCRATCH_BLOCK], cache[SCRATCH_BLOCK].clone()
    codes = []
    try:
        for axis in grid:
            block.zero_()
            val = (axis + 1).to(cache.dtype)
            write(val, -val, torch.arange(block_size))
            codes.append(block.reshape(-1).to(torch.float32, copy=True))
    finally:
        block.copy_(saved)
    parts = []
    for sign in (1.0, -1.0):
        at = (torch.sign(codes[0]) == sign).nonzero().squeeze(1)
        idx = [(c[at] * sign - 1) for c in codes]
        if at.numel() != block_size * heads * head_dim or any(bool((i != i.round()).any()) for i in idx):
            return None
        t, h, d = (i.long() for i in idx)
        if bool((t < 0).any() | (t >= block_size).any() | (h < 0).any() | (h >= heads).any()
                | (d < 0).any() | (d >= head_dim).any()):
            return None
        where = torch.full((block_size, heads, head_dim), -1, dtype=torch.long)
        where[t, h, d] = at
        if bool((where < 0).any()):
            return None  # two codes landed on one place: not a bijection
        parts.append(where)
    return BlockLayout(parts[0], parts[1])


def _slots(block_ids: Sequence[int], block_size: int, start: int, end: int) -> tuple[Tensor, Tensor]:
    """Block id and offset in it of token positions ``[start, end)``."""
    t = torch.arange(start, end)
    return torch.tensor(list(block_ids), dtype=torch.long)[t // block_size], t % block_size


class PagedKV:
    """One worker's paged caches (one tensor per layer, block dimension first) with the
    attention layers whose op writes them."""

    def __init__(self, caches: Sequence[Tensor], layers: Sequence[Any], block_size: int) -> None:
        if len(caches) != len(layers):
            raise ValueError(f"{len(caches)} KV caches for {len(layers)} attention layers")
        self.caches, self.layers, self.block_size = list(caches), list(layers), block_size
        self.layout: BlockLayout | None = None  # set by self_check; None: reading is off
        # Hand vLLM's op [n, heads, head_dim] views of the caller's K/V rather than copies:
        # vLLM's CPU op follows strides, and the copies cost most of a write (fresh pages per
        # layer).  self_check falls back to copies for an op whose round trip needs them.
        self.strided = True

    def writer(self, layer: int) -> WriteFn:
        """vLLM's own cache-update op for ``layer``."""
        module, cache = self.layers[layer], self.caches[layer]
        update = module.impl.do_kv_cache_update
        return lambda k, v, slots: update(module, k, v, cache, slots)

    def write(self, block_ids: Sequence[int], start: int, k: Tensor, v: Tensor) -> None:
        """Write K (post-RoPE) and V ``[layers, heads, n, head_dim]`` of positions
        ``[start, start + n)`` through vLLM's op."""
        blk, off = _slots(block_ids, self.block_size, start, start + k.shape[2])
        slots = blk * self.block_size + off
        for layer, cache in enumerate(self.caches):
            k_l, v_l = k[layer].transpose(0, 1).to(cache.dtype), v[layer].transpose(0, 1).to(cache.dtype)
            if not self.strided:
                k_l, v_l = k_l.contiguous(), v_l.contiguous()
            self.writer(layer)(k_l, v_l, slots)

    def read(self, block_ids: Sequence[int], start: int, end: int) -> tuple[Tensor, Tensor]:
        """K (as stored: post-RoPE) and V ``[layers, heads, tokens, head_dim]`` of positions
        ``[start, end)``, through the layout the self-check verified."""
        if self.layout is None:
            raise RuntimeError("reading vLLM's KV blocks is off: the layout self-check did not pass")
        blk, off = _slots(block_ids, self.block_size, start, end)
        used, row = torch.unique(blk, return_inverse=True)
        ks, vs = [], []
        for cache in self.caches:
            flat = cache.index_select(0, used).reshape(len(used), -1)
            ks.append(flat[row[:, None, None], self.layout.k[off]].transpose(0, 1))
            vs.append(flat[row[:, None, None], self.layout.v[off]].transpose(0, 1))
        return torch.stack(ks), torch.stack(vs)

    @contextmanager
    def scratch(self) -> Iterator[int]:
        """The scratch block's id, for a check to write into; every layer's block is
        restored afterwards."""
        saved = [c[SCRATCH_BLOCK].clone() for c in self.caches]
        try:
            yield SCRATCH_BLOCK
        finally:
            for cache, block in zip(self.caches, saved, strict=True):
                cache[SCRATCH_BLOCK].copy_(block)


@dataclass
class LayoutCheck:
    """What :func:`self_check` found: ``ok`` means blended K/V may be written and vLLM's
    own K/V read back (``PagedKV.layout`` is set)."""

    ok: bool
    backend: str
    reason: str


def backend_name(layer: Any) -> str:
    isa = getattr(layer, "isa", None)
    return type(getattr(layer, "impl", None)).__name__ + (f" (isa {isa})" if isa else "")


def self_check(paged: PagedKV, probe_k: Tensor, probe_v: Tensor) -> LayoutCheck:
    """Derive the layout, compare it with the source-written one, and round-trip the
    reference ``probe_k``/``probe_v`` ``[layers, heads, n, head_dim]`` (n ≤ block size)
    through every layer's op in block 0; sets ``paged.layout`` when all of it holds."""
    first = paged.layers[0]
    name = backend_name(first)
    if len(paged.caches) != probe_k.shape[0]:
        return LayoutCheck(False, name, f"{len(paged.caches)} vLLM KV layers, the model has {probe_k.shape[0]}")
    if not callable(getattr(getattr(first, "impl", None), "do_kv_cache_update", None)):
        return LayoutCheck(False, name, "the attention backend has no do_kv_cache_update op to write through")
    heads, n, head_dim = probe_k.shape[1:]
    try:
        layout = derive_layout(paged.writer(0), paged.caches[0], paged.block_size, heads, head_dim)
    except Exception as e:  # noqa: BLE001 - any failure of the op is a failed check
        return LayoutCheck(False, name, f"vLLM's cache-update op failed on a probe: {type(e).__name__}: {e}")
    if layout is None:
        return LayoutCheck(False, name, "index probes written by vLLM's op did not come back as exact codes")
    spec = SOURCE_LAYOUTS.get(str(getattr(first, "isa", "")))
    if spec is not None:
        expected = derive_layout(spec(paged.caches[0], paged.block_size), paged.caches[0], paged.block_size,
                                 heads, head_dim)
        if expected is None or not expected.same_as(layout):
            return LayoutCheck(False, name, f"vLLM's op does not store the {first.isa!r} layout this "
                                            "connector was written for")
    paged.layout = layout
    for strided in (True, False):  # views where the op follows strides, else contiguous copies
        paged.strided = strided
        with paged.scratch() as block:
            paged.write([block], 0, probe_k, probe_v)
            k, v = paged.read([block], 0, n)
        dtype = paged.caches[0].dtype
        if torch.equal(k, probe_k.to(dtype)) and torch.equal(v, probe_v.to(dtype)):
            how = "" if strided else " (K/V handed to the op as contiguous copies: it does not follow strides)"
            return LayoutCheck(True, name, "layout derived from vLLM's op, reference chunk read back equal" + how)
    paged.layout = None
    return LayoutCheck(False, name, "a reference chunk written through vLLM's op did not read back equal")
