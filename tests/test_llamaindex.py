"""LlamaIndex integration end to end on the real default model: the LLM (sync, streaming,
async, token counting), the stuff synthesizer and its query engine, drop-in reuse by stock
query engines, and the ingestion transform."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("llama_index.llms.cacheblend")

from llama_index.core import Settings, VectorStoreIndex  # noqa: E402
from llama_index.core.base.response.schema import AsyncStreamingResponse, Response, StreamingResponse  # noqa: E402
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler  # noqa: E402
from llama_index.core.callbacks.base_handler import BaseCallbackHandler  # noqa: E402
from llama_index.core.callbacks.schema import CBEventType, EventPayload  # noqa: E402
from llama_index.core.ingestion import IngestionPipeline  # noqa: E402
from llama_index.core.llms import ChatMessage, MockLLM  # noqa: E402
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode  # noqa: E402
from llama_index.llms.cacheblend import (  # noqa: E402
    CacheBlendKVTransform,
    CacheBlendLLM,
    CacheBlendSynthesizer,
    cacheblend_query_engine,
)

from cacheblend import CacheBlendError, Engine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from rag_common import minilm_dir  # noqa: E402

pytestmark = pytest.mark.slow

# No newlines and no mix of quote kinds: llama-index-core 0.14's simple_summarize pastes
# the Python repr of a list of chunks, which escapes those (see docs/llamaindex.md).
FACTS = [
    "The lighthouse keeper Oswin Marrable tended the Skerrow Point light for thirty-one years and "
    "kept a logbook of every ship that passed the reef.",
    "Skerrow Point lies on the northern tip of the island of Vell, where the ferry from Carran docks "
    "twice a week in summer.",
    "The Vell ferry was replaced in 1998 by a larger vessel named the Grey Heron, built in Aberdeen.",
]
QUESTION = "Who kept the Skerrow Point light?"


@pytest.fixture(scope="module")
def engine(default_model_dir):
    return Engine.load(default_model_dir, store="memory")


@pytest.fixture
def llm(engine):
    return CacheBlendLLM(engine=engine, max_tokens=8)


@pytest.fixture(scope="module")
def nodes(engine):
    """FACTS as nodes, ingested by the transform.  Their metadata is hidden from the LLM:
    its header ("source: ...\n\n") would be escaped by simple_summarize's list repr."""
    nodes = [TextNode(text=t, metadata={"source": f"fact-{i}"}, excluded_llm_metadata_keys=["source"])
             for i, t in enumerate(FACTS)]
    return CacheBlendKVTransform(llm=CacheBlendLLM(engine=engine))(nodes)


@pytest.fixture(scope="module")
def embed_model():
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    return HuggingFaceEmbedding(model_name=minilm_dir())


class StatsRecorder(BaseCallbackHandler):
    """The ``raw["cacheblend"]`` stats of every LLM event."""

    def __init__(self) -> None:
        super().__init__([], [])
        self.calls: list[dict] = []

    def on_event_start(self, event_type, payload=None, event_id="", parent_id="", **kwargs):
        return event_id

    def on_event_end(self, event_type, payload=None, event_id="", **kwargs):
        payload = payload or {}
        response = payload.get(EventPayload.RESPONSE) or payload.get(EventPayload.COMPLETION)
        if event_type == CBEventType.LLM and response is not None:
            self.calls.append(response.raw["cacheblend"])

    def start_trace(self, trace_id=None):
        pass

    def end_trace(self, trace_id=None, trace_map=None):
        pass


def test_default_llm_uses_the_shared_engine(monkeypatch, engine):
    calls = []
    monkeypatch.setattr(Engine, "shared", classmethod(lambda cls, model=None, store=None: calls.append(
        (model, store)) or engine))
    llm = CacheBlendLLM()
    assert calls == [(None, None)] and llm.engine is engine
    meta = llm.metadata
    assert meta.context_window == engine.context_length and meta.is_chat_model
    assert meta.model_name == engine.model_name and meta.num_output == llm.max_tokens


def test_complete_chat_and_streams(llm):
    r = llm.complete("Name one colour of the rainbow.")
    assert r.text.strip()
    usage, stats = r.raw["usage"], r.raw["cacheblend"]
    assert usage["prompt_tokens"] == stats["prompt_tokens"] > 0
    assert 0 < usage["completion_tokens"] == stats["new_tokens"] <= 8
    assert stats["ttft_s"] > 0 and stats["finish_reason"] in ("stop", "length")
    assert set(stats["fidelity"]) >= {"exact", "ratio_used", "risk", "escalated", "approximate_tokens"}

    messages = [ChatMessage(role="system", content="Answer in one word."),
                ChatMessage(role="user", content="What colour is the sky?")]
    chat = llm.chat(messages)
    assert chat.message.role == "assistant" and chat.message.content.strip()
    streamed = list(llm.stream_chat(messages))
    assert "".join(c.delta for c in streamed) == streamed[-1].message.content == chat.message.content
    assert streamed[-1].raw["usage"] == chat.raw["usage"] and all(c.raw is None for c in streamed[:-1])

    pieces = list(llm.stream_complete("Name one colour of the rainbow."))
    assert "".join(p.delta for p in pieces) == pieces[-1].text == r.text  # greedy: same answer


def test_async_variants_do_not_block_the_loop(llm):
    async def main():
        stamps: list[float] = []

        async def ticker():
            while True:
                stamps.append(time.perf_counter())
                await asyncio.sleep(0.01)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)
        t0 = time.perf_counter()
        done = await llm.acomplete("Write a short sentence about the sea.")
        elapsed = time.perf_counter() - t0
        during = [s for s in stamps if s >= t0]
        gaps = [b - a for a, b in zip(during, during[1:], strict=False)]
        chat = await llm.achat([ChatMessage(role="user", content="Say hi.")])
        deltas = [c.delta async for c in await llm.astream_complete("Write a short sentence about the sea.")]

        async def stream(word: str) -> str:
            out = await llm.astream_chat([ChatMessage(role="user", content=f"Repeat: {word}")])
            return "".join([c.delta async for c in out])

        both = await asyncio.gather(stream("apple"), stream("pear"))  # decode steps hop threads
        task.cancel()
        return done, elapsed, len(during), max(gaps), chat, deltas, both

    done, elapsed, ticks, max_gap, chat, deltas, both = asyncio.run(main())
    assert done.text.strip() and done.raw["usage"]["completion_tokens"] > 0
    assert ticks >= 10 and max_gap < elapsed / 2, (ticks, max_gap, elapsed)
    assert chat.message.content.strip()
    assert "".join(deltas) == done.text
    assert all(s.strip() for s in both)


def test_token_counting_handler_counts_the_engine_usage(llm, engine):
    counter = TokenCountingHandler(tokenizer=engine.tokenizer.encode)
    llm.callback_manager = CallbackManager([counter])
    a = llm.complete("Tell me a fact about owls.")
    b = list(llm.stream_chat([ChatMessage(role="user", content="Tell me a fact about cats.")]))[-1]
    expected = [a.raw["usage"], b.raw["usage"]]
    assert counter.prompt_llm_token_count == sum(u["prompt_tokens"] for u in expected)
    assert counter.completion_llm_token_count == sum(u["completion_tokens"] for u in expected)
    assert counter.total_llm_token_count == sum(u["total_tokens"] for u in expected)


def test_transform_records_keys_and_rerun_costs_nothing(engine, monkeypatch):
    texts = [f"Ledger entry {i}: the granary at Holm received {40 + i} sacks of barley from the mill at "
             f"Ostra during the wet autumn." for i in range(3)]
    docs = [TextNode(text=t, metadata={"ledger": "Holm"}) for t in texts]
    computed = []
    precompute = engine.chunks.precompute
    monkeypatch.setattr(engine.chunks, "precompute", lambda ids: computed.append(len(ids)) or precompute(ids))
    transform = CacheBlendKVTransform(llm=CacheBlendLLM(engine=engine))
    out = IngestionPipeline(transformations=[transform]).run(nodes=docs, show_progress=True)
    assert len(computed) == 3
    entries = engine.store.stats()["entries"]
    for node in out:
        key = node.metadata["cacheblend_key"]
        llm_text = node.get_content(metadata_mode=MetadataMode.LLM)
        assert "ledger: Holm" in llm_text and key not in llm_text
        assert key not in node.get_content(metadata_mode=MetadataMode.EMBED)
        assert engine.ingest([llm_text])[0].key == key  # the text that reaches prompts
    again = [TextNode(text=t, metadata={"ledger": "Holm"}) for t in texts]
    out2 = IngestionPipeline(transformations=[transform]).run(nodes=again)  # fresh IngestionCache
    assert len(computed) == 3 and engine.store.stats()["entries"] == entries
    assert [n.metadata["cacheblend_key"] for n in out2] == [n.metadata["cacheblend_key"] for n in out]
    assert asyncio.run(transform.acall(again))[0].metadata["cacheblend_key"] == out[0].metadata["cacheblend_key"]
    assert len(computed) == 3


def test_synthesizer_blends_the_nodes(llm, nodes):
    scored = [NodeWithScore(node=n, score=1.0) for n in nodes]
    synth = CacheBlendSynthesizer(llm=llm)
    r = synth.synthesize(QUESTION, scored)
    assert isinstance(r, Response) and r.response.strip()
    stats = r.metadata["cacheblend"]
    assert stats["chunks"] == len(nodes) and stats["store_hits"] >= len(nodes)
    assert stats["store_misses"] <= 1  # at most the system prefix, on its first use
    assert stats["reused_tokens"] > 0 and stats["recomputed_tokens"] > 0 and stats["ttft_s"] > 0
    assert stats["fidelity"]["exact"] is False and stats["fidelity"]["ratio_used"] > 0
    assert r.source_nodes[0].node.metadata["cacheblend_key"] == nodes[0].metadata["cacheblend_key"]

    streaming = CacheBlendSynthesizer(llm=llm, streaming=True).synthesize(QUESTION, scored)
    assert isinstance(streaming, StreamingResponse)
    assert streaming.metadata["cacheblend"] == {}  # filled in when the stream ends
    assert "".join(streaming.response_gen) == r.response
    assert streaming.metadata["cacheblend"]["reused_tokens"] == stats["reused_tokens"]

    async def astream():
        resp = await CacheBlendSynthesizer(llm=llm, streaming=True).asynthesize(QUESTION, scored)
        assert isinstance(resp, AsyncStreamingResponse)
        return "".join([p async for p in resp.async_response_gen()]), resp.metadata["cacheblend"]

    text, astats = asyncio.run(astream())
    assert text == r.response and astats["store_hits"] >= len(nodes)
    plain = asyncio.run(synth.asynthesize(QUESTION, scored))
    assert plain.response == r.response


def test_query_engine_helper_end_to_end(llm, nodes, embed_model):
    index = VectorStoreIndex(nodes, embed_model=embed_model)
    engine = cacheblend_query_engine(index, llm=llm, similarity_top_k=2)
    r = engine.query(QUESTION)
    assert r.response.strip() and len(r.source_nodes) == 2
    assert "Marrable" in r.source_nodes[0].node.get_content()
    assert all("cacheblend_key" in n.node.metadata for n in r.source_nodes)
    stats = r.metadata["cacheblend"]
    assert stats["chunks"] == 2 and stats["store_hits"] >= 2 and stats["reused_tokens"] > 0
    streamed = cacheblend_query_engine(index.as_retriever(similarity_top_k=2), llm=llm, streaming=True).query(QUESTION)
    assert "".join(streamed.response_gen) == r.response


@pytest.mark.parametrize("mode", ["simple_summarize", "compact"])
def test_stock_query_engine_reuses_ingested_nodes(engine, nodes, embed_model, mode):
    recorder = StatsRecorder()
    llm = CacheBlendLLM(engine=engine, max_tokens=8, learn=False)  # count only ingested passages
    index = VectorStoreIndex(nodes, embed_model=embed_model)
    saved = Settings.callback_manager
    Settings.callback_manager = CallbackManager([recorder])
    try:
        r = index.as_query_engine(llm=llm, response_mode=mode, similarity_top_k=len(nodes)).query(QUESTION)
    finally:
        Settings.callback_manager = saved
    assert r.response.strip() and len(recorder.calls) == 1
    stats = recorder.calls[0]
    assert stats["chunks"] == len(nodes) and stats["store_hits"] >= len(nodes) and stats["reused_tokens"] > 0


@pytest.mark.parametrize("mode, example, calls, learned, chunks", [("compact", 3, 1, 3, 3), ("refine", 1, 3, 4, 5)])
def test_stock_query_engine_learns_unseen_nodes_without_the_query(engine, embed_model, mode, example, calls,
                                                                  learned, chunks):
    """LlamaIndex's default text_qa template puts a rule and the query right under the
    context: the last node was learned with them, once per query, and never reused.  Its
    chat refine template (a call per node after the first) glues its instruction to the
    node by one newline ("...answer.\nNew Context: {context_msg}"): each node was learned
    glued to it, and never found on its own.  The second query learns nothing and finds
    every node (and the refine instruction, learned once)."""
    from cacheblend.datasets import load_qa

    recorder = StatsRecorder()
    llm = CacheBlendLLM(engine=engine, max_tokens=4)
    examples = load_qa("musique", "dev", limit=4, passages=3)
    texts = [p.split("\n\n", 1)[1] for p in examples[example].passages]
    index = VectorStoreIndex([TextNode(text=t) for t in texts], embed_model=embed_model)  # learned from the prompt
    saved = Settings.callback_manager
    Settings.callback_manager = CallbackManager([recorder])
    try:
        for ex in examples[example - 1: example + 1]:
            index.as_query_engine(llm=llm, response_mode=mode, similarity_top_k=3).query(ex.question)
    finally:
        Settings.callback_manager = saved
    first, second = recorder.calls[:calls], recorder.calls[calls:]
    assert len(second) == calls and all(t.strip() in engine.passages for t in texts)
    assert sum(c["chunks_learned"] for c in first) == learned
    assert sum(c["chunks_learned"] for c in second) == 0 and sum(c["chunks"] for c in second) == chunks
    assert all(c["store_hits"] >= c["chunks"] for c in second)


def test_bad_input_is_reported_clearly(llm, engine):
    with pytest.raises(ValueError, match="method must be one of"):
        CacheBlendLLM(engine=engine, method="fastest")
    with pytest.raises(CacheBlendError, match="unknown option"):
        llm.complete("hi", temprature=0.5)
    with pytest.raises(CacheBlendError, match="non-empty list"):
        llm.chat([])
    with pytest.raises(CacheBlendError, match="must be a ChatMessage"):
        llm.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(CacheBlendError, match="recompute_ratio|ratio"):
        llm.complete("hi", recompute_ratio=3.0)
    with pytest.raises(CacheBlendError, match="needs a CacheBlendLLM"):
        CacheBlendSynthesizer(llm=MockLLM())
    with pytest.raises(CacheBlendError, match="query_str"):
        CacheBlendSynthesizer(llm=llm, query_template="{question}")
    with pytest.raises(CacheBlendError, match="index or retriever"):
        cacheblend_query_engine(object(), llm=llm)

    async def bad_stream():
        await llm.astream_complete("hi", max_tokens=0)

    with pytest.raises(CacheBlendError):
        asyncio.run(bad_stream())


def test_example_answers_with_sources_and_ttft():
    args = ["--store", "memory", "--questions", "2", "--passages", "2", "--top-k", "2", "--max-tokens", "8"]
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "llamaindex_rag.py"), *args],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "Answer:" in text and "Sources:" in text
    assert "[ full] TTFT" in text and "[blend] TTFT" in text and "faster than full prefill" in text
    blend = next(line for line in text.splitlines() if line.startswith("[blend]"))
    assert " 0 reused" not in blend


def test_window_timeout_and_function_calling_are_not_silent(engine, monkeypatch):
    import time

    small = CacheBlendLLM(engine=engine, context_window=1024, max_tokens=4)
    assert small.metadata.context_window == 1024 and not small.metadata.is_function_calling_model
    assert CacheBlendLLM(engine=engine, context_window=10**9).metadata.context_window == engine.context_length
    assert small.metadata.model_name == engine.model_name
    with pytest.raises(NotImplementedError, match="does not call tools"):
        small.predict_and_call([], user_msg="hi")
    finish = engine.decoder.finish
    monkeypatch.setattr(engine.decoder, "finish", lambda *a: (time.sleep(0.05), finish(*a))[1])
    with pytest.raises(TimeoutError, match="fused prefill"):
        CacheBlendLLM(engine=engine, request_timeout=0.3, max_tokens=4).complete(FACTS[0] + "\n\n" + QUESTION)
    monkeypatch.setattr(engine.decoder, "finish", finish)
    done = CacheBlendLLM(engine=engine, additional_kwargs={"recompute_ratio": 1.0}, max_tokens=4).complete("Hi")
    assert done.raw["cacheblend"]["recompute_ratio"] == 1.0


def test_synthesizer_prompt_is_customisable(llm, nodes):
    from llama_index.core.prompts import PromptTemplate

    synth = CacheBlendSynthesizer(llm=llm)
    assert synth.get_prompts()["query_template"].get_template() == "{query_str}"
    synth.update_prompts({"query_template": PromptTemplate("Question: {query_str}\nAnswer:")})
    assert synth.query_template == "Question: {query_str}\nAnswer:"
    assert synth.synthesize(QUESTION, [NodeWithScore(node=n, score=1.0) for n in nodes]).response.strip()
    with pytest.raises(CacheBlendError, match="one prompt, 'query_template'"):
        synth.update_prompts({"text_qa_template": PromptTemplate("{context_str} {query_str}")})
    with pytest.raises(CacheBlendError, match="query_str"):
        synth.update_prompts({"query_template": "no placeholder"})
