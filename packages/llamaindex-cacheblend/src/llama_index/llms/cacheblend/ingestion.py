"""``CacheBlendKVTransform``: precompute each node's KV cache at ingestion time.

The text cached must be exactly the text that later reaches the model.  Synthesizers
(ours and LlamaIndex's) put ``node.get_content(metadata_mode=MetadataMode.LLM)`` in
the prompt: the node's text with its LLM-visible metadata in front.  So that is what is
ingested, after the chunk key itself is hidden from the LLM (and from the embedding),
since a key that appeared in the text would change the text it is the key of.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.bridge.pydantic import Field
from llama_index.core.schema import BaseNode, MetadataMode, TransformComponent
from tqdm.auto import tqdm

from cacheblend.aio import run_in_thread

from .base import CacheBlendLLM

KEY = "cacheblend_key"


class CacheBlendKVTransform(TransformComponent):
    """Ingests every node into the LLM's engine and records its chunk key in
    ``node.metadata["cacheblend_key"]`` (excluded from embedding and LLM text).

    Put it last in an ``IngestionPipeline`` (after splitters and metadata extractors), so
    the cached text is final.  Nodes whose cache is already stored cost no compute: the
    engine looks the key up first.  An ``IngestionCache`` hit skips this transform
    altogether; caches missing then (a fresh memory store) are computed on first use."""

    llm: CacheBlendLLM = Field(description="Whose engine (model and store) holds the caches.")
    show_progress: bool = Field(default=False, description="tqdm progress bar over the nodes.")

    @classmethod
    def class_name(cls) -> str:
        return "CacheBlendKVTransform"

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        engine = self.llm.engine
        show = bool(kwargs.get("show_progress", self.show_progress))
        for node in tqdm(nodes, desc="CacheBlend KV", disable=not show):
            for hidden in (node.excluded_embed_metadata_keys, node.excluded_llm_metadata_keys):
                if KEY not in hidden:
                    hidden.append(KEY)
            text = node.get_content(metadata_mode=MetadataMode.LLM)
            if not text.strip():
                continue  # nothing the model would read
            (handle,) = engine.ingest([text])
            node.metadata[KEY] = handle.key
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        return await run_in_thread(self.__call__, nodes, **kwargs)
