"""CacheBlend: fast RAG prefill by reusing chunk KV caches with selective recompute
(Yao et al., arXiv 2405.16444).

Names are imported on first use, so that ``import cacheblend.remote`` (a client of a
vLLM server) or ``cacheblend.config`` does not load torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    from .backend import Backend, GenerationRun
    from .config import METHODS, BlendConfig, EngineConfig, RequestOptions, SamplingConfig
    from .engine import Engine
    from .errors import CacheBlendError, UnknownChunkError
    from .generate.generation import Generation
    from .results import BlendStats, ChunkHandle, Result
    from .store import ChunkKV, DiskStore, MemoryStore, TieredStore

_WHERE = {
    "Backend": "backend", "GenerationRun": "backend",
    "METHODS": "config", "BlendConfig": "config", "EngineConfig": "config", "RequestOptions": "config",
    "SamplingConfig": "config",
    "Engine": "engine", "Generation": "generate.generation",
    "CacheBlendError": "errors", "UnknownChunkError": "errors",
    "BlendStats": "results", "ChunkHandle": "results", "Result": "results",
    "ChunkKV": "store", "DiskStore": "store", "MemoryStore": "store", "TieredStore": "store",
}
__all__ = [
    "METHODS", "Backend", "BlendConfig", "BlendStats", "CacheBlendError", "ChunkHandle", "ChunkKV", "DiskStore",
    "Engine", "EngineConfig", "Generation", "GenerationRun", "MemoryStore", "RequestOptions", "Result",
    "SamplingConfig", "TieredStore", "UnknownChunkError", "__version__",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'cacheblend' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
