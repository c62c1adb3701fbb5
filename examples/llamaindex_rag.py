"""LlamaIndex RAG on CacheBlend: FAISS + MiniLM retrieval over musique passages, chunk
KV caches precomputed by the ingestion pipeline, and the question answered from one
blended prompt; then the same query with full prefill, to compare time-to-first-token.

    .venv/bin/python examples/llamaindex_rag.py                 # default store (memory + disk)
    .venv/bin/python examples/llamaindex_rag.py --store memory --modes

``--modes`` also asks LlamaIndex's stock query engines (``compact``, ``simple_summarize``)
with ``CacheBlendLLM`` as a drop-in LLM, and prints how many node caches each one hit.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import faiss
import torch
from llama_index.core import (
    Document,
    PromptHelper,
    Settings,
    StorageContext,
    VectorStoreIndex,
    get_response_synthesizer,
)
from llama_index.core.callbacks import CallbackManager
from llama_index.core.callbacks.base_handler import BaseCallbackHandler
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.embeddings.huggingface import HuggingFaceEmbedding
from llama_index.llms.cacheblend import CacheBlendKVTransform, CacheBlendLLM, cacheblend_query_engine
from llama_index.vector_stores.faiss import FaissVectorStore
from rag_common import minilm_dir, rag_corpus

from cacheblend.datasets import QA_PREAMBLE, QA_QUERY

QUERY_TEMPLATE = QA_QUERY.replace("{question}", "{query_str}")


class StatsRecorder(BaseCallbackHandler):
    """Keeps the blend stats of every LLM call a stock query engine makes."""

    def __init__(self) -> None:
        super().__init__(event_starts_to_ignore=[], event_ends_to_ignore=[])
        self.calls: list[dict] = []

    def on_event_start(self, event_type, payload=None, event_id="", parent_id="", **kwargs) -> str:
        return event_id

    def on_event_end(self, event_type, payload=None, event_id="", **kwargs) -> None:
        response = (payload or {}).get(EventPayload.RESPONSE) or (payload or {}).get(EventPayload.COMPLETION)
        if event_type == CBEventType.LLM and isinstance(getattr(response, "raw", None), dict):
            self.calls.append(response.raw["cacheblend"])

    def start_trace(self, trace_id=None) -> None:
        pass

    def end_trace(self, trace_id=None, trace_map=None) -> None:
        pass


def build_index(passages: list[str], llm: CacheBlendLLM) -> VectorStoreIndex:
    """Split, precompute KV, embed; the nodes go to FAISS (vectors) and the docstore (text)."""
    embed = HuggingFaceEmbedding(model_name=minilm_dir())
    pipeline = IngestionPipeline(transformations=[
        SentenceSplitter(chunk_size=1024, chunk_overlap=0),
        CacheBlendKVTransform(llm=llm, show_progress=True),
        embed,
    ])
    t = time.perf_counter()
    nodes = pipeline.run(documents=[Document(text=p) for p in passages])
    print(f"ingested {len(nodes)} nodes (KV + embeddings) in {time.perf_counter() - t:.1f} s")
    storage = StorageContext.from_defaults(vector_store=FaissVectorStore(faiss_index=faiss.IndexFlatL2(384)))
    return VectorStoreIndex(nodes, storage_context=storage, embed_model=embed)


def show(label: str, meta: dict) -> None:
    print(f"[{label:>5}] TTFT {meta['ttft_s']:5.2f} s | {meta['prompt_tokens']} prompt tokens: "
          f"{meta['reused_tokens']} reused, {meta['recomputed_tokens']} recomputed, {meta['computed_tokens']} computed")


def compare_modes(index: VectorStoreIndex, llm: CacheBlendLLM, question: str, top_k: int) -> None:
    """Node caches used by the stock synthesizers, which paste the nodes into formatted
    prompts.  ``learn=False``: only passages ingested before count as chunks.  The last
    row gives ``compact`` a 1536-token window, so it must re-split the retrieved text."""
    recorder = StatsRecorder()
    Settings.callback_manager = CallbackManager([recorder])  # the stock engines hand it to the LLM
    drop_in = CacheBlendLLM(store=llm.store, max_tokens=llm.max_tokens, learn=False)
    small = PromptHelper(context_window=1536, num_output=drop_in.max_tokens)
    engines = {
        "compact": index.as_query_engine(llm=drop_in, response_mode="compact", similarity_top_k=top_k),
        "simple_summarize": index.as_query_engine(llm=drop_in, response_mode="simple_summarize",
                                                  similarity_top_k=top_k),
        "compact, 1536 window": RetrieverQueryEngine(index.as_retriever(similarity_top_k=top_k),
                                                     get_response_synthesizer(drop_in, prompt_helper=small)),
    }
    print(f"\nnode caches used per response mode ({top_k} nodes retrieved):")
    for mode, engine in engines.items():
        recorder.calls.clear()
        engine.query(question)
        for i, s in enumerate(recorder.calls):
            print(f"  {mode:>20} call {i + 1}: {s['chunks']}/{top_k} node caches used, TTFT {s['ttft_s']:.2f} s, "
                  f"{s['reused_tokens']}/{s['prompt_tokens']} prompt tokens reused")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", default=None, help="KV store spec (default: the core default, memory + disk)")
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--questions", type=int, default=2, help="musique questions whose passages form the corpus")
    ap.add_argument("--passages", type=int, default=4, help="passages per question")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--modes", action="store_true", help="also measure the stock response modes")
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))

    t = time.perf_counter()
    llm = CacheBlendLLM(store=args.store, max_tokens=args.max_tokens)
    print(f"model {llm.metadata.model_name} loaded in {time.perf_counter() - t:.1f} s")
    passages, qa = rag_corpus(args.questions, args.passages)  # the first question's passages and distractors
    question, gold = qa[0]
    index = build_index(passages, llm)
    llm.complete("Hello", max_tokens=1)  # warm-up, so neither timed run pays first-call costs

    print(f"\nQuestion: {question}\nGold: {' | '.join(gold)}")
    options = dict(similarity_top_k=args.top_k, preamble=QA_PREAMBLE, query_template=QUERY_TEMPLATE)
    blend = cacheblend_query_engine(index, llm=llm, **options).query(question)
    print(f"Answer: {str(blend).strip()}\nSources:")
    for n in blend.source_nodes:
        text = " ".join(n.node.get_content().split())
        print(f"  {n.score:.3f} {n.node.metadata['cacheblend_key'][:12]} {text[:70]}…")
    full_llm = CacheBlendLLM(store=args.store, max_tokens=args.max_tokens, method="full")  # same shared engine
    full = cacheblend_query_engine(index, llm=full_llm, **options).query(question)
    print(f"Full-prefill answer: {str(full).strip()}\n")
    show("full", full.metadata["cacheblend"])
    show("blend", blend.metadata["cacheblend"])
    print(f"  CacheBlendSynthesizer: {blend.metadata['cacheblend']['chunks']}/{args.top_k} node caches used")
    ratio = full.metadata["cacheblend"]["ttft_s"] / blend.metadata["cacheblend"]["ttft_s"]
    print(f"TTFT: blend is {ratio:.1f}x faster than full prefill")
    if args.modes:
        compare_modes(index, llm, question, args.top_k)


if __name__ == "__main__":
    main()
