"""Disk tier: one safetensors file per chunk, written atomically, verified on read.

Layout: ``ROOT/<key[:2]>/<key>.safetensors`` holding ``k.<layer>`` and ``v.<layer>``
tensors (``[kv_heads, tokens, head_dim]``), so one layer can be read without the rest.
The header metadata carries the format version, the key, the shape and a sha256 of the
tensor bytes.  An entry that is truncated, corrupted or not what its name says is
counted, deleted and reported as a miss, so the engine recomputes it — never serves it.
No pickle: safetensors only.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import threading
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .entry import ChunkKV

FORMAT = "cacheblend-kv"
VERSION = "1"


def _digest(kv: ChunkKV) -> str:
    h = hashlib.sha256()
    for layer in range(kv.k.shape[0]):
        for t in (kv.k[layer], kv.v[layer]):
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class DiskStore:
    """Chunk caches as files under ``root``."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self.corrupt = 0
        self.write_errors = 0
        self._lock = threading.Lock()

    def path(self, key: str) -> Path:
        if len(key) < 3 or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"not a chunk key: {key!r}")
        return self.root / key[:2] / f"{key}.safetensors"

    def __contains__(self, key: str) -> bool:
        return self.path(key).is_file()

    def get(self, key: str) -> ChunkKV | None:
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        kv = self._decode(key, data)
        if kv is None:
            with self._lock:
                self.corrupt += 1
            path.unlink(missing_ok=True)
        return kv

    def _decode(self, key: str, data: bytes) -> ChunkKV | None:
        try:
            header_len = struct.unpack("<Q", data[:8])[0]
            meta = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
            if meta.get("format") != FORMAT or meta.get("version") != VERSION or meta.get("key") != key:
                return None
            tensors = st_load(data)
            layers = int(meta["layers"])
            kv = ChunkKV(
                torch.stack([tensors[f"k.{i}"] for i in range(layers)]),
                torch.stack([tensors[f"v.{i}"] for i in range(layers)]),
            )
            if kv.num_tokens != int(meta["tokens"]) or _digest(kv) != meta["sha256"]:
                return None
            return kv
        except Exception:  # any parse failure means the entry cannot be trusted
            return None

    def put(self, key: str, kv: ChunkKV) -> bool:
        path = self.path(key)
        tensors = {}
        for i in range(kv.k.shape[0]):
            tensors[f"k.{i}"] = kv.k[i].contiguous()
            tensors[f"v.{i}"] = kv.v[i].contiguous()
        meta = {
            "format": FORMAT, "version": VERSION, "key": key, "layers": str(kv.k.shape[0]),
            "tokens": str(kv.num_tokens), "dtype": str(kv.k.dtype), "sha256": _digest(kv),
        }
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(st_save(tensors, meta))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)  # readers see the old entry or the whole new one
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError:
            with self._lock:
                self.write_errors += 1
            return False
        return True

    def delete(self, key: str) -> bool:
        try:
            self.path(key).unlink()
            return True
        except FileNotFoundError:
            return False

    def keys(self) -> list[str]:
        return [p.stem for p in self.root.glob("??/*.safetensors")]

    def clear(self) -> None:
        for key in self.keys():
            self.delete(key)
