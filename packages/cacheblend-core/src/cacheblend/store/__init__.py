"""KV store: tiers behind one ``get``/``put``/``delete`` interface.

Spec strings (``Engine.load(store=...)``, see :mod:`.spec`): ``"memory"``,
``"memory:2GB"``, ``"disk:PATH"``, ``"disk:PATH:50GB"``, ``"redis://HOST:PORT/DB"``, or
several joined by commas, fastest first, with ``namespace=NAME`` and ``key=SECRET``
options.  ``None`` means memory (4 GB) plus a disk tier (20 GB) under the cache dir:
bounded, because one 600-token chunk of a small model is already ~28 MB.
"""

from __future__ import annotations

from ..cache.keys import chunk_key
from .disk import DiskStore, NotAStore
from .entry import ChunkKV, CorruptEntry, LayerSource
from .memory import MemoryStore
from .signing import KEY_ENV, Signer
from .spec import DEFAULT_DISK, DEFAULT_MEMORY, StoreOptions, hide_secrets, is_size, parse_size, split_spec
from .tiered import Tier, TieredStore

__all__ = ["DEFAULT_DISK", "DEFAULT_MEMORY", "KEY_ENV", "ChunkKV", "CorruptEntry", "DiskStore", "LayerSource",
           "MemoryStore", "NotAStore", "RedisStore", "Signer", "StoreOptions", "Tier", "TieredStore", "chunk_key",
           "open_store", "parse_size", "tier_total"]


def tier_total(store: Tier, counter: str) -> int:
    """A counter summed over the store's tiers: ``"corrupt"``, entries found damaged or
    unsigned and dropped (at open or mid-read, each counted once by its tier);
    ``"unreachable"``, failed calls to a remote tier."""
    tiers = getattr(store, "tiers", None) or [store]
    return sum(int(getattr(t, counter, 0)) for t in tiers)


def __getattr__(name: str):
    if name == "RedisStore":  # redis-py is imported only when a Redis tier is used
        from .redis_tier import RedisStore

        return RedisStore
    raise AttributeError(name)


def open_store(spec: str | Tier | None, *, create: bool = True) -> Tier:
    """Build a store from a spec string, or pass a store object through.  ``create=False``
    (the store commands) refuses a disk path that holds no store yet."""
    if spec is None:
        from ..models.loader import cache_home

        spec = f"memory:{DEFAULT_MEMORY},disk:{cache_home() / 'kv'}:{DEFAULT_DISK}"
    if not isinstance(spec, str):
        return spec
    parts, options = split_spec(spec)
    tiers = [_tier(part, options, create) for part in parts]
    return tiers[0] if len(tiers) == 1 else TieredStore(tiers)


def _tier(spec: str, options: StoreOptions, create: bool) -> Tier:
    if spec.lower().startswith(("redis://", "rediss://", "unix://")):
        from .redis_tier import RedisStore

        try:
            return RedisStore(spec, prefix=options.redis_prefix, signer=options.signer)
        except ValueError:  # redis-py's message quotes pieces of the URL: its password too
            raise ValueError(f"cannot read the Redis URL {hide_secrets(spec)!r} (write ',' '@' ':' '/' in a "
                             "password %-encoded)") from None
    kind, _, arg = spec.partition(":")
    kind = kind.lower()
    if kind == "memory":
        return MemoryStore(parse_size(arg) if arg else None)
    if kind == "disk":
        if not arg:
            raise ValueError("disk tier needs a path: 'disk:PATH' or 'disk:PATH:SIZE'")
        path, _, size = arg.rpartition(":")
        if path and size.strip().replace(".", "", 1).isdigit():
            parse_size(size)  # a number without a unit: refused, naming the unit it lacks
        path, capacity = (path, parse_size(size)) if path and is_size(size) else (arg, None)
        return DiskStore(path, capacity, namespace=options.namespace, signer=options.signer, create=create)
    raise ValueError(
        f"unknown store tier {hide_secrets(spec)!r}; known: 'memory[:SIZE]', 'disk:PATH[:SIZE]', "
        "'redis://HOST:PORT/DB', and the options 'namespace=NAME', 'key=SECRET'"
    )
