"""LlamaIndex integration of CacheBlend (arXiv 2405.16444): reuse the KV caches of
retrieved chunks with selective recompute.

- :class:`CacheBlendLLM`: a drop-in LLM; passages it knows are found in any prompt.
- :class:`CacheBlendSynthesizer` / :func:`cacheblend_query_engine`: stuff mode, every
  retrieved node one blended chunk.
- :class:`CacheBlendKVTransform`: precompute node caches in an ``IngestionPipeline``.
"""

from ._version import __version__
from .base import CacheBlendLLM
from .ingestion import CacheBlendKVTransform
from .synthesizer import CacheBlendSynthesizer, cacheblend_query_engine

__all__ = ["CacheBlendKVTransform", "CacheBlendLLM", "CacheBlendSynthesizer", "__version__", "cacheblend_query_engine"]
