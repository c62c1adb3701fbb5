"""One vLLM process with the CacheBlend connector on a Redis store and Redis passage
registry: answers one prompt (token ids from a JSON file) and prints one JSON line.
Run twice by test_connector.py to show two servers reusing each other's chunks."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def main(model: str, ids_file: str, redis_url: str) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.config import KVTransferConfig

    ids = json.loads(open(ids_file).read())
    llm = LLM(model=model, dtype="float32", enforce_eager=True, enable_prefix_caching=False, max_model_len=8192,
              max_num_batched_tokens=8192, max_num_seqs=1, seed=0,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="CacheBlendConnector", kv_connector_module_path="cacheblend.integrations.vllm",
                  kv_role="kv_both",
                  kv_connector_extra_config={"store": redis_url, "passages": redis_url, "recompute_ratio": 0.15}))
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, temperature=0.0),
                          use_tqdm=False)
    print(json.dumps({"first_token": out.outputs[0].token_ids[0], "num_cached_tokens": out.num_cached_tokens}),
          flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
