"""Stuff mode: every retrieved chunk goes into ONE blended prompt.

LlamaIndex's own synthesizers format the chunks into a prompt template (and ``compact``
re-splits them to fit the window), so the model only sees one string; the engine then has
to find the chunks again by text.  ``CacheBlendSynthesizer`` hands the chunk texts
straight to :meth:`Engine.start` instead, so each one is a chunk whose cache is reused
by key, whatever the query.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Generator, Sequence
from typing import Any

from llama_index.core import Settings
from llama_index.core.base.llms.types import CompletionResponse
from llama_index.core.base.response.schema import RESPONSE_TYPE
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.indices.base import BaseIndex
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import BasePromptTemplate, PromptTemplate
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore
from llama_index.core.types import RESPONSE_TEXT_TYPE

from cacheblend import CacheBlendError
from cacheblend.aio import iterate_in_thread, run_in_thread
from cacheblend.backend import GenerationRun

from .base import CacheBlendLLM, finish, raw_of

_SINK = "_cacheblend_stats"  # response kwarg through which get_response reports its stats


class CacheBlendSynthesizer(BaseSynthesizer):
    """Answers from one prompt ``[system][preamble][chunk 1]…[chunk k][query]`` whose
    chunks are blended from their caches.

    ``Response.metadata["cacheblend"]`` holds the blend stats (``reused_tokens``,
    ``recomputed_tokens``, ``ttft_s``, ...); with ``streaming=True`` that dict is filled
    in once the stream has been read to its end.  The LLM's options (method, ratio,
    max_tokens, ...) apply; ``system`` (else the LLM's ``system_prompt``) replaces the chat
    template's default system message, ``preamble`` is text before the chunks and ``query_template`` frames the
    query after them (``{query_str}`` is replaced)."""

    def __init__(self, llm: CacheBlendLLM | None = None, *, streaming: bool = False, system: str | None = None,
                 preamble: str = "", query_template: str = "{query_str}", **kwargs: Any) -> None:
        if llm is None:  # LlamaIndex's convention: the global LLM (Settings.llm), if it is ours
            # read without Settings.llm's getter, which would resolve LlamaIndex's default (OpenAI)
            default = getattr(Settings, "_llm", None)
            llm = default if isinstance(default, CacheBlendLLM) else CacheBlendLLM()
        if not isinstance(llm, CacheBlendLLM):
            raise CacheBlendError(f"CacheBlendSynthesizer needs a CacheBlendLLM, got {type(llm).__name__}")
        super().__init__(llm=llm, streaming=streaming, **kwargs)
        self._cb_llm = llm
        self.system = system
        self.preamble = preamble
        if "{query_str}" not in query_template:
            raise CacheBlendError("query_template must contain {query_str}")
        self.query_template = query_template

    def _get_prompts(self) -> dict[str, Any]:
        """One prompt: ``query_template``, the text after the chunks (the chunks themselves
        are blended from their caches, never formatted into a template)."""
        return {"query_template": PromptTemplate(self.query_template)}

    def _update_prompts(self, prompts_dict: dict[str, Any]) -> None:
        unknown = sorted(set(prompts_dict) - {"query_template"})
        if unknown:
            raise CacheBlendError(
                f"CacheBlendSynthesizer has one prompt, 'query_template' (the text after the blended chunks, with "
                f"{{query_str}}), not {unknown}; set system= and preamble= for the text before the chunks")
        template = prompts_dict["query_template"]
        text = template.get_template() if isinstance(template, BasePromptTemplate) else template
        if not isinstance(text, str) or "{query_str}" not in text:
            raise CacheBlendError("query_template must be a prompt or string containing {query_str}")
        self.query_template = text

    # -- the blended call ------------------------------------------------------------------
    def _start(self, query_str: str, text_chunks: Sequence[str], kwargs: dict[str, Any]) -> GenerationRun:
        chunks = [c for c in text_chunks if c.strip()]  # an empty node has nothing to cache
        opts = self._cb_llm.options(kwargs)
        if opts.pop("documents", None):
            raise CacheBlendError("the synthesizer takes its chunks from the nodes, not documents=")
        query = self.query_template.replace("{query_str}", query_str)
        system = self.system if self.system is not None else self._cb_llm.system_prompt  # the LLM's, unless set here
        return self._cb_llm.engine.start(query, chunks, system=system, preamble=self.preamble, **opts)

    def _event(self, query_str: str, chunks: Sequence[str]) -> str:
        """An LLM callback event, so that handlers (``TokenCountingHandler``) see the call."""
        prompt = "\n\n".join([*chunks, query_str])
        return self.callback_manager.on_event_start(CBEventType.LLM, payload={EventPayload.PROMPT: prompt})

    def _done(self, event_id: str, query_str: str, gen: GenerationRun, sink: dict | None) -> None:
        result = gen.result
        assert result is not None
        if sink is not None:
            sink.update(result.metadata())
        response = CompletionResponse(text=result.text, raw=raw_of(result))
        self.callback_manager.on_event_end(CBEventType.LLM, event_id=event_id,
                                           payload={EventPayload.PROMPT: query_str, EventPayload.COMPLETION: response})

    def _failed(self, event_id: str, error: BaseException) -> None:
        """End the LLM event with the error, as LlamaIndex's own LLM callbacks do: handlers
        (``LlamaDebugHandler``, tracing) would otherwise keep an event that never ends."""
        self.callback_manager.on_event_end(CBEventType.LLM, event_id=event_id,
                                           payload={EventPayload.EXCEPTION: error})

    def _stream(self, query_str: str, gen: GenerationRun, event_id: str,
                sink: dict | None) -> Generator[str, None, None]:
        try:
            yield from gen.pieces
        except BaseException as e:  # a timeout, a cancelled stream (GeneratorExit) too
            self._failed(event_id, e)
            raise
        finally:
            gen.pieces.close()
        self._done(event_id, query_str, gen, sink)

    def get_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any) -> RESPONSE_TEXT_TYPE:
        sink = kwargs.pop(_SINK, None)
        gen = self._start(query_str, text_chunks, kwargs)
        event_id = self._event(query_str, text_chunks)
        if self._streaming:
            return self._stream(query_str, gen, event_id, sink)
        try:
            finish(gen)
        except BaseException as e:
            self._failed(event_id, e)
            raise
        self._done(event_id, query_str, gen, sink)
        return gen.result.text  # type: ignore[union-attr]

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any) -> RESPONSE_TEXT_TYPE:
        sink = kwargs.pop(_SINK, None)
        gen = await run_in_thread(self._start, query_str, text_chunks, kwargs)
        event_id = self._event(query_str, text_chunks)
        if self._streaming:
            return self._astream(iterate_in_thread(lambda: self._stream(query_str, gen, event_id, sink)))
        try:
            await run_in_thread(finish, gen)
        except BaseException as e:
            self._failed(event_id, e)
            raise
        self._done(event_id, query_str, gen, sink)
        return gen.result.text  # type: ignore[union-attr]

    @staticmethod
    async def _astream(pieces: AsyncIterator[str]) -> AsyncGenerator[str, None]:
        async for piece in pieces:  # an async generator, as AsyncStreamingResponse expects
            yield piece

    # -- responses carry the stats ------------------------------------------------------------
    @staticmethod
    def _attach(response: RESPONSE_TYPE, sink: dict) -> RESPONSE_TYPE:
        metadata = getattr(response, "metadata", None)
        if metadata is None:
            metadata = response.metadata = {}
        metadata["cacheblend"] = sink
        return response

    def synthesize(self, query: Any, nodes: list[NodeWithScore],
                   additional_source_nodes: Sequence[NodeWithScore] | None = None, **kwargs: Any) -> RESPONSE_TYPE:
        sink: dict = {}
        response = super().synthesize(query, nodes, additional_source_nodes, **kwargs, **{_SINK: sink})
        return self._attach(response, sink)

    async def asynthesize(self, query: Any, nodes: list[NodeWithScore],
                          additional_source_nodes: Sequence[NodeWithScore] | None = None,
                          **kwargs: Any) -> RESPONSE_TYPE:
        sink: dict = {}
        response = await super().asynthesize(query, nodes, additional_source_nodes, **kwargs, **{_SINK: sink})
        return self._attach(response, sink)


def cacheblend_query_engine(
    index_or_retriever: BaseIndex | BaseRetriever,
    llm: CacheBlendLLM | None = None,
    *,
    streaming: bool = False,
    system: str | None = None,
    preamble: str = "",
    query_template: str = "{query_str}",
    node_postprocessors: list[BaseNodePostprocessor] | None = None,
    **retriever_kwargs: Any,
) -> RetrieverQueryEngine:
    """A ``RetrieverQueryEngine`` answering with :class:`CacheBlendSynthesizer` (options as
    there).  ``retriever_kwargs`` (e.g. ``similarity_top_k``) go to ``index.as_retriever``."""
    if isinstance(index_or_retriever, BaseIndex):
        retriever = index_or_retriever.as_retriever(**retriever_kwargs)
    elif isinstance(index_or_retriever, BaseRetriever):
        if retriever_kwargs:
            raise CacheBlendError(f"retriever options {sorted(retriever_kwargs)} need an index, not a retriever")
        retriever = index_or_retriever
    else:
        raise CacheBlendError(f"expected a LlamaIndex index or retriever, got {type(index_or_retriever).__name__}")
    synthesizer = CacheBlendSynthesizer(llm, streaming=streaming, system=system, preamble=preamble,
                                        query_template=query_template)
    return RetrieverQueryEngine(retriever=retriever, response_synthesizer=synthesizer,
                                node_postprocessors=node_postprocessors)


__all__ = ["CacheBlendSynthesizer", "cacheblend_query_engine"]
