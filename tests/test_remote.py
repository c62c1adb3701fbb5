"""A real ``vllm serve`` (OpenAI API) with CacheBlendConnector as the backend of the core's
RemoteEngine and of both adapters: chunks ingested *by vLLM*, blended answers, identities
against vLLM's own full prefill, and bad input.

The server runs from ``.venv-vllm`` (``make vllm``), started here on a free loopback port
and stopped at the end; without that venv these tests skip, unless
``CACHEBLEND_REQUIRE_VLLM=1`` (``make test`` sets it) turns the skip into a failure."""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cacheblend import CacheBlendError, Engine
from cacheblend.datasets import load_qa
from cacheblend.integrations.vllm_server import VLLMServer, free_port, kv_transfer_config
from cacheblend.remote import RemoteEngine
from cacheblend.store import open_store
from cacheblend.store.entry import read_entry

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from rag_common import minilm_dir  # noqa: E402

VLLM_PYTHON = Path(os.environ.get("CACHEBLEND_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir):
    if not VLLM_PYTHON.exists():
        if os.environ.get("CACHEBLEND_REQUIRE_VLLM") == "1":
            pytest.fail(f"{VLLM_PYTHON} is missing: `make vllm` builds the vLLM venv")
        pytest.skip("no vLLM venv (make vllm)")
    root = tmp_path_factory.mktemp("vllm_serve")
    config = kv_transfer_config(f"disk:{root / 'kv'}", stats=str(root / "stats.jsonl"),
                                passages=str(root / "passages.jsonl"))
    srv = VLLMServer(str(default_model_dir), config, python=str(VLLM_PYTHON), log_path=root / "server.log")
    with srv:
        srv.root = root
        yield srv


def stats(server) -> list[dict]:
    """What the connector's worker did, one record per load, ingest or release."""
    path = server.root / "stats.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def example():
    return load_qa("musique", "dev", limit=1, passages=4)[0]


@pytest.fixture(scope="module")
def remote(server, example):
    engine = RemoteEngine.shared(server.base_url)
    engine.ingest(example.passages)
    return engine


def messages(example) -> list[dict[str, str]]:
    """The passages pasted into the prompt, as a framework's stuff chain would."""
    return [{"role": "user", "content": "\n\n".join(example.passages) + f"\n\nQuestion: {example.question}"}]


def answer(engine, example, **options):
    gen = engine.start_chat(messages(example), learn=False, max_new_tokens=8, **options)
    return "".join(gen.pieces), gen.result


def test_vllm_saves_chunk_caches_the_core_would_compute(server, remote, example, default_model_dir):
    """Ingestion through the server stores vLLM's own K/V, keys un-rotated: the same entry
    (key, header, values to float rounding) that the core engine precomputes."""
    saved = [s for s in stats(server) if s["op"] == "ingest"]
    assert len(saved) == len(example.passages) and all(s["stored"] for s in saved)
    core = Engine.load(default_model_dir, store="memory")
    store = open_store(f"disk:{server.root / 'kv'}")
    for text in example.passages:
        handle = core.handle(text)
        entry = read_entry(store.open(handle.key))
        assert entry is not None and entry.meta["model"] == core.fingerprint
        ref = core.precompute_chunk(list(handle.token_ids))
        assert (entry.k - ref.k).abs().max() < 1e-3 and (entry.v - ref.v).abs().max() < 1e-3
    remote.ingest(example.passages[:1])  # already stored: nothing written again
    last = stats(server)[-1]
    assert last["op"] == "ingest" and last["stored"] is False


def test_remote_engine_blends_and_ratio_one_is_vllms_full_prefill(server, remote, example):
    full_text, full = answer(remote, example, method="full")
    exact_text, exact = answer(remote, example, recompute_ratio=1.0)
    blend_text, blend = answer(remote, example, recompute_ratio=0.15)
    assert exact_text == full_text and full.stats.chunks == 0 and exact.stats.chunks == len(example.passages)
    load = stats(server)[-1]
    assert load["op"] == "load" and load["recompute_ratio"] == 0.15
    assert load["store_hits"] == len(example.passages) and load["store_misses"] == 0
    # the client's plan is what the worker did: chunks reused approximately, the prompt's prefix exactly
    assert blend.usage["approximate_tokens"] == load["fidelity"]["approximate_tokens"] > 0
    assert blend.usage["cached_tokens"] == load["fidelity"]["exact_cached_tokens"] > 0 and load["prefix_cached"]
    assert load["reused"] == blend.usage["approximate_tokens"] + blend.usage["cached_tokens"]
    assert not blend.stats.exact and exact.stats.exact and blend.stats.risk == load["fidelity"]["risk"] > 0
    assert blend.usage["prompt_tokens"] == full.usage["prompt_tokens"] == load["prompt_tokens"]
    assert blend_text.split()[:1] == full_text.split()[:1]  # this example's first word survives blending
    assert 0 < blend.ttft_s and blend.finish_reason == "length"
    # The first passage opens the user message, right behind the chat frame (the frame sink): the
    # worker reuses it exactly, the client's receipt counts it so; with it alone the answer is exact.
    assert load["fidelity"]["exact_cached_tokens"] > load["prompt_tokens"] // (2 * len(example.passages))
    one = remote.start_chat([{"role": "user", "content": f"{example.passages[0]}\n\nQuestion: {example.question}"}],
                            learn=False, max_new_tokens=2, recompute_ratio=0.15)
    "".join(one.pieces)
    load = stats(server)[-1]
    assert load["op"] == "load" and load["fidelity"]["exact"] and one.result.stats.exact
    assert one.result.usage["approximate_tokens"] == load["fidelity"]["approximate_tokens"] == 0
    # the streamed answer's receipt is the worker's, fetched after the stream (written a step after it
    # when a stop string ends it): an escalation shows
    _, guarded = answer(remote, example, recompute_ratio="guard", max_risk=0.0, stop=[" "])
    assert guarded.stats.escalated and guarded.stats.exact and guarded.stats.ratio_used == 1.0
    assert guarded.finish_reason == "stop"
    assert guarded.usage["approximate_tokens"] == stats(server)[-1]["fidelity"]["approximate_tokens"] == 0


def test_a_chat_without_passages_reads_its_system_instruction_exactly(server, remote, example):
    """A chat application's long system instruction, asked without passages: RemoteEngine
    names it as the prompt's prefix, and the worker reads it exactly from the prefix cache
    from the second call on. It used to be learned as a chunk and blended."""
    system = ("You answer questions about people, places and works of art. Answer in one short "
              "sentence that names the person, place, date or number asked for, and say that you do "
              "not know when you are not sure; never invent names, dates or numbers.")
    chat = [{"role": "system", "content": system}, {"role": "user", "content": example.question}]
    full = remote.start_chat(chat, method="full", max_new_tokens=8)
    full_text = "".join(full.pieces)
    for _ in range(2):  # the first call stores the prefix, the second reads it
        gen = remote.start_chat(chat, max_new_tokens=8)
        text = "".join(gen.pieces)
        assert text == full_text and gen.result.stats.exact and gen.result.stats.chunks_learned == 0
    load = stats(server)[-1]
    assert load["op"] == "load" and load["chunks"] == 0 and load["prefix_cached"] and load["fidelity"]["exact"]
    assert gen.result.usage["cached_tokens"] == load["fidelity"]["exact_cached_tokens"] > 40
    assert gen.result.usage["approximate_tokens"] == load["fidelity"]["approximate_tokens"] == 0
    # a long question behind a short system message: vLLM's own prefill, not the worker's
    loads = len(stats(server))
    long_question = [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": " ".join(reversed(example.passages[0].split())) + "\n\n"
                      + example.question}]  # no known passage in it
    gen = remote.start_chat(long_question, learn=False, max_new_tokens=2)
    "".join(gen.pieces)
    assert len(stats(server)) == loads and gen.result.stats.exact and gen.result.usage["cached_tokens"] == 0
    # a conversation: only the system turn is the prefix (read exactly whatever the earlier
    # turns were); they are computed, where they used to be stored as a new prefix per turn
    for earlier in ("Where is Vienna?", "Who wrote Hamlet?"):
        talk = [chat[0], {"role": "user", "content": earlier}, {"role": "assistant", "content": "I do not know."},
                messages(example)[0]]
        "".join((gen := remote.start_chat(talk, learn=False, max_new_tokens=2)).pieces)
    load = stats(server)[-1]
    assert load["op"] == "load" and load["prefix_cached"] and load["chunks"] == len(example.passages)
    assert gen.result.usage["cached_tokens"] == load["fidelity"]["exact_cached_tokens"] < 100


def test_langchain_chat_model_on_the_server(server, remote, example):
    from langchain_cacheblend import ChatCacheBlend
    from langchain_core.messages import HumanMessage

    llm = ChatCacheBlend(base_url=server.base_url, max_tokens=8, learn_passages=False)
    question = [HumanMessage(example.question)]
    reply = llm.invoke(question, documents=example.passages)
    exact = llm.invoke(question, documents=example.passages, recompute_ratio=1.0)
    full = llm.invoke(question, documents=example.passages, method="full")
    assert exact.content == full.content and reply.content
    assert reply.usage_metadata["input_token_details"]["cacheblend_approximate"] > 0
    assert reply.response_metadata["cacheblend"]["fidelity"]["exact"] is False
    assert reply.response_metadata["model_name"] == remote.model_name
    streamed = list(llm.stream(question, documents=example.passages))
    assert "".join(c.content for c in streamed) == reply.content
    assert streamed[-1].usage_metadata["output_tokens"] == 8
    assert stats(server)[-1]["store_hits"] == len(example.passages)
    with pytest.raises(ValueError, match="method must be one of"):
        llm.invoke(question, method="prefix")


def test_llamaindex_llm_on_the_server(server, remote, example):
    from llama_index.core.base.llms.types import ChatMessage, MessageRole
    from llama_index.llms.cacheblend import CacheBlendLLM

    llm = CacheBlendLLM(base_url=server.base_url, max_tokens=8, learn=False)
    assert llm.metadata.context_window == 8192
    prompt = "\n\n".join(example.passages) + f"\n\nQuestion: {example.question}"
    done = llm.complete(prompt, formatted=True)
    full = llm.complete(prompt, formatted=True, method="full")
    assert done.raw["usage"]["approximate_tokens"] > 0 and done.raw["cacheblend"]["chunks"] == len(example.passages)
    assert done.text.split()[:1] == full.text.split()[:1]
    last = list(llm.stream_chat([ChatMessage(role=MessageRole.USER, content=prompt)]))[-1]
    assert last.message.content == done.text and last.raw["usage"]["completion_tokens"] == 8


def test_remote_engine_start_generate_and_stream(server, remote, example):
    """The backend protocol's prompt-building calls, as on the in-process engine."""
    q, chunks = example.question, example.passages
    exact = remote.generate(q, chunks, recompute_ratio=1.0, max_new_tokens=8)
    assert exact.text == remote.generate(q, chunks, method="full", max_new_tokens=8).text
    run = remote.start(q, chunks, max_new_tokens=8, system="Answer briefly.")
    text = "".join(run.pieces)
    assert run.result is not None and run.result.stats.chunks == len(chunks) and text
    assert stats(server)[-1]["store_hits"] == len(chunks)
    assert "".join(remote.stream(q, chunks, max_new_tokens=8, system="Answer briefly.")) == text
    with pytest.raises(CacheBlendError, match="unknown options"):
        remote.start(q, chunks, ratio=0.2)


def test_the_explorer_answers_through_the_server(server, remote, example):
    """cacheblend ui --base-url: the Ask tab streams both answers from the server."""
    from cacheblend.ui import Explorer

    explorer = Explorer(remote, None)
    full, chosen, summary = list(explorer.ask("\n---\n".join(example.passages), None, example.question,
                                              "blend", 1.0, 8))[-1]
    assert full and full == chosen  # ratio 1.0 through the connector is vLLM's full prefill
    assert summary.count("TTFT") == 2 and "store hits" in summary
    with pytest.raises(ValueError, match="in this process"):
        explorer.explain("a", None, "q", 0.15, None)


def test_llamaindex_rag_paths_on_the_server(server, remote, example):
    """Transform, synthesizer and query engine over a vLLM server with the connector."""
    from llama_index.core import VectorStoreIndex
    from llama_index.core.schema import NodeWithScore, TextNode
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from llama_index.llms.cacheblend import (
        CacheBlendKVTransform,
        CacheBlendLLM,
        CacheBlendSynthesizer,
        cacheblend_query_engine,
    )

    llm = CacheBlendLLM(base_url=server.base_url, max_tokens=8, learn=False)
    nodes = CacheBlendKVTransform(llm=llm)([TextNode(text=p) for p in example.passages])
    r = CacheBlendSynthesizer(llm=llm).synthesize(example.question, [NodeWithScore(node=n, score=1.0) for n in nodes])
    assert r.response.strip() and r.metadata["cacheblend"]["chunks"] == len(nodes)
    assert stats(server)[-1]["op"] == "load" and stats(server)[-1]["store_hits"] == len(nodes)
    index = VectorStoreIndex(nodes, embed_model=HuggingFaceEmbedding(model_name=minilm_dir()))
    answer = cacheblend_query_engine(index, llm=llm, similarity_top_k=2).query(example.question)
    assert answer.response.strip() and answer.metadata["cacheblend"]["chunks"] == 2
    assert stats(server)[-1]["store_hits"] == 2
    streamed = cacheblend_query_engine(index, llm=llm, similarity_top_k=2, streaming=True).query(example.question)
    assert "".join(streamed.response_gen) == answer.response


def test_langchain_rag_paths_on_the_server(server, remote, example):
    """The vector-store wrapper (ingestion) and the retrieval chain over a vLLM server."""
    from langchain_cacheblend import CacheBlendVectorStore, ChatCacheBlend, create_cacheblend_retrieval_chain
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_huggingface import HuggingFaceEmbeddings

    llm = ChatCacheBlend(base_url=server.base_url, max_tokens=8, learn=False)
    store = CacheBlendVectorStore(InMemoryVectorStore(HuggingFaceEmbeddings(model_name=minilm_dir())), llm)
    store.add_texts(example.passages)
    prompt = ChatPromptTemplate.from_messages([("system", "Use the context to answer.\n\n{context}"),
                                               ("human", "{input}")])
    chain = create_cacheblend_retrieval_chain(llm, store.as_retriever(search_kwargs={"k": 2}), prompt)
    out = chain.invoke({"input": example.question})
    assert out["answer"].strip() and len(out["context"]) == 2
    assert stats(server)[-1]["chunks"] == 2 and stats(server)[-1]["store_hits"] == 2


def test_plain_openai_chat_client_reuses_registered_passages(server, remote, example):
    """Any OpenAI client: vLLM applies the chat template and tokenizes the whole prompt; the
    connector finds the registered passages in those token ids and blends them (computing
    and storing them the first time, reusing them the second)."""
    from openai import OpenAI

    from cacheblend.integrations.registry import register_passages

    # Stripped: musique passages begin with a blank line, which BPE merges with the "\n\n"
    # before it into other tokens inside a prompt; token-level matching then cannot see them.
    passages = [p.strip() for p in example.passages]
    register_passages(server.root / "passages.jsonl", passages)
    client = OpenAI(base_url=server.base_url, api_key="EMPTY")
    content = "\n\n".join(passages) + f"\n\nQuestion: {example.question}"
    replies, loads = [], []
    for _ in range(2):
        replies.append(client.chat.completions.create(model=remote.model_name, max_tokens=4, temperature=0.0,
                                                      messages=[{"role": "user", "content": content}]))
        loads.append(stats(server)[-1])
    assert [x["op"] for x in loads] == ["load", "load"] and loads[0]["req_id"] != loads[1]["req_id"]
    assert loads[0]["chunks"] == loads[1]["chunks"] == len(passages)
    assert loads[1]["store_hits"] == len(passages) and loads[1]["store_misses"] == 0
    assert replies[0].usage.prompt_tokens == loads[0]["prompt_tokens"]  # the very ids vLLM tokenized
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content


def test_release_deletes_the_servers_entry(server, default_model_dir):
    text = "Remote release test passage: the Foo river flows into the Bar lake near Baz."
    engine = RemoteEngine(server.base_url)
    engine.ingest([text])
    core = Engine.load(default_model_dir, store="memory")
    key = core.handle(text).key
    store = open_store(f"disk:{server.root / 'kv'}")
    assert store.open(key) is not None
    assert engine.release(text) == 1 and text not in engine.passages
    assert stats(server)[-1] == {"op": "release", "tokens": len(core.prompts.chunk_ids(text)), "removed": True}
    assert store.open(key) is None


def test_bad_input_and_bad_servers_are_named(server, remote, example):
    with pytest.raises(CacheBlendError, match="base_url must be an http"):
        RemoteEngine("127.0.0.1:8000")
    with pytest.raises(CacheBlendError, match="serves .* not 'no-such-model'"):
        RemoteEngine(server.base_url, "no-such-model")
    with pytest.raises(ConnectionError, match="no OpenAI-compatible server answers"):
        RemoteEngine(f"http://127.0.0.1:{free_port()}/v1", max_retries=0, timeout=5)
    with pytest.raises(CacheBlendError, match="auto"):
        remote.start_chat(messages(example), recompute_ratio="auto")
    with pytest.raises(CacheBlendError, match="recompute_ratio"):
        remote.start_chat(messages(example), recompute_ratio=1.5)
    with pytest.raises(CacheBlendError, match="message 0"):
        remote.start_chat([{"role": "robot", "content": "hi"}])
    with pytest.raises(CacheBlendError, match="does not fit the server's context"):
        remote.start_chat([{"role": "user", "content": "word " * 9000}])


def post(server, path: str, body: bytes) -> tuple[int, dict]:
    """POST raw JSON to the server; (status, decoded reply), errors included."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{server.base_url}{path}", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_kv_transfer_params_get_400_and_the_server_stays_up(server, remote, example):
    """Malformed hints are answered with HTTP 400 naming the field (the guard the server is
    started with); the server keeps answering good requests."""
    import urllib.request

    model = json.dumps(remote.model_name)
    bad = [('{"chunks": [[0, 1e400]]}', "chunks[0]"), ('{"cacheblend": "release", "ids": ["x"]}', "ids"),
           ('{"check_layers": [99]}', "check_layers"), ('{"deviation": "q"}', "deviation"),
           ('{"recompute_ratio": 1.5}', "recompute_ratio"), ('{"method": "prefix"}', "method"),
           ('{"ratio": 0.2}', "unknown fields")]
    for params, field in bad:
        for path, prompt in (("/completions", '"prompt": [1, 2, 3, 4]'),
                             ("/chat/completions", '"messages": [{"role": "user", "content": "Hi"}]')):
            body = f'{{"model": {model}, {prompt}, "max_tokens": 1, "kv_transfer_params": {params}}}'
            status, reply = post(server, path, body.encode())
            assert status == 400, (path, params, status, reply)
            assert field in reply["error"]["message"] and reply["error"]["param"] == "kv_transfer_params"
    status, reply = post(server, "/completions", json.dumps(
        {"model": remote.model_name, "prompt": [1, 2, 3, 4], "max_tokens": 1,
         "kv_transfer_params": {"cacheblend": "ping"}}).encode())
    assert status == 200 and reply["kv_transfer_params"]["cacheblend"]["connector"] == "CacheBlendConnector"
    text, result = answer(remote, example, recompute_ratio=0.15)
    assert text and result.stats.chunks == len(example.passages)
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=30) as r:
        assert r.status == 200


@pytest.fixture(scope="module")
def side_servers(tmp_path_factory, default_model_dir, server):
    """Plain vLLM, and a server with the connector on the BOS chunk sink, started together:
    a start is mostly imports, on one core each."""
    root = tmp_path_factory.mktemp("side_servers")
    plain = VLLMServer(str(default_model_dir), None, python=str(VLLM_PYTHON), log_path=root / "plain.log")
    bos = VLLMServer(str(default_model_dir), kv_transfer_config(f"disk:{root / 'kv'}", chunk_sink="bos"),
                     python=str(VLLM_PYTHON), log_path=root / "bos.log")
    bos.root = root
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda srv: srv.start(), (plain, bos)))
        yield {"plain": plain, "bos": bos}
    finally:
        plain.stop()
        bos.stop()


def test_a_server_without_the_connector_is_refused(side_servers):
    """Plain vLLM would ignore the chunk spans (full prefill): the client refuses it when it connects."""
    with pytest.raises(CacheBlendError, match="does not run CacheBlendConnector"):
        RemoteEngine(side_servers["plain"].base_url)


def test_the_client_ingests_behind_the_servers_chunk_sink(default_model_dir, server, side_servers):
    """A server set to another chunk sink than the model family's: the client learns it at
    its ping and ingests behind it, so the server stores the chunk (it refuses chunks behind
    any other sink) under the key a core engine with that sink computes."""
    text = "Chunk sink test passage: the Quux canal joins the Corge river below Grault."
    engine = RemoteEngine((srv := side_servers["bos"]).base_url)
    assert engine.chunk_sink == "bos" and RemoteEngine.shared(server.base_url).chunk_sink == "frame"
    engine.ingest([text])
    core = Engine.load(default_model_dir, store="memory", chunk_sink="bos")
    assert open_store(f"disk:{srv.root / 'kv'}").open(core.handle(text).key) is not None
