"""Reading one disk-tier entry a layer at a time, each layer checked against its digest
after it is copied out of the mapped file (what is checked is exactly what is served)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors import safe_open
from torch import Tensor

from .disk_layout import FORMAT, VERSION
from .entry import CorruptEntry, digest_of, layer_digest

if TYPE_CHECKING:
    from .disk import DiskStore

__all__ = ["DiskSource"]


class DiskSource:
    """One verified entry, read a layer at a time (each layer checked against its digest)."""

    tier = "disk"

    def __init__(self, store: DiskStore, key: str, path: Path) -> None:
        self._store, self.key = store, key
        try:
            self._file = safe_open(str(path), framework="pt")
        except Exception as e:
            # Evicted by another process since it was looked up: a miss, not corruption.
            # safetensors reports a vanished file as a RuntimeError, not FileNotFoundError.
            if isinstance(e, FileNotFoundError) or not path.exists():
                raise FileNotFoundError(str(path)) from e
            raise CorruptEntry(f"{path}: {e}") from e
        try:
            meta = self._file.metadata() or {}
            ok = meta.get("format") == FORMAT and meta.get("version") == VERSION and meta.get("key") == key
            self.num_layers = int(meta["layers"])
            self.num_tokens = int(meta["tokens"])
            self._algorithm, digests_field = digest_of(meta)
            self._digests = json.loads(meta[digests_field])
            # a header damaged into another shape (a dict of digests, no layers) is damage,
            # never an exception in the request that reads it
            ok = ok and isinstance(self._digests, list) and all(isinstance(d, str) for d in self._digests)
            ok = ok and self.num_layers >= 1 and self.num_tokens >= 1 and len(self._digests) == self.num_layers
        except Exception as e:  # unreadable header: truncated, overwritten, foreign
            raise CorruptEntry(f"{path}: {e}") from e
        if not ok:
            raise CorruptEntry(f"{path}: header does not describe key {key}")
        self.meta = {k: v for k, v in meta.items() if k != digests_field}
        signer = store.signer
        if signer is not None and not signer.valid(key, self.meta, self._digests):
            store.unsigned += 1
            raise CorruptEntry(f"{path}: no valid signature")
        self._shape: tuple[int, ...] | None = None

    def layer(self, index: int):
        return self.layer_into(index)

    def layer_into(self, index: int, k_out: Tensor | None = None, v_out: Tensor | None = None):
        """Layer ``index``, copied into ``k_out``/``v_out`` when given (the whole-entry buffer
        a tiered store promotes: one copy instead of two), checked after the copy."""
        try:
            # Copies, not views: safetensors maps the file, so a view would change under
            # us if the file is overwritten in place after the digest check; what is
            # checked must be exactly what is served.
            k, v = (_copy(self._file.get_tensor(f"{part}.{index}"), out)
                    for part, out in (("k", k_out), ("v", v_out)))
        except Exception as e:
            self._store.condemn(self.key)
            raise CorruptEntry(f"{self.key}: layer {index} unreadable: {e}") from e
        self._shape = self._shape or tuple(k.shape)
        ok = k.dim() == 3 and k.shape == v.shape == self._shape and k.shape[1] == self.num_tokens
        # The signature covers the header's metadata, not each tensor's dtype (safetensors
        # keeps it beside), and the digests hash bytes: the signed dtype must be the one read.
        ok = ok and str(k.dtype) == str(v.dtype) == self.meta.get("dtype")
        if not ok or layer_digest(k, v, self._algorithm) != self._digests[index]:
            self._store.condemn(self.key)
            raise CorruptEntry(f"{self.key}: layer {index} fails its checksum, shape or dtype")
        return k, v


def _copy(stored: Tensor, out: Tensor | None) -> Tensor:
    """``stored`` copied, into ``out`` if given; an ``out`` of another shape or dtype is an
    entry that does not match its own first layer: damaged.

    The bytes are copied by numpy, on the calling thread alone.  Layers are often read on
    the loader's thread (read-ahead, or a request with a deadline); there torch's copy
    started a second OpenMP team that spun beside the fusor's on the same cores.  Measured
    on 2 cores (``benchmarks/store_tiers.py --limit 8``, musique dev, blend at 15 %): a
    serial disk read under a timeout cost +0.08–0.10 s of TTFT over an inline one with
    torch's copy, +0.01–0.03 s with this one; read-ahead from disk +16–18 % over memory
    → +10.5–10.7 %.
    A copy is bound by memory bandwidth, so one thread copies as fast as two."""
    if out is None:
        out = torch.empty_like(stored, memory_format=torch.contiguous_format)
    elif out.shape != stored.shape or out.dtype != stored.dtype:
        raise ValueError(f"layer of shape {tuple(stored.shape)} {stored.dtype}, the entry's others "
                         f"{tuple(out.shape)} {out.dtype}")
    if not out.is_contiguous() or not out.numel():
        return out.copy_(stored)
    np.copyto(out.view(torch.uint8).numpy(), stored.contiguous().view(torch.uint8).numpy())
    return out
