"""CacheBlend: fast RAG prefill by reusing chunk KV caches with selective recompute
(Yao et al., arXiv 2405.16444)."""

from .blend.selection import BlendConfig
from .decode import SamplingConfig
from .engine import METHODS, BlendStats, CacheBlendError, ChunkHandle, Engine, Result, UnknownChunkError
from .store import ChunkKV, MemoryStore

__all__ = [
    "METHODS",
    "BlendConfig",
    "BlendStats",
    "CacheBlendError",
    "ChunkHandle",
    "ChunkKV",
    "Engine",
    "MemoryStore",
    "Result",
    "SamplingConfig",
    "UnknownChunkError",
]
__version__ = "0.1.0"
