"""CacheBlendConnector inside vLLM (CPU, eager): exactness at ratio 1.0, quality at 0.15,
chunk caches made by another process (this one) found in the shared disk store, the store's
failure cases (bad entries, Redis down and back, LMCache's blend-mode bugs).  Two vLLM
servers sharing one Redis tier are tests/test_serve.py's replicas.

    make test-vllm      # or: HF_HUB_OFFLINE=1 .venv-vllm/bin/python -m pytest tests/vllm_connector -q

A plain ``LLM``, then one with the connector kept for the module; about 4 minutes on 2 cores."""

from __future__ import annotations

import gc
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import pytest  # noqa: E402

pytest.importorskip("vllm")

import torch  # noqa: E402

from cacheblend import Engine  # noqa: E402
from cacheblend.datasets import QA_PREAMBLE, load_qa  # noqa: E402
from cacheblend.integrations.vllm import ChunkMatcher, read_passages, register_passages  # noqa: E402
from cacheblend.store import ChunkKV  # noqa: E402
from cacheblend.store.entry import read_entry  # noqa: E402

N_PROMPTS, N_PASSAGES, MAX_TOKENS = 5, 4, 8
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory, default_model_dir):
    """Prompts of musique dev examples, their chunks ingested into a disk store by the core
    engine of *this* process and their texts registered for the connector."""
    root = tmp_path_factory.mktemp("vllm_connector")
    examples = load_qa("musique", "dev", limit=N_PROMPTS, passages=N_PASSAGES)
    engine = Engine.load(default_model_dir, store=f"disk:{root / 'kv'}")
    prompts, handles = [], []
    for ex in examples:
        handles.append(engine.ingest(ex.passages))
        prompts.append(engine.prompts.build(ex.query, [list(h.token_ids) for h in handles[-1]], None,
                                            QA_PREAMBLE).all_ids)
    register_passages(root / "passages.jsonl", [p for ex in examples for p in ex.passages])
    # example 1's question over its first passage alone: one chunk to blend, for the tests that
    # only need a blendable prompt (a plain prefill of it takes a tenth of a 4-passage one's)
    short = engine.prompts.build(examples[1].query, [list(handles[1][0].token_ids)], None, QA_PREAMBLE).all_ids
    return {"root": root, "model": str(default_model_dir), "prompts": prompts, "encode": engine.prompts.encode,
            "examples": examples, "engine": engine, "handles": handles, "short": short}


def _llm(model: str, extra: dict | None, max_num_seqs: int = 1):
    """A fresh eager LLM, with the connector when ``extra`` (its extra config) is given."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {}
    if extra is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="CacheBlendConnector", kv_connector_module_path="cacheblend.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=extra)
        kw["load_format"] = "cacheblend"  # the worker recomputes on vLLM's own weights
    return LLM(model=model, dtype="float32", enforce_eager=True, enable_prefix_caching=False, max_model_len=8192,
               max_num_batched_tokens=8192, max_num_seqs=max_num_seqs, seed=0, **kw)


def _generate(llm, requests: list[tuple[list[int], int, float]]) -> list[tuple[list[int], int]]:
    """Greedy ``(tokens, num_cached_tokens)`` of ``(ids, max_tokens, recompute_ratio)``, one by one."""
    from vllm import SamplingParams, TokensPrompt

    outs = []
    for ids, max_tokens, ratio in requests:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                extra_args={"kv_transfer_params": {"recompute_ratio": ratio}})
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        outs.append((list(out.outputs[0].token_ids), out.num_cached_tokens))
    return outs


def _shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def plain(setup):
    """Plain vLLM: prompt 0 with 8 tokens, the others and the short prompt with 1."""
    prompts = setup["prompts"]
    llm = _llm(setup["model"], None)
    try:
        outs = _generate(llm, [(prompts[0], MAX_TOKENS, 1.0)] + [(p, 1, 1.0) for p in prompts[1:]]
                         + [(setup["short"], 1, 1.0)])
    finally:
        _shutdown(llm)
    return {"prompts": outs[:-1], "short": outs[-1]}


@pytest.fixture(scope="module")
def blend_llm(setup, plain, redis_server):
    """vLLM with the connector on the disk store (then a Redis tier), kept for the module;
    ``stats()`` reads what its worker did.  Up to four requests at once, but one blend per
    step (``max_blend_tokens``: any prompt is over one token): the tests send one at a time,
    except the burst test."""
    root = setup["root"]
    extra = {"store": f"disk:{root / 'kv'},{redis_server.url}", "passages": str(root / "passages.jsonl"),
             "recompute_ratio": 0.15, "stats": str(root / "stats.jsonl"), "max_blend_tokens": 1}
    llm = _llm(setup["model"], extra, max_num_seqs=4)
    llm.stats = lambda: [json.loads(x) for x in (root / "stats.jsonl").read_text().splitlines()]
    yield llm
    _shutdown(llm)


@pytest.fixture(scope="module")
def outputs(setup, plain, blend_llm):
    """Prompt 0 at ratio 1.0 (8 tokens), then every prompt at 0.15, through the connector;
    and the disk store's file count before and after."""
    prompts = setup["prompts"]
    kv_dir = setup["root"] / "kv"
    before = sorted(p.name for p in kv_dir.rglob("*") if p.is_file())
    blend = _generate(blend_llm, [(prompts[0], MAX_TOKENS, 1.0)] + [(p, 1, 0.15) for p in prompts])
    after = sorted(p.name for p in kv_dir.rglob("*") if p.is_file())
    return {"prompt0_tokens": len(prompts[0]), "plain": plain["prompts"], "exact": blend[0], "blend": blend[1:],
            "files": (before, after)}


def test_a_burst_of_blends_runs_one_step_each_with_the_same_answers(setup, outputs, blend_llm):
    """Three blended requests at once: each blend runs before a forward of its own (the step
    budget holds the others back), where all three used to run before one forward while any
    running decode waited; and each answers as it did alone."""
    from vllm import SamplingParams, TokensPrompt

    seen = len(blend_llm.stats())
    params = SamplingParams(max_tokens=1, temperature=0.0,
                            extra_args={"kv_transfer_params": {"recompute_ratio": 0.15}})
    outs = blend_llm.generate([TokensPrompt(prompt_token_ids=p) for p in setup["prompts"][1:4]], params,
                              use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [tokens for tokens, _ in outputs["blend"][1:4]]
    loads = [s for s in blend_llm.stats()[seen:] if s.get("op") == "load"]
    assert [s["step_blends"] for s in loads] == [1, 1, 1]


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


def test_worker_recomputes_on_vllms_own_layers(outputs, blend_llm):
    """Started with load_format="cacheblend", the worker's fused prefill runs its products
    through the layers vLLM loaded, not through a second copy of the weights."""
    loads = [s for s in blend_llm.stats() if s.get("op") == "load"]
    assert loads and all(s["products"] == "vLLM's own layers" for s in loads)


def test_ratio_zero_is_full_reuse(setup, outputs, blend_llm):
    """At ratio 0 the worker recomputes nothing: every chunk token is reused as stored, and
    vLLM's first token is the core engine's full-reuse first token on the same prompt."""
    engine, prompts = setup["engine"], setup["prompts"]
    got = _generate(blend_llm, [(p, 1, 0.0) for p in prompts])
    loads = [s for s in blend_llm.stats() if s.get("op") == "load"][-len(prompts):]
    assert [s["recomputed"] for s in loads] == [0] * len(prompts)
    for (tokens, _), ex, handles in zip(got, setup["examples"], setup["handles"], strict=True):
        reuse = engine.generate(ex.query, handles, max_new_tokens=1, recompute_ratio=0.0, preamble=QA_PREAMBLE)
        assert reuse.stats.recomputed_tokens == 0 and tokens[:1] == reuse.token_ids[:1]


def test_blend_first_token_agreement(outputs):
    """At 15 % recompute the first token mostly agrees with vLLM's full prefill."""
    firsts_plain = [toks[0] for toks, _ in outputs["plain"]]
    firsts_blend = [toks[0] for toks, _ in outputs["blend"]]
    assert all(cached > 0 for _, cached in outputs["blend"])
    agreement = sum(a == b for a, b in zip(firsts_plain, firsts_blend, strict=True)) / len(firsts_plain)
    print(f"first-token agreement at 0.15: {agreement:.2f} ({firsts_blend} vs {firsts_plain})")
    assert agreement >= 0.8


def test_chunks_from_another_process_are_reused(outputs):
    """The worker found every chunk this process ingested: the one entry it stored is the
    prompts' shared prefix (system prompt and template: exact K/V, position 0)."""
    before, after = outputs["files"]
    assert before and set(before) <= set(after) and len(set(after) - set(before)) == 1


def test_the_prompt_prefix_comes_from_the_prefix_cache(setup, outputs, blend_llm):
    """The tokens before the first passage are exact K/V from the prefix cache, as in the core
    engine, not computed on every request: the worker computes and recomputes what the core
    does on the same prompt."""
    loads = [s for s in blend_llm.stats() if s.get("op") == "load" and s["recompute_ratio"] == 0.15][:N_PROMPTS]
    assert len(loads) == N_PROMPTS
    for s, ex, handles in zip(loads, setup["examples"], setup["handles"], strict=True):
        core = setup["engine"].generate(ex.query, handles, max_new_tokens=1, preamble=QA_PREAMBLE)
        assert core.stats.exact_cached_tokens > 0
        assert (s["computed"], s["recomputed"]) == (core.stats.computed_tokens, core.stats.recomputed_tokens)


# ---------------------------------------------------------------- the store's failure cases, through vLLM

def _core_first_token(setup, handles, ex) -> int:
    """The core engine's blended first token for ``handles`` in this order (same store)."""
    return setup["engine"].generate(ex.query, handles, preamble=QA_PREAMBLE, max_new_tokens=1,
                                    recompute_ratio=0.15).token_ids[0]


def _damage(path, how: str, engine, key) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flipped":
        mid = len(data) // 2
        path.write_bytes(data[:mid] + bytes(b ^ 0xFF for b in data[mid : mid + 64]) + data[mid + 64 :])
    else:  # an entry of another model under this key: same shape, other fingerprint
        entry = read_entry(engine.store.open(key))
        engine.store.delete(key)
        engine.store.put(key, ChunkKV(entry.k, entry.v, {**entry.meta, "model": "f" * 64}))


@pytest.mark.parametrize("how", ["truncated", "flipped", "foreign"])
def test_bad_entries_are_recomputed_and_replaced_never_served(setup, outputs, blend_llm, redis_server, how):
    """A damaged chunk entry is detected by the worker, recomputed, replaced, and the answer
    is the one the intact cache gave."""
    import redis

    redis.Redis.from_url(redis_server.url).flushdb()  # so the Redis tier cannot serve the intact copy
    i = {"truncated": 1, "flipped": 2, "foreign": 3}[how]
    engine, handle = setup["engine"], setup["handles"][i][1]
    path = engine.store.path(handle.key)
    intact = read_entry(engine.store.open(handle.key))
    _damage(path, how, engine, handle.key)
    (tokens, cached), = _generate(blend_llm, [(setup["prompts"][i], 1, 0.15)])
    load = blend_llm.stats()[-1]
    assert load["store_rejected"] == 1 and load["store_misses"] == 1
    assert tokens == outputs["blend"][i][0] and cached == len(setup["prompts"][i]) - 1
    replaced = read_entry(engine.store.open(handle.key))
    # The worker recomputes the chunk with its own engine: the same float32 products, but
    # the kernels' summation order may differ from this process's (oneDNN's blocking, thread
    # split), so the K/V agree to rounding over 30 layers (1e-4 seen), not bit for bit.
    assert replaced.meta["model"] == engine.fingerprint
    assert torch.allclose(replaced.k, intact.k, rtol=1e-3, atol=1e-3)
    assert torch.allclose(replaced.v, intact.v, rtol=1e-3, atol=1e-3)


def test_lmcache_blend_bug_cases(setup, outputs, blend_llm):
    """The same prompt twice (LMCache #854), reordered chunks with a 100 % hit (#938), and a
    chunk not cached in the middle (#3238) all give the answer the core engine gives."""
    ex, handles, prompts = setup["examples"][0], setup["handles"][0], setup["prompts"][0]
    twice = _generate(blend_llm, [(prompts, MAX_TOKENS, 0.15)] * 2)
    assert twice[0] == twice[1]

    reordered = handles[::-1]
    ids = setup["engine"].prompts.build(ex.query, [list(h.token_ids) for h in reordered], None, QA_PREAMBLE).all_ids
    (tokens, _), = _generate(blend_llm, [(ids, 1, 0.15)])
    load = blend_llm.stats()[-1]
    assert load["store_hits"] == N_PASSAGES and load["store_misses"] == 0 and load["prefix_cached"]
    assert 0 < load["compute_s"] <= load["blend_s"] and 0 <= load["load_exposed_s"] <= load["blend_s"]
    assert tokens[0] == _core_first_token(setup, reordered, ex)

    new = "A passage no one cached: the Quux festival is held every spring in the town of Corge."
    middle = handles[:2] + [setup["engine"].handle(new)] + handles[2:]
    register_passages(setup["root"] / "passages.jsonl", [new])
    ids = setup["engine"].prompts.build(ex.query, [list(h.token_ids) for h in middle], None, QA_PREAMBLE).all_ids
    (tokens, _), = _generate(blend_llm, [(ids, 1, 0.15)])
    load = blend_llm.stats()[-1]
    assert load["chunks"] == N_PASSAGES + 1 and load["store_misses"] == 1  # computed and stored by the worker
    assert tokens[0] == _core_first_token(setup, middle, ex)


def test_redis_down_and_back(setup, outputs, blend_llm, redis_server):
    """With the Redis tier unreachable, requests still succeed from the disk tier, a chunk
    not cached anywhere is computed and kept on disk, and the worker says Redis failed;
    once Redis is back (after the tier's 5 s rest), new chunks reach it again."""
    import time

    import redis

    def with_new_chunk(i: int, text: str) -> list[int]:
        register_passages(setup["root"] / "passages.jsonl", [text])
        ex, engine = setup["examples"][i], setup["engine"]
        handles = setup["handles"][i] + [engine.handle(text)]
        return engine.prompts.build(ex.query, [list(h.token_ids) for h in handles], None, QA_PREAMBLE).all_ids

    prompt = setup["prompts"][4]
    redis_server.stop()
    try:
        (tokens, cached), = _generate(blend_llm, [(prompt, 1, 0.15)])
        assert tokens == outputs["blend"][4][0] and cached == len(prompt) - 1
        ids = with_new_chunk(4, "A passage never cached before: the Grault bridge was rebuilt in 1931 after a flood.")
        (tokens, cached), = _generate(blend_llm, [(ids, 1, 0.15)])
        load = blend_llm.stats()[-1]
        assert cached == len(ids) - 1 and load["store_misses"] == 1 and load["store_unreachable"] >= 1
    finally:
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    assert client.dbsize() == 0
    time.sleep(6)
    ids = with_new_chunk(3, "One more passage never cached: the Garply tower stood on the hill until 1902.")
    _generate(blend_llm, [(ids, 1, 0.15)])
    load = blend_llm.stats()[-1]
    assert load["store_misses"] == 1 and load["store_unreachable"] == 0 and client.dbsize() >= 1


def test_malformed_hints_run_as_plain_vllm(setup, plain, blend_llm):
    """The offline path has no HTTP guard, and the scheduler side must never raise over a
    client's hints (it would kill EngineCore): a request with a bad hint runs as plain vLLM
    (no chunk blended, plain vLLM's token). A check layer past the model's last is refused
    there too, not left to fail the load (vLLM's default policy would fail the request)."""
    from vllm import SamplingParams, TokensPrompt

    ids = setup["short"]

    def ask(params: dict):
        sp = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": params})
        (out,) = blend_llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
        return out

    assert ask({"recompute_ratio": 0.15}).kv_transfer_params["cacheblend"]["chunks"] == 1  # well-formed: blended
    bad = [{"chunks": [[0, float("inf")]]}, {"chunks": [[1, len(ids)]]}, {"check_layers": [99]},
           {"deviation": "q"}, {"cacheblend": "release", "ids": ["x"]}, {"recompute_ratio": 0.15, "ratio": 0.2}]
    for params in bad:
        out = ask(params)
        assert out.kv_transfer_params["cacheblend"]["chunks"] == 0, params
        assert out.outputs[0].token_ids[0] == plain["short"][0][0] and out.num_cached_tokens == 0, params


def test_fidelity_receipt_and_guard_in_the_marker(setup, plain, blend_llm):
    """Every blended answer says how it was made (the worker's receipt reaches the response
    marker, also for a one-token answer, with the exposure under an exposure limit); the
    guard at risk limit 0 escalates to exact prefill and gives plain vLLM's token."""
    from vllm import SamplingParams, TokensPrompt

    ids = setup["short"]

    def ask(params: dict, max_tokens: int = 1) -> tuple[int, dict]:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args={"kv_transfer_params": params})
        (out,) = blend_llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
        return out.outputs[0].token_ids[0], out.kv_transfer_params["cacheblend"]["fidelity"]

    for max_tokens in (1, 3):
        _, receipt = ask({"recompute_ratio": 0.15}, max_tokens)
        assert receipt is not None, f"no receipt with max_tokens={max_tokens}"
        assert receipt["exact"] is False and abs(receipt["ratio_used"] - 0.15) < 0.01
        assert 0 < receipt["risk"] <= 1 and not receipt["escalated"] and receipt["approximate_tokens"] > 0
    assert receipt["exposure"] is None  # measured only under an exposure limit
    _, receipt = ask({"recompute_ratio": 0.15, "max_exposure": 1.0})  # measured, never escalating
    assert 0 < receipt["exposure"] < 1 and not receipt["escalated"] and not receipt["exact"]
    token, receipt = ask({"recompute_ratio": "guard", "max_risk": 0.0})
    assert receipt["escalated"] and receipt["exact"] and receipt["ratio_used"] == 1.0
    assert receipt["exposure"] == 0.0 and token == plain["short"][0][0]


def test_an_entry_without_a_hint_gets_one_from_the_worker(setup, outputs, blend_llm, redis_server):
    """An entry stored before deviation hints: the worker serves it with the full check and
    adds its hint in the background (K/V untouched); the next request checks the pool."""
    import time

    import redis

    from cacheblend.blend.hint import HINT_FIELD, decode_hint

    redis.Redis.from_url(redis_server.url).flushdb()  # so the Redis tier cannot serve a copy with a hint
    engine, handles, prompt = setup["engine"], setup["handles"][2], setup["prompts"][2]
    handle = handles[0]
    entry = read_entry(engine.store.open(handle.key))
    engine.store.put(handle.key, ChunkKV(entry.k, entry.v, {k: v for k, v in entry.meta.items() if k != HINT_FIELD}))
    chunk_tokens = sum(h.num_tokens for h in handles)

    _generate(blend_llm, [(prompt, 1, 0.15)])
    load = blend_llm.stats()[-1]
    assert load["checked"] - load["computed"] == chunk_tokens  # no hint: every chunk token is checked
    deadline = time.monotonic() + 120
    while HINT_FIELD not in engine.store.open(handle.key).meta:
        assert time.monotonic() < deadline, "the worker did not add the hint"
        time.sleep(0.5)
    hinted = read_entry(engine.store.open(handle.key))
    assert torch.equal(hinted.k, entry.k) and torch.equal(hinted.v, entry.v)
    # the worker's products round differently from this process's (see above): close, not equal
    torch.testing.assert_close(decode_hint(hinted.meta, handle.num_tokens), decode_hint(entry.meta, handle.num_tokens),
                               rtol=2e-2, atol=1e-3)
    (tokens, _), = _generate(blend_llm, [(prompt, 1, 0.15)])
    load = blend_llm.stats()[-1]
    assert 0 < load["checked"] - load["computed"] < chunk_tokens  # the check pool
    assert tokens == outputs["blend"][2][0]
