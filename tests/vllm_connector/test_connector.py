"""CacheBlendConnector inside vLLM (CPU, eager): exactness at ratio 1.0, quality at 0.15,
and chunk caches made by another process (this one) found in the shared disk store.

    HF_HUB_OFFLINE=1 .venv-vllm/bin/python -m pytest tests/vllm_connector -q

Two ``LLM``s (plain and with the connector), one at a time; about 3-5 minutes on 2 cores."""

from __future__ import annotations

import gc
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import pytest  # noqa: E402

pytest.importorskip("vllm")

from cacheblend import Engine  # noqa: E402
from cacheblend.datasets import QA_PREAMBLE, load_qa  # noqa: E402
from cacheblend.integrations.vllm import ChunkMatcher, read_passages, register_passages  # noqa: E402

N_PROMPTS, N_PASSAGES, MAX_TOKENS = 5, 4, 8
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory, default_model_dir):
    """Prompts of musique dev examples, their chunks ingested into a disk store by the core
    engine of *this* process and their texts registered for the connector."""
    root = tmp_path_factory.mktemp("vllm_connector")
    examples = load_qa("musique", "dev", limit=N_PROMPTS, passages=N_PASSAGES)
    engine = Engine.load(default_model_dir, store=f"disk:{root / 'kv'}")
    prompts = []
    for ex in examples:
        handles = engine.ingest(ex.passages)
        prompts.append(engine.prompts.build(ex.query, [list(h.token_ids) for h in handles], None,
                                            QA_PREAMBLE).all_ids)
    register_passages(root / "passages.jsonl", [p for ex in examples for p in ex.passages])
    tokenize = engine.prompts.encode
    del engine
    gc.collect()
    return {"root": root, "model": str(default_model_dir), "prompts": prompts, "encode": tokenize,
            "examples": examples}


def _run(model: str, requests: list[tuple[list[int], int, float]], extra: dict | None) -> list:
    """Greedy outputs of ``(ids, max_tokens, recompute_ratio)`` on a fresh eager LLM."""
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.config import KVTransferConfig

    kw = {}
    if extra is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="CacheBlendConnector", kv_connector_module_path="cacheblend.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=extra)
    llm = LLM(model=model, dtype="float32", enforce_eager=True, enable_prefix_caching=False, max_model_len=8192,
              max_num_batched_tokens=8192, max_num_seqs=1, seed=0, **kw)
    try:
        outs = []
        for ids, max_tokens, ratio in requests:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                    extra_args={"kv_transfer_params": {"recompute_ratio": ratio}})
            (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
            outs.append((list(out.outputs[0].token_ids), out.num_cached_tokens))
        return outs
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def outputs(setup):
    """Plain vLLM, then vLLM with the connector: prompt 0 at ratio 1.0 (8 tokens), then every
    prompt at 0.15.  Also the disk store's file count before and after the connector ran."""
    prompts = setup["prompts"]
    plain = _run(setup["model"], [(prompts[0], MAX_TOKENS, 1.0)] + [(p, 1, 1.0) for p in prompts[1:]], None)
    kv_dir = setup["root"] / "kv"
    before = sorted(p.name for p in kv_dir.rglob("*") if p.is_file())
    extra = {"store": f"disk:{kv_dir}", "passages": str(setup["root"] / "passages.jsonl"), "recompute_ratio": 0.15}
    blend = _run(setup["model"], [(prompts[0], MAX_TOKENS, 1.0)] + [(p, 1, 0.15) for p in prompts], extra)
    after = sorted(p.name for p in kv_dir.rglob("*") if p.is_file())
    return {"prompt0_tokens": len(prompts[0]), "plain": plain, "exact": blend[0], "blend": blend[1:],
            "files": (before, after)}


def test_matcher_finds_every_ingested_chunk(setup):
    """Token-level matching finds each passage of a prompt built the core's way, in order."""
    matcher = ChunkMatcher(setup["encode"], path=setup["root"] / "passages.jsonl")
    matcher.refresh()
    assert len(read_passages(setup["root"] / "passages.jsonl")) == N_PROMPTS * N_PASSAGES
    ids = setup["prompts"][0]
    spans = matcher.find(ids, end_limit=len(ids) - 1)
    assert len(spans) == N_PASSAGES
    for (a, b), text in zip(spans, setup["examples"][0].passages, strict=True):
        assert ids[a:b] == setup["encode"](text + "\n\n")
    assert register_passages(setup["root"] / "passages.jsonl", setup["examples"][0].passages) == 0


def test_ratio_one_matches_plain_vllm(outputs):
    """Recomputing every token through the connector gives vLLM's own greedy output."""
    tokens, cached = outputs["exact"]
    assert cached == outputs["prompt0_tokens"] - 1  # every token but the last came from the connector
    assert tokens == outputs["plain"][0][0]


def test_blend_first_token_agreement(outputs):
    """At 15 % recompute the first token mostly agrees with vLLM's full prefill."""
    firsts_plain = [toks[0] for toks, _ in outputs["plain"]]
    firsts_blend = [toks[0] for toks, _ in outputs["blend"]]
    assert all(cached > 0 for _, cached in outputs["blend"])
    agreement = sum(a == b for a, b in zip(firsts_plain, firsts_blend, strict=True)) / len(firsts_plain)
    print(f"first-token agreement at 0.15: {agreement:.2f} ({firsts_blend} vs {firsts_plain})")
    assert agreement >= 0.8


def test_chunks_from_another_process_are_reused(outputs):
    """The worker found every chunk this process ingested: it stored nothing new."""
    before, after = outputs["files"]
    assert before and after == before


def test_two_vllm_processes_share_one_redis_tier(setup, redis_server, tmp_path):
    """Server A computes the chunks of a prompt it has never seen (passages known only from
    the Redis registry) and stores them in Redis; server B, another process, reuses them."""
    import json
    import re
    import subprocess
    import sys
    from pathlib import Path

    ex = setup["examples"][0]
    assert register_passages(redis_server.url, ex.passages) == len(ex.passages)
    assert set(read_passages(redis_server.url)) == set(ex.passages)
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps(setup["prompts"][0]))
    script = Path(__file__).with_name("serve_once.py")
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(script), setup["model"], str(ids_file), redis_server.url],
                              capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        stats = re.findall(r"'store_hits': (\d+), 'store_misses': (\d+)", proc.stdout + proc.stderr)
        assert stats, (proc.stdout + proc.stderr)[-3000:]
        line = [x for x in proc.stdout.splitlines() if x.startswith('{"first_token"')][-1]  # vLLM logs here too
        runs.append((json.loads(line), [int(x) for x in stats[-1]]))
    (out_a, (hits_a, misses_a)), (out_b, (hits_b, misses_b)) = runs
    assert misses_a >= N_PASSAGES  # A computed the chunks and stored them in Redis ...
    assert hits_b >= N_PASSAGES and misses_b == 0  # ... and B, another process, found them all
    assert out_a["num_cached_tokens"] == out_b["num_cached_tokens"] == len(setup["prompts"][0]) - 1
    assert out_a["first_token"] == out_b["first_token"]
