"""A chunk longer than ``max_num_batched_tokens``: vLLM prefills its ingest request over
several steps (chunked prefill), and the connector saves it after the last one — the same
entry the core engine precomputes."""

from __future__ import annotations

import gc
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("vllm")

from cacheblend import Engine  # noqa: E402
from cacheblend.blend.hint import decode_hint  # noqa: E402
from cacheblend.datasets import load_qa  # noqa: E402
from cacheblend.store import open_store  # noqa: E402
from cacheblend.store.entry import read_entry  # noqa: E402

pytestmark = pytest.mark.slow
STEP = 128  # max_num_batched_tokens: the chunk takes several prefill steps


def test_a_chunk_longer_than_one_prefill_step_is_saved_after_its_last_step(tmp_path, default_model_dir):
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.config import KVTransferConfig

    core = Engine.load(default_model_dir, store="memory")
    text = "\n".join(p.strip() for p in load_qa("musique", "dev", limit=1, passages=3)[0].passages)
    handle = core.handle(text)
    ids, sink = list(handle.token_ids), list(core.chunks.sink)
    assert len(sink) + len(ids) > 3 * STEP
    extra = {"store": f"disk:{tmp_path / 'kv'}", "stats": str(tmp_path / "stats.jsonl")}
    llm = LLM(model=str(default_model_dir), dtype="float32", enforce_eager=True, enable_prefix_caching=False,
              max_model_len=4096, max_num_batched_tokens=STEP, enable_chunked_prefill=True, max_num_seqs=1, seed=0,
              kv_transfer_config=KVTransferConfig(kv_connector="CacheBlendConnector",
                                                  kv_connector_module_path="cacheblend.integrations.vllm",
                                                  kv_role="kv_both", kv_connector_extra_config=extra))
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0,
                                extra_args={"kv_transfer_params": {"cacheblend": "ingest", "sink": len(sink)}})
        llm.generate([TokensPrompt(prompt_token_ids=sink + ids)], params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    saved = [json.loads(x) for x in (tmp_path / "stats.jsonl").read_text().splitlines()]
    saved = [s for s in saved if s["op"] == "ingest"]
    assert [(s["stored"], s["tokens"]) for s in saved] == [(True, len(ids))]
    entry = read_entry(open_store(f"disk:{tmp_path / 'kv'}").open(handle.key))
    assert entry is not None and entry.meta["model"] == core.fingerprint
    ref = core.precompute_chunk(ids)
    for saved, own in ((entry.k, ref.k), (entry.v, ref.v)):
        _assert_same_rows(saved, own)
    # the deviation hint is stored with vLLM's K/V as with the core's own
    hint, own_hint = decode_hint(entry.meta, len(ids)), decode_hint(ref.meta, len(ids))
    assert hint is not None and float(torch.corrcoef(torch.stack([hint, own_hint]))[0, 1]) > 0.99


def _assert_same_rows(saved, own):
    """vLLM's chunked prefill and the core's kernels are two float32 implementations, so
    their K/V agree to rounding carried through 30 layers, not bit for bit: on this
    project's AMX Xeon the largest difference per layer is 1e-5 to 8e-5, on the CI's CPU
    it reached 1e-2 (values up to about 20) in the last layers. What the test guards fails
    by far more: a row saved from another step or position, or keys left rotated, points
    elsewhere (cosine well below 0.99) and is off by O(1)."""
    per_layer = (saved - own).abs().amax(dim=(1, 2, 3))
    cosine = torch.nn.functional.cosine_similarity(saved, own, dim=-1)  # one per (layer, head, token)
    assert cosine.min() > 0.9999, f"a row points elsewhere (cosine {cosine.min():.6f}); per layer {per_layer}"
    assert per_layer.max() < 5e-2, f"largest difference per layer: {per_layer}"
