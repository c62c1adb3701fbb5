"""CacheBlend: fast RAG prefill by reusing chunk KV caches with selective recompute
(Yao et al., arXiv 2405.16444)."""

from .blend.selection import BlendConfig
from .decode import SamplingConfig
from .engine import (
    METHODS,
    BlendStats,
    CacheBlendError,
    ChunkHandle,
    Engine,
    Generation,
    Result,
    UnknownChunkError,
)
from .store import ChunkKV, DiskStore, MemoryStore, TieredStore

__all__ = [
    "METHODS",
    "BlendConfig",
    "BlendStats",
    "CacheBlendError",
    "ChunkHandle",
    "ChunkKV",
    "Engine",
    "Generation",
    "DiskStore",
    "MemoryStore",
    "TieredStore",
    "Result",
    "SamplingConfig",
    "UnknownChunkError",
]
__version__ = "0.1.0"
