"""Ingestion hook: a vector store wrapper that precomputes each chunk's KV as it is indexed.

Wrap any LangChain vector store; ``add_documents``/``add_texts`` precompute and store the
KV of every text, record its cache key in the document metadata (``cacheblend_key``) and
then add the documents to the wrapped store.  ``delete`` releases the caches of the
documents it removes.  This is what ``langchain_core.indexing.index`` with a RecordManager
needs: unchanged documents are skipped before they reach ``add_documents`` (so re-indexing
costs nothing), and documents the index deletes or replaces release their stale caches.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import InMemoryVectorStore, VectorStore
from tqdm.auto import tqdm

from .chat_models import ChatCacheBlend

CACHE_KEY = "cacheblend_key"
log = logging.getLogger(__name__)


class CacheBlendVectorStore(VectorStore):
    """``vectorstore`` with the KV of every added text precomputed by ``llm``'s engine."""

    def __init__(self, vectorstore: VectorStore, llm: ChatCacheBlend | None = None, *,
                 show_progress: bool | None = None, progress_min: int = 16) -> None:
        self.vectorstore = vectorstore
        self.llm = llm or ChatCacheBlend()
        self.show_progress = show_progress
        self.progress_min = progress_min  # a progress bar from this many texts on (show_progress None)

    @property
    def embeddings(self) -> Embeddings | None:
        return self.vectorstore.embeddings

    # -- writes: precompute, then delegate -------------------------------------------------
    def _precompute(self, texts: Sequence[str]) -> list[str | None]:
        """Each text's cache key; None for a blank text (an image-only PDF page): no passage
        to reuse, and the rest of the batch is still added."""
        show = self.show_progress if self.show_progress is not None else len(texts) >= self.progress_min
        return [self.llm.ingest([t])[0] if t.strip() else None
                for t in tqdm(texts, desc="cacheblend: precomputing KV", disable=not show)]

    def add_documents(self, documents: list[Document], **kwargs: Any) -> list[str]:
        keys = self._precompute([d.page_content for d in documents])
        tagged = [Document(page_content=d.page_content, metadata={**d.metadata, CACHE_KEY: key} if key else d.metadata,
                           id=d.id) for d, key in zip(documents, keys, strict=True)]
        return self.vectorstore.add_documents(tagged, **kwargs)

    def add_texts(self, texts: Iterable[str], metadatas: list[dict] | None = None, *,
                  ids: list[str] | None = None, **kwargs: Any) -> list[str]:
        texts = list(texts)
        metadatas = metadatas or [{} for _ in texts]
        docs = [Document(page_content=t, metadata=m, id=ids[i] if ids else None)
                for i, (t, m) in enumerate(zip(texts, metadatas, strict=True))]
        if ids:
            kwargs["ids"] = ids
        return self.add_documents(docs, **kwargs)

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool | None:
        """Delete from the wrapped store and release the caches of the removed texts."""
        if ids:
            try:
                gone = [d.page_content for d in self.vectorstore.get_by_ids(ids) if d.page_content.strip()]
            except NotImplementedError:  # LangChain's default: the store cannot say what the ids hold
                log.warning("%s cannot look documents up by id: the caches of the %d deleted ones stay stored "
                            "(release them with llm.release(texts))", type(self.vectorstore).__name__, len(ids))
                gone = []
            result = self.vectorstore.delete(ids, **kwargs)
            if result is not False:  # False: the store deleted nothing (LangChain's index() then raises)
                self.llm.release([t for t in dict.fromkeys(gone) if not self._still_held(t)])
            return result
        return self.vectorstore.delete(ids, **kwargs)

    def _still_held(self, text: str) -> bool:
        """Whether a remaining document holds ``text`` (its nearest neighbour is the same
        text): caches are by content, so a document re-indexed with new metadata, or a
        paragraph two files share, must keep its cache when the other copy is deleted.
        Where the store cannot search, the cache is kept: a stale cache costs space, a
        missing one a recompute."""
        try:
            return any(d.page_content == text for d in self.vectorstore.similarity_search(text, k=1))
        except Exception as e:  # noqa: BLE001 - any store's failure: keep the cache
            log.warning("cannot tell whether another document holds a deleted text (%s); its cache stays", e)
            return True

    def get_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        return self.vectorstore.get_by_ids(ids)

    # -- reads: the wrapped store's -------------------------------------------------------
    def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        return self.vectorstore.similarity_search(query, k=k, **kwargs)

    def similarity_search_with_score(self, *args: Any, **kwargs: Any) -> list[tuple[Document, float]]:
        return self.vectorstore.similarity_search_with_score(*args, **kwargs)

    def similarity_search_by_vector(self, embedding: list[float], k: int = 4, **kwargs: Any) -> list[Document]:
        return self.vectorstore.similarity_search_by_vector(embedding, k=k, **kwargs)

    def max_marginal_relevance_search_by_vector(self, embedding: list[float], k: int = 4, fetch_k: int = 20,
                                                lambda_mult: float = 0.5, **kwargs: Any) -> list[Document]:
        return self.vectorstore.max_marginal_relevance_search_by_vector(embedding, k=k, fetch_k=fetch_k,
                                                                        lambda_mult=lambda_mult, **kwargs)

    async def asimilarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        return await self.vectorstore.asimilarity_search(query, k=k, **kwargs)

    async def amax_marginal_relevance_search(self, query: str, k: int = 4, fetch_k: int = 20,
                                             lambda_mult: float = 0.5, **kwargs: Any) -> list[Document]:
        return await self.vectorstore.amax_marginal_relevance_search(query, k=k, fetch_k=fetch_k,
                                                                     lambda_mult=lambda_mult, **kwargs)

    def max_marginal_relevance_search(self, query: str, k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5,
                                      **kwargs: Any) -> list[Document]:
        return self.vectorstore.max_marginal_relevance_search(query, k=k, fetch_k=fetch_k, lambda_mult=lambda_mult,
                                                              **kwargs)

    def similarity_search_with_relevance_scores(self, query: str, k: int = 4,
                                                **kwargs: Any) -> list[tuple[Document, float]]:
        return self.vectorstore.similarity_search_with_relevance_scores(query, k=k, **kwargs)

    async def asimilarity_search_with_relevance_scores(self, query: str, k: int = 4,
                                                       **kwargs: Any) -> list[tuple[Document, float]]:
        return await self.vectorstore.asimilarity_search_with_relevance_scores(query, k=k, **kwargs)

    @classmethod
    def from_texts(cls, texts: list[str], embedding: Embeddings, metadatas: list[dict] | None = None, *,
                   llm: ChatCacheBlend | None = None, ids: list[str] | None = None,
                   **kwargs: Any) -> CacheBlendVectorStore:
        """An in-memory vector store over ``texts`` with their KV precomputed."""
        store = cls(InMemoryVectorStore(embedding), llm, **kwargs)
        store.add_texts(texts, metadatas, ids=ids)
        return store
