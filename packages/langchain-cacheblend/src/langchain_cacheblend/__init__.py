"""LangChain integration of CacheBlend: swap :class:`ChatCacheBlend` into a chain and the
retrieved passages' KV caches are reused with selective recompute."""

from ._version import __version__
from .chains import create_cacheblend_retrieval_chain
from .chat_models import ChatCacheBlend
from .vectorstores import CACHE_KEY, CacheBlendVectorStore

__all__ = ["CACHE_KEY", "CacheBlendVectorStore", "ChatCacheBlend", "__version__", "create_cacheblend_retrieval_chain"]
