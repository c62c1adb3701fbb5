"""LangChain integration end to end on the real default model: documents as chunks (kwarg,
bind, chain builder), drop-in prompts, the ingestion hook with the indexing API, async."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

pytest.importorskip("langchain_cacheblend")

from langchain_cacheblend import (  # noqa: E402
    CACHE_KEY,
    CacheBlendVectorStore,
    ChatCacheBlend,
    create_cacheblend_retrieval_chain,
)
from langchain_core.documents import Document  # noqa: E402
from langchain_core.indexing import InMemoryRecordManager, index  # noqa: E402
from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore  # noqa: E402

from cacheblend import CacheBlendError, Engine  # noqa: E402
from cacheblend.datasets import load_qa  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from rag_common import minilm_dir  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def example():
    return load_qa("musique", "dev", limit=2, passages=3)


@pytest.fixture(scope="module")
def engine(default_model_dir):
    return Engine.load(default_model_dir, store="memory")


@pytest.fixture
def llm(engine):
    return ChatCacheBlend(engine=engine, max_tokens=6)


@pytest.fixture(scope="module")
def embeddings():
    from langchain_huggingface import HuggingFaceEmbeddings

    return HuggingFaceEmbeddings(model_name=minilm_dir())


def _stats(message) -> dict:
    return message.response_metadata["cacheblend"]


def test_documents_kwarg_and_bind_reach_the_model_as_chunks(llm, example):
    ex = example[0]
    messages = [HumanMessage(ex.question)]
    first = llm.invoke(messages, documents=[Document(page_content=p) for p in ex.passages])
    assert _stats(first)["chunks"] == len(ex.passages)
    again = llm.bind(documents=ex.passages).invoke(messages)
    assert again.content == first.content
    assert _stats(again)["chunks"] == len(ex.passages)
    assert _stats(again)["store_hits"] >= len(ex.passages)
    usage = again.usage_metadata
    details = usage["input_token_details"]  # exact cache reads and approximate reuse, apart
    assert details["cache_read"] + details["cacheblend_approximate"] == _stats(again)["reused_tokens"]
    assert details["cacheblend_approximate"] == _stats(again)["fidelity"]["approximate_tokens"] > 0
    assert _stats(again)["fidelity"]["exact"] is False and 0 < _stats(again)["fidelity"]["risk"] <= 1
    assert usage["input_tokens"] == _stats(again)["prompt_tokens"]
    assert again.response_metadata["ttft_s"] > 0
    # the same chunks with every token recomputed is full prefill
    full = llm.invoke(messages, documents=ex.passages, method="full")
    assert _stats(full)["reused_tokens"] == 0 and _stats(full)["fidelity"]["exact"] is True
    assert full.usage_metadata["input_tokens"] == usage["input_tokens"]


def test_drop_in_prompt_finds_known_passages_without_separators(llm, example):
    ex = example[1]
    llm.ingest(ex.passages)
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer from these sources.\n{context}"),
        ("human", "{question}"),
    ])
    context = "".join(f"Source {i} >> {p} <<\n" for i, p in enumerate(ex.passages))  # no blank lines
    out = (prompt | llm).invoke({"context": context, "question": ex.question})
    stats = _stats(out)
    assert stats["chunks"] == len(ex.passages)
    assert stats["store_hits"] >= len(ex.passages)
    assert stats["chunks_learned"] == 0


def test_drop_in_learns_unseen_passages_then_reuses_them(engine):
    llm = ChatCacheBlend(engine=engine, max_tokens=4)
    ex = load_qa("wikimqa", "dev", limit=1, passages=3)[0]
    bodies = [p.split("\n\n", 1)[1] for p in ex.passages]  # long paragraphs, never ingested
    prompt = ChatPromptTemplate.from_messages([("human", "Context:\n\n{context}\n\nQuestion: {question}")])
    first = (prompt | llm).invoke({"context": "\n\n".join(bodies), "question": ex.question})
    learned = _stats(first)["chunks_learned"]
    assert learned == sum(len(b) >= engine.learn_min_chars for b in bodies) > 0
    second = (prompt | llm).invoke({"context": "\n\n".join(reversed(bodies)), "question": ex.question})
    assert _stats(second)["chunks_learned"] == 0
    assert _stats(second)["store_hits"] >= learned


def test_hubs_rag_prompt_learns_the_passages_not_the_question(engine):
    """LangChain hub's rlm/rag-prompt puts the question on a line above the context: the
    instruction, the question and the first passage were learned as one chunk, a new
    store entry on every request that was never reused."""
    llm = ChatCacheBlend(engine=engine, max_tokens=4)
    examples = load_qa("musique", "dev", limit=6, passages=3)[4:]
    bodies = [p.split("\n\n", 1)[1] for p in examples[1].passages]  # no other test passes them
    prompt = ChatPromptTemplate.from_messages([("human", (
        "You are an assistant for question-answering tasks. Use the following pieces of retrieved context to "
        "answer the question. If you don't know the answer, just say that you don't know. Use three sentences "
        "maximum and keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:"))])
    first = (prompt | llm).invoke({"context": "\n\n".join(bodies), "question": examples[0].question})
    long_bodies = sum(len(b) >= engine.learn_min_chars for b in bodies)
    assert _stats(first)["chunks_learned"] == long_bodies + 1  # and the instruction
    second = (prompt | llm).invoke({"context": "\n\n".join(reversed(bodies)), "question": examples[1].question})
    assert _stats(second)["chunks_learned"] == 0 and _stats(second)["chunks"] == _stats(first)["chunks"]
    assert _stats(second)["store_hits"] >= _stats(first)["chunks_learned"]


def test_retrieval_chain_builder_and_langchains_own_chain(llm, example, embeddings):
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain

    passages = [p for ex in example for p in ex.passages]
    store = CacheBlendVectorStore(InMemoryVectorStore(embeddings), llm)
    store.add_texts(passages)
    retriever = store.as_retriever(search_kwargs={"k": 2})
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Use the context to answer.\n\n{context}"),
        ("human", "{input}"),
    ])
    question = example[0].question
    ours = create_cacheblend_retrieval_chain(llm, retriever, prompt).invoke({"input": question})
    theirs = create_retrieval_chain(retriever, create_stuff_documents_chain(llm, prompt)).invoke({"input": question})
    assert set(ours) == set(theirs) == {"input", "context", "answer"}
    assert [d.page_content for d in ours["context"]] == [d.page_content for d in theirs["context"]]
    assert all(CACHE_KEY in d.metadata for d in ours["context"])
    assert ours["answer"] == theirs["answer"]  # the same prompt, the same chunks found
    pieces = list(create_cacheblend_retrieval_chain(llm, retriever, prompt).stream({"input": question}))
    assert "".join(p.get("answer", "") for p in pieces) == ours["answer"]


def test_indexing_api_skips_unchanged_documents_and_releases_stale_caches(engine, embeddings, monkeypatch):
    llm = ChatCacheBlend(engine=engine, max_tokens=4)
    precomputed = []
    real = engine.chunks.precompute
    monkeypatch.setattr(engine.chunks, "precompute", lambda ids: precomputed.append(len(ids)) or real(ids))
    store = CacheBlendVectorStore(InMemoryVectorStore(embeddings), llm, show_progress=False)
    records = InMemoryRecordManager("cacheblend-test")
    records.create_schema()
    ex = load_qa("wikimqa", "dev", limit=2, passages=3)[1]
    docs = [Document(page_content=p, metadata={"source": f"doc{i}"}) for i, p in enumerate(ex.passages)]
    first = index(docs, records, store, cleanup="incremental", source_id_key="source", key_encoder="sha256")
    assert first["num_added"] == 3 and len(precomputed) == 3
    keys = [d.metadata[CACHE_KEY] for d in store.get_by_ids(records.list_keys())]
    assert len(set(keys)) == 3 and all(engine.store.open(k) is not None for k in keys)
    keys = [engine.ingest([d.page_content])[0].key for d in docs]  # in document order

    again = index(docs, records, store, cleanup="incremental", source_id_key="source", key_encoder="sha256")
    assert again["num_skipped"] == 3 and again["num_added"] == 0
    assert len(precomputed) == 3  # re-indexing unchanged documents computed nothing

    changed = Document(page_content=docs[0].page_content + " (revised)", metadata={"source": "doc0"})
    third = index([changed, *docs[1:]], records, store, cleanup="incremental", source_id_key="source",
                  key_encoder="sha256")
    assert third["num_added"] == 1 and third["num_deleted"] == 1
    assert engine.store.open(keys[0]) is None  # stale cache released
    assert engine.store.open(keys[1]) is not None
    assert docs[0].page_content not in engine.passages


def test_async_calls_do_not_block_the_event_loop(llm, example):
    ex = example[0]

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        out = await llm.ainvoke([HumanMessage(ex.question)], documents=ex.passages)
        pieces = [c async for c in llm.astream([HumanMessage(ex.question)], documents=ex.passages)]
        task.cancel()
        return out, pieces, ticks

    out, pieces, ticks = asyncio.run(main())
    assert ticks > 20  # the loop kept running through prefill and decode
    assert "".join(p.content for p in pieces) == out.content
    assert pieces[-1].usage_metadata["input_tokens"] == out.usage_metadata["input_tokens"]


def test_bad_input_is_a_clear_error(llm):
    from langchain_core.messages import ToolMessage

    with pytest.raises(CacheBlendError, match="'tool' message: tool calling is not supported"):
        llm.invoke([ToolMessage("x", tool_call_id="1")])
    with pytest.raises(ValueError, match="unknown options"):
        llm.invoke("hi", temprature=0.5)
    with pytest.raises(CacheBlendError, match="method must be one of"):
        llm.invoke("hi", method="fast")
    with pytest.raises(ValueError, match="documents must be"):
        llm.invoke("hi", documents=[3])
    with pytest.raises(ValueError, match="text only"):
        llm.invoke([HumanMessage(content=[{"type": "image_url", "image_url": {"url": "x"}}])])
    with pytest.raises(TimeoutError):
        ChatCacheBlend(engine=llm.engine, timeout=1e-9, max_tokens=4).invoke([SystemMessage("s"), HumanMessage("hi")])


def test_langchain_example_runs_end_to_end():
    import json
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(root / "examples" / "langchain_rag.py"), "--store", "memory",
                           "--questions", "2", "--k", "3"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report["sources"]) == 3 and all(report["sources"])
    assert report["ttft_full_s"] > 0 and report["ttft_blend_s"] > 0
    assert 0 < report["reused_tokens"] < report["prompt_tokens"]
    assert "Answer (CacheBlend):" in proc.stdout and "TTFT: CacheBlend" in proc.stdout


def test_one_model_name_round_trips():
    from langchain_core.callbacks import BaseCallbackHandler, UsageMetadataCallbackHandler

    class Traced(BaseCallbackHandler):
        names: list[str] = []

        def on_chat_model_start(self, serialized, messages, *, metadata=None, **kwargs):
            self.names.append((metadata or {}).get("ls_model_name"))

    llm = ChatCacheBlend(store="memory", max_tokens=2)
    name = llm.model_name
    usage, traced = UsageMetadataCallbackHandler(), Traced()
    reply = llm.invoke("Hi", config={"callbacks": [usage, traced]})
    assert reply.response_metadata["model_name"] == name == traced.names[0]
    assert list(usage.usage_metadata) == [name]
    again = ChatCacheBlend(model=name, store="memory", max_tokens=2)  # the reported name loads the same model
    assert again.model_name == name and again.get_engine().fingerprint == llm.get_engine().fingerprint
    assert llm.invoke("Hi", model=name).content == reply.content
    with pytest.raises(ValueError, match="one object per model"):
        llm.invoke("Hi", model="gpt-4o")


def test_tools_structured_output_and_json_mode_are_refused_clearly(llm):
    from pydantic import BaseModel

    class Answer(BaseModel):
        text: str

    with pytest.raises(NotImplementedError, match="does not call tools"):
        llm.bind_tools([Answer])
    with pytest.raises(NotImplementedError, match="no structured-output"):
        llm.with_structured_output(Answer)
    with pytest.raises(ValueError, match="no JSON mode"):
        llm.invoke("hi", response_format={"type": "json_object"})


def test_timeout_reaches_the_prefill(llm, example, monkeypatch):
    import time

    engine = llm.get_engine()
    finish = engine.decoder.finish
    monkeypatch.setattr(engine.decoder, "finish", lambda *a: (time.sleep(0.05), finish(*a))[1])
    with pytest.raises(TimeoutError, match="fused prefill"):
        ChatCacheBlend(engine=engine, timeout=0.3, max_tokens=4).invoke("Q?", documents=example[0].passages[:1])
