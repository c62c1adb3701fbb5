"""The stuff pattern with passages handed to the model as chunks.

LangChain's ``create_retrieval_chain(retriever, create_stuff_documents_chain(llm, prompt))``
pastes the retrieved documents into the prompt's ``{context}``.  This builder does the
same (so the prompt, the input and the output keys are unchanged) and also hands the
documents to :class:`ChatCacheBlend` as chunks, so each is reused from its cache even when
the engine has never seen it before.
"""

from __future__ import annotations

from typing import Any

from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import BasePromptTemplate, PromptTemplate, format_document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableLambda, RunnablePassthrough

DEFAULT_DOCUMENT_PROMPT = PromptTemplate.from_template("{page_content}")


def create_cacheblend_retrieval_chain(
    llm: Runnable,
    retriever: BaseRetriever | Runnable,
    prompt: BasePromptTemplate,
    *,
    document_prompt: BasePromptTemplate | None = None,
    document_separator: str = "\n\n",
    document_variable_name: str = "context",
) -> Runnable:
    """A retrieval chain whose input is ``{"input": ..., **other prompt variables}`` and
    whose output adds ``"context"`` (the retrieved Documents) and ``"answer"`` (a string),
    as LangChain's ``create_retrieval_chain`` does.

    ``llm`` must accept ``documents=`` (a :class:`ChatCacheBlend`, possibly bound).  Each
    document, formatted by ``document_prompt``, is a chunk: with the default prompt that is
    its ``page_content``, whose cache :class:`CacheBlendVectorStore` precomputed at
    indexing; a custom prompt (``"Source: {source}\n{page_content}"``) makes new chunks,
    precomputed on their first query."""
    if document_variable_name not in prompt.input_variables:
        raise ValueError(f"prompt must take {{{document_variable_name}}}; its variables: {prompt.input_variables}")
    doc_prompt = document_prompt or DEFAULT_DOCUMENT_PROMPT

    def answer(inputs: dict[str, Any]) -> Runnable:
        docs: list[Document] = inputs["context"]  # the output key, whatever the prompt calls the text
        texts = [format_document(d, doc_prompt) for d in docs]
        fill: Runnable = RunnableLambda(lambda x: {**x, document_variable_name: document_separator.join(texts)})
        return fill | prompt | llm.bind(documents=texts) | StrOutputParser()

    # a BaseRetriever takes the question; any other Runnable the whole input, as in LangChain's
    # create_retrieval_chain (create_history_aware_retriever reads "chat_history" from it)
    retrieve: Runnable = (RunnableLambda(lambda x: x["input"]) | retriever) \
        if isinstance(retriever, BaseRetriever) else retriever
    return (
        RunnablePassthrough.assign(context=retrieve.with_config(run_name="retrieve_documents"))
        .assign(answer=RunnableLambda(answer).with_config(run_name="cacheblend_stuff_documents"))
        .with_config(run_name="cacheblend_retrieval_chain")
    )
