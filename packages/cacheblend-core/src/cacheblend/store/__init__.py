"""KV store: tiers behind one ``get``/``put``/``delete`` interface.

Spec strings (``Engine.load(store=...)``): ``"memory"``, ``"memory:2GB"``,
``"disk:PATH"``, ``"disk:PATH:50GB"``, ``"redis://HOST:PORT/DB"``, or several joined by
commas, fastest first.  ``None`` means memory (4 GB) plus a disk tier (20 GB) under the
cache dir: bounded, because one 600-token chunk of a small model is already ~28 MB.
"""

from __future__ import annotations

from ..cache.keys import chunk_key
from .disk import DiskStore
from .entry import ChunkKV, CorruptEntry, LayerSource
from .memory import MemoryStore
from .tiered import Tier, TieredStore

__all__ = ["ChunkKV", "CorruptEntry", "DiskStore", "LayerSource", "MemoryStore", "RedisStore", "Tier",
           "TieredStore", "chunk_key", "tier_total", "open_store", "parse_size"]


def tier_total(store: Tier, counter: str) -> int:
    """A counter summed over the store's tiers: ``"corrupt"``, entries found damaged and
    dropped (at open or mid-read, each counted once by its tier); ``"unreachable"``,
    failed calls to a remote tier."""
    tiers = getattr(store, "tiers", None) or [store]
    return sum(int(getattr(t, counter, 0)) for t in tiers)


def __getattr__(name: str):
    if name == "RedisStore":  # redis-py is imported only when a Redis tier is used
        from .redis_tier import RedisStore

        return RedisStore
    raise AttributeError(name)


DEFAULT_MEMORY = "4GB"
DEFAULT_DISK = "20GB"


def open_store(spec: str | Tier | None) -> Tier:
    """Build a store from a spec string, or pass a store object through."""
    if spec is None:
        from ..models.loader import cache_home

        spec = f"memory:{DEFAULT_MEMORY},disk:{cache_home() / 'kv'}:{DEFAULT_DISK}"
    if not isinstance(spec, str):
        return spec
    tiers = [_tier(part.strip()) for part in spec.split(",") if part.strip()]
    if not tiers:
        raise ValueError(f"empty store spec {spec!r}")
    return tiers[0] if len(tiers) == 1 else TieredStore(tiers)


def _tier(spec: str) -> Tier:
    if spec.startswith(("redis://", "rediss://", "unix://")):
        from .redis_tier import RedisStore

        return RedisStore(spec)
    kind, _, arg = spec.partition(":")
    if kind == "memory":
        return MemoryStore(parse_size(arg) if arg else None)
    if kind == "disk":
        if not arg:
            raise ValueError("disk tier needs a path: 'disk:PATH' or 'disk:PATH:SIZE'")
        path, _, size = arg.rpartition(":")
        if path and _is_size(size):
            return DiskStore(path, parse_size(size))
        return DiskStore(arg)
    raise ValueError(
        f"unknown store tier {spec!r}; known: 'memory[:SIZE]', 'disk:PATH[:SIZE]', 'redis://HOST:PORT/DB'"
    )


def _is_size(text: str) -> bool:
    try:
        parse_size(text)
        return True
    except ValueError:
        return False


def parse_size(text: str) -> int:
    """'512MB', '2GB', '1GiB' → bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    unit = t[len(num):]
    if not num or unit not in units:
        raise ValueError(f"cannot read size {text!r} (examples: 512MB, 2GB, 1GiB)")
    try:
        return int(float(num) * units[unit])
    except ValueError as e:
        raise ValueError(f"cannot read size {text!r}") from e
