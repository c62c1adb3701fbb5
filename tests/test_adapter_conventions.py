"""Framework conventions the adapters missed, each found in a review and failing before its
fix: streamed message chunks kept in a chat history, LangChain's LLM cache, a retrieval
chain's document variable, blank documents, the first async call, pickling and copying,
LlamaIndex's ``Settings.llm``, and cancelling an async stream during its prefill.
Real default model, short answers."""

from __future__ import annotations

import asyncio
import copy
import pickle
import threading
import time

import pytest

pytest.importorskip("langchain_cacheblend")
pytest.importorskip("llama_index.llms.cacheblend")

from langchain_cacheblend import CacheBlendVectorStore, ChatCacheBlend, create_cacheblend_retrieval_chain  # noqa: E402
from langchain_cacheblend.vectorstores import CACHE_KEY  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import AIMessageChunk, HumanMessage, HumanMessageChunk  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import RunnableLambda  # noqa: E402
from llama_index.core import Settings  # noqa: E402
from llama_index.llms.cacheblend import CacheBlendLLM, CacheBlendSynthesizer  # noqa: E402

from cacheblend.aio import CallCancelled, raise_if_cancelled  # noqa: E402
from cacheblend.errors import CacheBlendError  # noqa: E402
from conftest import give_up_on  # noqa: E402

pytestmark = pytest.mark.slow

VIENNA = "Vienna is the capital of Austria. It lies on the Danube and has about two million people."


def test_a_history_holding_streamed_chunks_is_taken(default_engine):
    """``full = full + chunk`` over a stream gives an ``AIMessageChunk``, whose type is
    ``"AIMessageChunk"``, not ``"ai"``: a chat history that kept it was refused."""
    llm = ChatCacheBlend(engine=default_engine, max_tokens=2)
    full = None
    for chunk in llm.stream([HumanMessage("Say hello.")]):
        full = chunk if full is None else full + chunk
    assert isinstance(full, AIMessageChunk)
    answer = llm.invoke([HumanMessageChunk("Say hello."), full, HumanMessage("Again.")])
    assert answer.usage_metadata["output_tokens"] > 0


def test_langchains_llm_cache_tells_differently_configured_models_apart(default_engine):
    from langchain_core.caches import InMemoryCache
    from langchain_core.globals import get_llm_cache, set_llm_cache

    before = get_llm_cache()
    set_llm_cache(InMemoryCache())
    try:
        short = ChatCacheBlend(engine=default_engine, max_tokens=1, ignore_eos=True)
        long = ChatCacheBlend(engine=default_engine, max_tokens=5, ignore_eos=True)
        assert short.invoke("Count to ten.").usage_metadata["output_tokens"] == 1
        answer = long.invoke("Count to ten.")  # was the cached one-token answer of the other model
        assert answer.usage_metadata["output_tokens"] == 5
        assert long.invoke("Count to ten.").content == answer.content  # its own answer is cached
    finally:
        set_llm_cache(before)


def test_the_retrieval_chain_takes_any_document_variable_name_and_blank_documents(default_engine):
    """The chain read the documents from the prompt variable's name (``KeyError`` for any but
    ``context``); a blank document (an image-only PDF page) failed the call."""
    llm = ChatCacheBlend(engine=default_engine, max_tokens=3)
    docs = [Document(page_content=VIENNA), Document(page_content="  \n")]
    retriever = RunnableLambda(lambda question: docs)
    prompt = ChatPromptTemplate.from_messages([("system", "Sources:\n\n{sources}"), ("human", "{input}")])
    out = create_cacheblend_retrieval_chain(llm, retriever, prompt, document_variable_name="sources").invoke(
        {"input": "What is the capital of Austria?"})
    assert out["context"] == docs and out["answer"]
    assert llm.invoke("Where is Vienna?", documents=docs).response_metadata["cacheblend"]["chunks"] == 1
    store = CacheBlendVectorStore(_Store(), llm)
    store.add_documents([Document(page_content=""), Document(page_content=VIENNA)])
    assert [CACHE_KEY in d.metadata for d in store.vectorstore.docs] == [False, True]  # the batch went in whole
    assert store.delete(["0"]) and len(store.vectorstore.docs) == 1  # a store that cannot look ids up


class _Store:
    """Enough of a vector store for ``CacheBlendVectorStore.add_documents``."""

    def __init__(self) -> None:
        self.docs: list[Document] = []

    def add_documents(self, documents: list[Document], **kwargs) -> list[str]:
        self.docs += documents
        return [str(i) for i in range(len(documents))]

    def get_by_ids(self, ids) -> list[Document]:
        raise NotImplementedError  # LangChain's default, which many stores keep

    def delete(self, ids=None, **kwargs) -> bool:
        self.docs = [d for i, d in enumerate(self.docs) if str(i) not in (ids or ())]
        return True


def test_the_first_async_call_loads_the_model_off_the_event_loop(default_engine, monkeypatch):
    """LangChain reads the tracing parameters on the event loop before ``ainvoke`` hands the
    call to a thread; reading the model's name there loaded the default model (or connected
    to ``base_url``) on the loop."""
    import langchain_cacheblend.chat_models as chat_models

    loaded_on: list[threading.Thread] = []

    def shared(*args, **kwargs):
        loaded_on.append(threading.current_thread())
        return default_engine

    def unreachable(*args, **kwargs):
        loaded_on.append(threading.current_thread())
        raise ConnectionError("no server here")

    monkeypatch.setattr(chat_models.Engine, "shared", shared)
    monkeypatch.setattr(chat_models.RemoteEngine, "shared", unreachable)
    answer = asyncio.run(ChatCacheBlend(max_tokens=2).ainvoke("Hi"))
    assert answer.usage_metadata["output_tokens"] > 0
    with pytest.raises(ConnectionError):
        asyncio.run(ChatCacheBlend(base_url="http://127.0.0.1:9/v1", max_retries=0).ainvoke("Hi"))
    assert len(loaded_on) == 2 and threading.main_thread() not in loaded_on


def test_pickled_or_copied_models_leave_the_engine_behind_or_share_it(default_engine, monkeypatch):
    import langchain_cacheblend.chat_models as chat_models

    monkeypatch.setattr(chat_models.Engine, "shared", lambda *args, **kwargs: default_engine)
    llm = ChatCacheBlend(max_tokens=2, stop=["\n"])
    llm.invoke("Hi")  # its engine is loaded: it holds locks
    again = pickle.loads(pickle.dumps(llm))
    assert (again.max_tokens, again.stop) == (2, ["\n"]) and again.invoke("Hi").content == llm.invoke("Hi").content
    bound = ChatCacheBlend(engine=default_engine, max_tokens=3)
    twin = copy.deepcopy(bound)
    assert twin.engine is default_engine and twin.max_tokens == 3
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(bound)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(CacheBlendLLM(engine=default_engine))
    plain = pickle.loads(pickle.dumps(CacheBlendLLM(max_tokens=4)))
    assert plain.max_tokens == 4 and plain.engine is not None


def test_the_synthesizer_answers_with_settings_llm_when_it_is_ours(default_engine, monkeypatch):
    from llama_index.core.schema import NodeWithScore, TextNode

    ours = CacheBlendLLM(engine=default_engine, max_tokens=1, ignore_eos=True)
    monkeypatch.setattr(Settings, "_llm", ours)  # Settings.llm = ours, undone after the test
    response = CacheBlendSynthesizer().synthesize("Where is Vienna?", [NodeWithScore(node=TextNode(text=VIENNA))])
    assert response.metadata["cacheblend"]["new_tokens"] == 1  # ours; the default model answers up to 128


def test_cancelling_an_async_stream_stops_the_step_under_way():
    """The first item of a stream is the whole prefill: a consumer cancelled then waited for
    the step to end (the flag that stops it between layers was never set)."""
    stopped: list[float] = []

    def make():
        def prefill():
            until = time.monotonic() + 30
            try:
                while time.monotonic() < until:  # a long prefill, checking between layers
                    raise_if_cancelled()
                    time.sleep(0.01)
            except CallCancelled:
                stopped.append(time.monotonic())
                raise
            yield "never"

        return prefill()

    t0 = time.monotonic()
    give_up_on(make, 0.3)
    assert stopped and stopped[0] - t0 < 5 and time.monotonic() - t0 < 5
    assert threading.active_count() < 50


def test_tokens_are_counted_by_the_models_tokenizer(default_engine):
    """LangChain's fallback counts with GPT-2's tokenizer, fetched from the hub (offline:
    an error; online: another model's counts), for ``trim_messages(token_counter=llm)``."""
    from langchain_core.messages import trim_messages

    llm = ChatCacheBlend(engine=default_engine)
    assert llm.get_num_tokens(VIENNA) == len(default_engine.prompts.encode(VIENNA))
    history = [HumanMessage(VIENNA), HumanMessage("Where is Vienna?")]
    kept = trim_messages(history, max_tokens=llm.get_num_tokens("Where is Vienna?") + 8, token_counter=llm,
                         strategy="last")
    assert [m.content for m in kept] == ["Where is Vienna?"]


def test_a_model_name_given_where_the_engine_goes_is_a_clear_error():
    """``CacheBlendLLM("model-id")`` took the string as its engine and failed at the first
    call with an AttributeError."""

    with pytest.raises(CacheBlendError, match="takes an Engine or RemoteEngine.*model="):
        CacheBlendLLM("HuggingFaceTB/SmolLM2-135M-Instruct")



@pytest.mark.parametrize("streaming", [False, True])
def test_the_synthesizers_llm_event_ends_when_its_answer_fails(default_engine, monkeypatch, streaming):
    """A timed-out answer left the synthesizer's LLM callback event open: a handler
    (LlamaDebugHandler, a tracer) held an event that never ended.  LlamaIndex's own LLMs
    end it with the exception."""
    from llama_index.core.callbacks import CallbackManager, LlamaDebugHandler
    from llama_index.core.callbacks.schema import CBEventType, EventPayload

    debug = LlamaDebugHandler()
    llm = CacheBlendLLM(engine=default_engine, request_timeout=0.3, max_tokens=4)
    synth = CacheBlendSynthesizer(llm=llm, streaming=streaming, callback_manager=CallbackManager([debug]))
    finish = default_engine.decoder.finish
    monkeypatch.setattr(default_engine.decoder, "finish", lambda *a: (time.sleep(0.05), finish(*a))[1])
    with pytest.raises(TimeoutError):
        out = synth.get_response("Where is Vienna?", [VIENNA])
        "".join(out) if streaming else None
    pairs = debug.get_event_pairs(CBEventType.LLM)
    assert pairs and all(len(pair) == 2 for pair in pairs)
    assert isinstance(pairs[-1][1].payload[EventPayload.EXCEPTION], TimeoutError)


def test_llamaindex_refuses_tool_calls_and_keeps_its_api_key_secret(default_engine):
    """An assistant message's tool_calls were dropped without a word (LangChain's adapter
    refuses them), and CacheBlendLLM's api_key showed in repr and to_json (a saved configuration)."""
    from llama_index.core.base.llms.types import ChatMessage

    llm = CacheBlendLLM(engine=default_engine, api_key="sk-do-not-show", max_tokens=1)
    assert "sk-do-not-show" not in repr(llm) + str(llm) + llm.to_json() and llm.api_key == "sk-do-not-show"
    calls = [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]
    with pytest.raises(CacheBlendError, match="tool_calls"):
        llm.chat([ChatMessage(role="user", content="Hi"),
                  ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": calls}),
                  ChatMessage(role="user", content="And?")])


def test_the_retrieval_chain_gives_a_runnable_retriever_the_whole_input(default_engine):
    """Every retriever got the question string: a Runnable that reads the input dict, as
    create_history_aware_retriever does (``x.get("chat_history")``), failed."""
    llm = ChatCacheBlend(engine=default_engine, max_tokens=2)
    seen: list = []
    retriever = RunnableLambda(lambda x: seen.append(x.get("chat_history")) or [Document(page_content=VIENNA)])
    prompt = ChatPromptTemplate.from_messages([("system", "Sources:\n\n{context}"), ("human", "{input}")])
    out = create_cacheblend_retrieval_chain(llm, retriever, prompt).invoke(
        {"input": "What is the capital of Austria?", "chat_history": []})
    assert seen == [[]] and out["answer"]


def test_streams_retry_before_their_first_token_and_stream_kwarg_is_taken(default_engine, monkeypatch):
    """``max_retries`` applied to invoke but not to stream/astream: a store error before the
    first token ended a streamed call at once.  ``invoke(..., stream=False)``, LangChain's
    per-call switch, was refused as an unknown option."""
    llm = ChatCacheBlend(engine=default_engine, max_tokens=2, max_retries=1)
    real, failures = default_engine.start_chat, [1]

    def flaky(*args, **kwargs):
        if failures:
            failures.pop()
            raise OSError("the store's disk went away for a moment")
        return real(*args, **kwargs)

    monkeypatch.setattr(default_engine, "start_chat", flaky)
    assert "".join(c.content for c in llm.stream("Hi")) and not failures  # one failure, one retry
    failures.append(1)
    assert asyncio.run(_collect(llm.astream("Hi"))) and not failures  # the same for astream
    assert llm.invoke("Hi", stream=False).content and llm.invoke("Hi", stream=True).content


async def _collect(stream) -> str:
    return "".join([c.content async for c in stream])


def test_deleting_one_copy_of_a_text_keeps_its_cache_for_the_other(default_engine):
    """Caches are by content: deleting a document released the cache of a text another
    document still held (a document re-indexed with new metadata, a paragraph two files
    share), and released it even when the store deleted nothing."""
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from langchain_core.vectorstores import InMemoryVectorStore

    llm = ChatCacheBlend(engine=default_engine, max_tokens=2)
    store = CacheBlendVectorStore(InMemoryVectorStore(DeterministicFakeEmbedding(size=32)), llm)
    store.add_documents([Document(page_content=VIENNA, id="a", metadata={"v": 1}),
                         Document(page_content=VIENNA, id="b", metadata={"v": 2})])
    key = store.get_by_ids(["a"])[0].metadata[CACHE_KEY]
    vector = DeterministicFakeEmbedding(size=32).embed_query(VIENNA)
    assert len(store.max_marginal_relevance_search_by_vector(vector, k=1)) == 1  # forwarded to the store
    store.delete(["a"])
    assert default_engine.store.open(key) is not None  # "b" holds the text
    store.delete(["b"])
    assert default_engine.store.open(key) is None  # the last copy: released
