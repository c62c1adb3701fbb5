"""vLLM offline inference with and without CacheBlend's KV connector: TTFT on one RAG prompt.

The chunks (6 musique dev passages) are precomputed first by the core engine into a temp
disk store and their texts registered; then plain vLLM and vLLM with
``CacheBlendConnector`` answer the same prompt, one ``LLM`` at a time.  TTFT is the wall time
of ``generate`` with ``max_tokens=1``, after one untimed warm-up request on another prompt
(whose chunks are known too, so the connector's path is warm as well).  Prints one JSON line.

    HF_HUB_OFFLINE=1 .venv-vllm/bin/python examples/vllm_offline.py [--ratio 0.15]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("CACHEBLEND_DATA", str(Path(__file__).resolve().parents[2] / "shared" / "data"))  # repo layout
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # "auto" would leave the model one core
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def build_prompts(model: str, store: str, passages_file: Path, n: int) -> list[list[int]]:
    """Token ids of musique dev examples 0 (timed) and 1 (warm-up), their chunks ingested."""
    from cacheblend import Engine
    from cacheblend.datasets import QA_PREAMBLE, load_qa
    from cacheblend.integrations.vllm import register_passages

    engine = Engine.load(model, store=store)
    prompts = []
    for ex in load_qa("musique", "dev", limit=2, passages=n):
        handles = engine.ingest(ex.passages)
        register_passages(passages_file, ex.passages)
        prompts.append(engine.prompts.build(ex.query, [list(h.token_ids) for h in handles], None,
                                            QA_PREAMBLE).all_ids)
    del engine
    gc.collect()
    return prompts


def ttft(model: str, timed: list[int], warm: list[int], kv_transfer_config=None) -> tuple[float, int]:
    """Seconds to the first token of ``timed`` on a fresh LLM, and that token."""
    from vllm import LLM, SamplingParams, TokensPrompt

    # load_format="cacheblend": the connector's worker recomputes on the model vLLM loads (no second copy)
    llm = LLM(model=model, dtype="float32", enforce_eager=True, enable_prefix_caching=False, max_model_len=8192,
              max_num_batched_tokens=8192, max_num_seqs=1, kv_transfer_config=kv_transfer_config,
              load_format="cacheblend" if kv_transfer_config is not None else "auto")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    try:
        llm.generate([TokensPrompt(prompt_token_ids=warm)], params, use_tqdm=False)
        t = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=timed)], params, use_tqdm=False)
        return time.perf_counter() - t, out.outputs[0].token_ids[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratio", type=float, default=0.15, help="share of chunk tokens recomputed")
    ap.add_argument("--passages", type=int, default=6)
    args = ap.parse_args(argv)
    from vllm.config import KVTransferConfig

    from cacheblend.models.loader import resolve_model_dir

    model = str(resolve_model_dir(None))
    with tempfile.TemporaryDirectory(prefix="cacheblend-vllm-") as tmp:
        store, passages_file = f"disk:{tmp}/kv", Path(tmp) / "passages.jsonl"
        timed, warm = build_prompts(model, store, passages_file, args.passages)
        full_s, full_tok = ttft(model, timed, warm)
        config = KVTransferConfig(
            kv_connector="CacheBlendConnector", kv_connector_module_path="cacheblend.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config={"store": store, "passages": str(passages_file),
                                                          "recompute_ratio": args.ratio})
        blend_s, blend_tok = ttft(model, timed, warm, config)
    result = {"prompt_tokens": len(timed), "recompute_ratio": args.ratio, "ttft_full_s": round(full_s, 3),
              "ttft_blend_s": round(blend_s, 3), "speedup": round(full_s / blend_s, 2),
              "same_first_token": full_tok == blend_tok}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
