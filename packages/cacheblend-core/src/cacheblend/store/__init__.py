"""KV store tiers. Issue 2 ships the memory tier; slower tiers plug in behind the same
``get``/``put``/``delete`` interface."""

from .entry import ChunkKV
from .keys import chunk_key
from .memory import MemoryStore

__all__ = ["ChunkKV", "MemoryStore", "chunk_key", "open_store"]


def open_store(spec: "str | MemoryStore | None") -> MemoryStore:
    """Build a store from a spec: ``None``/``"memory"``/``"memory:2GB"`` or a store object."""
    if spec is None:
        return MemoryStore()
    if not isinstance(spec, str):
        return spec
    kind, _, arg = spec.partition(":")
    if kind == "memory":
        return MemoryStore(parse_size(arg) if arg else None)
    raise ValueError(f"unknown store spec {spec!r}; this build supports 'memory' and 'memory:SIZE'")


def parse_size(text: str) -> int:
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
