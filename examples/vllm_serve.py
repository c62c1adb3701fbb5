"""A vLLM OpenAI-compatible server with CacheBlend as a LangChain chat model's backend.

Starts the server (vLLM's venv, loopback, a temp disk store), has *vLLM* compute and store
the KV of 6 musique dev passages (``llm.ingest``), then asks the question with those
passages as documents twice, with vLLM's full prefill (``method="full"``) and with
CacheBlend, and prints one JSON line with both TTFTs (time to the first streamed token,
measured by the client over HTTP) and the worker's fidelity receipt of the blended answer.
Run from the main venv (it has LangChain):

    make vllm && HF_HUB_OFFLINE=1 .venv/bin/python examples/vllm_serve.py
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("CACHEBLEND_DATA", str(ROOT.parent / "shared" / "data"))  # repo layout


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                    help="the Python of the venv vLLM is installed in (make vllm)")
    ap.add_argument("--passages", type=int, default=6)
    ap.add_argument("--ratio", type=float, default=0.15)
    args = ap.parse_args(argv)

    from langchain_cacheblend import ChatCacheBlend

    from cacheblend.datasets import load_qa
    from cacheblend.integrations.vllm_server import VLLMServer, kv_transfer_config
    from cacheblend.models.loader import resolve_model_dir

    warm, ex = load_qa("musique", "dev", limit=2, passages=args.passages)[::-1]
    with tempfile.TemporaryDirectory(prefix="cacheblend-serve-") as tmp:
        config = kv_transfer_config(f"disk:{tmp}/kv", recompute_ratio=args.ratio, stats=f"{tmp}/stats.jsonl")
        with VLLMServer(str(resolve_model_dir(None)), config, python=args.vllm_python,
                        log_path=Path(tmp) / "server.log") as server:
            llm = ChatCacheBlend(base_url=server.base_url, max_tokens=16)
            llm.ingest(warm.passages + ex.passages)
            llm.invoke(warm.question, documents=warm.passages)  # warm-up, untimed
            full = llm.invoke(ex.question, documents=ex.passages, method="full")
            blend = llm.invoke(ex.question, documents=ex.passages)
            worker = [json.loads(x) for x in Path(f"{tmp}/stats.jsonl").read_text().splitlines()][-1]
    meta = blend.response_metadata
    result = {"prompt_tokens": blend.usage_metadata["input_tokens"], "recompute_ratio": args.ratio,
              "ttft_full_s": round(full.response_metadata["ttft_s"], 3), "ttft_blend_s": round(meta["ttft_s"], 3),
              "speedup": round(full.response_metadata["ttft_s"] / meta["ttft_s"], 2),
              "same_first_word": full.content.split()[:1] == blend.content.split()[:1],
              "cache_read_tokens": blend.usage_metadata["input_token_details"]["cache_read"],
              "worker": {k: worker[k] for k in ("store_hits", "store_misses", "reused", "recomputed", "blend_s")},
              "fidelity": meta["cacheblend"]["fidelity"],  # the worker's receipt, fetched after the stream
              "answer": blend.content, "gold": ex.answers}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
