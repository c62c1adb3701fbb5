"""The deviation hint and the check pool (cacheblend/blend/hint.py, cacheblend/cache/hint.py):
what ingestion stores, which tokens run up to the check layer, and that the check then
ranks them as the full check does."""

from __future__ import annotations

import pytest
import torch

from cacheblend import Engine
from cacheblend.blend.fusor import KVCache, Segment, fused_prefill
from cacheblend.blend.hint import HINT_FIELD, check_pool, decode_hint, encode_hint
from cacheblend.cache.hint import FILLER, HINT_LAYER, layer_values
from cacheblend.config import BlendConfig, RequestOptions
from cacheblend.errors import CacheBlendError
from cacheblend.store import ChunkKV
from cacheblend.store.disk import DiskStore
from conftest import PASSAGES, QUERY, make_tiny_model

CPU = torch.device("cpu")


def test_hint_text_round_trips_and_bad_text_is_no_hint():
    score = torch.tensor([0.0, 1.5, 300.0, 7e4])
    back = decode_hint({HINT_FIELD: encode_hint(score)}, 4)
    assert back.tolist() == [0.0, 1.5, 300.0, 6e4]  # float16, clamped below its range
    assert decode_hint({HINT_FIELD: encode_hint(score)}, 2).tolist() == [0.0, 1.5]  # a prefix view's tokens
    for meta in ({}, {HINT_FIELD: "not base64!"}, {HINT_FIELD: encode_hint(score)[:-4]},
                 {HINT_FIELD: encode_hint(torch.tensor([1.0, float("nan")]))}, {HINT_FIELD: 3}):
        assert decode_hint(meta, 4) is None


def test_pool_takes_the_top_share_over_all_chunks_or_nothing_without_a_hint():
    a = {HINT_FIELD: encode_hint(torch.tensor([5.0, 1.0, 9.0, 2.0]))}
    b = {HINT_FIELD: encode_hint(torch.tensor([0.5, 3.0]))}
    got = check_pool([(1, 5, a), (5, 7, b)], 0.5, 8, CPU)
    assert torch.nonzero(got).squeeze(1).tolist() == [1, 3, 6]  # 3 of 6 tokens: 9, 5 and 3
    short = {HINT_FIELD: encode_hint(torch.tensor([10.0, 11.0]))}  # a short chunk that deviates all over
    got = check_pool([(1, 5, a), (5, 7, short)], 0.5, 8, CPU)
    assert torch.nonzero(got).squeeze(1).tolist() == [3, 5, 6]
    assert check_pool([(1, 5, a), (5, 7, {})], 0.5, 8, CPU) is None


def test_bad_pool_shares_are_refused():
    for bad in (-0.1, 1.5, True, "0.4"):
        with pytest.raises(ValueError, match="check_pool"):
            BlendConfig(check_pool=bad)
        with pytest.raises(CacheBlendError, match="check_pool"):
            RequestOptions.parse({"check_pool": bad})


def test_ingestion_stores_the_value_distance_behind_the_filler(default_engine, tmp_path):
    """The stored hint is, per token, the squared distance of its hint-layer values behind
    sink + filler from its cached values, rebuilt here from two plain prefills; it survives
    the disk store."""
    chunks = default_engine.chunks
    handle = default_engine.ingest([PASSAGES[0]])[0]
    entry = default_engine.store.get(handle.key)
    ids = list(handle.token_ids)
    filler = default_engine.prompts.chunk_ids(FILLER)
    behind = layer_values(default_engine.decoder, [*chunks.sink, *filler, *ids], HINT_LAYER, CPU)
    alone = layer_values(default_engine.decoder, [*chunks.sink, *ids], HINT_LAYER, CPU)
    want = (behind[:, -len(ids):] - alone[:, len(chunks.sink):]).pow(2).sum(dim=(0, 2))
    got = decode_hint(entry.meta, len(ids))
    torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-3)
    assert int((got > 0).sum()) > len(ids) // 2  # the filler moves most tokens' values

    disk = DiskStore(tmp_path)
    assert disk.put(handle.key, entry)
    assert torch.equal(decode_hint(disk.get(handle.key).meta, len(ids)), got)


def _segments(engine, handles, meta_of=None):
    prompt = engine.prompts.build(QUERY, [list(h.token_ids) for h in handles], None)
    segs = [Segment(prompt.prefix)]
    for i, h in enumerate(handles):
        c = engine.store.get(h.key)
        if meta_of is not None:
            c = ChunkKV(c.k, c.v, meta_of(c.meta, i))
        segs.append(Segment(h.token_ids, c))
    return prompt, segs + [Segment(prompt.suffix)]


def _fuse(engine, segs, n, **blend):
    with torch.inference_mode():
        return fused_prefill(engine.decoder, segs, KVCache(engine.decoder.shape, n, "cpu"), BlendConfig(**blend))


def test_only_the_pool_runs_up_to_the_check_layer(default_engine):
    handles = default_engine.ingest(PASSAGES)
    prompt, segs = _segments(default_engine, handles)
    n, chunk_tokens = len(prompt.all_ids), sum(h.num_tokens for h in handles)
    uncached = n - chunk_tokens  # the frame and the question
    full = _fuse(default_engine, segs, n, recompute_ratio=0.15, check_pool=1.0)
    pooled = _fuse(default_engine, segs, n, recompute_ratio=0.15, check_pool=0.4)
    assert full.active_per_layer[0] == n
    pool = round(0.4 * chunk_tokens)
    # the pool, the question and the frame, plus shift-sample tokens outside the pool
    assert uncached + pool <= pooled.active_per_layer[0] < n
    assert pooled.active_per_layer[2:] == full.active_per_layer[2:]  # the same budget after the check
    assert pooled.recomputed_tokens == full.recomputed_tokens


def test_the_check_ranks_the_pool_by_its_real_deviation(default_engine):
    """With a pool that holds the full check's choice, the check picks the same tokens: the
    pool's layer-0 outputs are exact (layer-0 keys and values depend on the token alone)."""
    handles = default_engine.ingest(PASSAGES)
    prompt, segs = _segments(default_engine, handles)
    n, start = len(prompt.all_ids), len(prompt.prefix)
    full = _fuse(default_engine, segs, n, recompute_ratio=0.15, check_pool=1.0)
    chosen = set(full.hkvd_positions.tolist())
    offsets = [start + sum(h.num_tokens for h in handles[:i]) for i in range(len(handles))]

    def meta_of(meta, index):  # the full check's choice first, then the rest by position
        first = offsets[index]
        score = torch.tensor([2.0 + 1.0 / (i + 1) if first + i in chosen else 1.0 / (i + 1)
                              for i in range(handles[index].num_tokens)])
        return meta | {HINT_FIELD: encode_hint(score)}

    _, hinted = _segments(default_engine, handles, meta_of)
    pooled = _fuse(default_engine, hinted, n, recompute_ratio=0.15, check_pool=0.5)
    assert pooled.active_per_layer[0] < n
    assert pooled.hkvd_positions.tolist() == full.hkvd_positions.tolist()


def test_chunks_without_a_hint_get_the_full_check(default_engine):
    handles = default_engine.ingest(PASSAGES)
    prompt, segs = _segments(default_engine, handles, lambda meta, _: {k: v for k, v in meta.items()
                                                                        if k != HINT_FIELD})
    n = len(prompt.all_ids)
    report = _fuse(default_engine, segs, n, recompute_ratio=0.15, check_pool=0.4)
    assert report.active_per_layer[0] == n
    assert report.hkvd_positions.tolist() == _fuse(default_engine, segs, n, recompute_ratio=0.15,
                                                   check_pool=1.0).hkvd_positions.tolist()


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_identities_hold_with_a_pool(default_engine, ratio):
    handles = default_engine.ingest(PASSAGES)
    method = "reuse" if ratio == 0.0 else "full"
    ref = default_engine.generate(QUERY, handles, method=method, max_new_tokens=8)
    got = default_engine.generate(QUERY, handles, method="blend", recompute_ratio=ratio, check_pool=0.4,
                                  max_new_tokens=8)
    torch.testing.assert_close(got.first_token_logits, ref.first_token_logits, atol=1e-3, rtol=1e-3)
    assert got.token_ids == ref.token_ids


def _strip_hints(engine, handles):
    """Rewrite each chunk's entry as a version before hints stored it; returns the entries."""
    before = {}
    for h in handles:
        kv = engine.store.get(h.key)
        before[h.key] = kv
        assert engine.store.put(h.key, ChunkKV(kv.k, kv.v, {k: v for k, v in kv.meta.items() if k != HINT_FIELD}))
        assert HINT_FIELD not in engine.store.get(h.key).meta
    return before


def test_an_entry_stored_without_a_hint_gets_it_on_first_use(default_model_dir, tmp_path):
    """A store filled by a version before hints: the first prompt over its entries runs the
    full check on them as they are and adds each entry's hint in the background, its K/V
    untouched; the next prompt checks the pool.  ``ingest`` adds a missing hint at once."""
    model = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    engine = Engine.load(model, store=f"memory,disk:{tmp_path / 'kv'}")
    handles = engine.ingest(PASSAGES)
    before = _strip_hints(engine, handles)
    engine.store.flush()
    memory, disk = engine.store.tiers
    memory.clear()  # read from disk: the tiered store promotes what it read into memory

    first = engine.generate(QUERY, handles, method="blend", max_new_tokens=1)
    s = first.stats
    assert s.checked_tokens == s.approximate_tokens + s.recomputed_tokens  # no hint: the full check
    engine.chunks.wait_learning()
    engine.store.flush()
    for h in handles:
        for tier in (memory, disk):  # the promoted copy did not overwrite the one with the hint
            after = tier.get(h.key)
            assert torch.equal(after.k, before[h.key].k) and torch.equal(after.v, before[h.key].v)
            assert torch.equal(decode_hint(after.meta, h.num_tokens), decode_hint(before[h.key].meta, h.num_tokens))
    second = engine.generate(QUERY, handles, method="blend", max_new_tokens=1)
    s = second.stats
    assert 0 < s.checked_tokens < s.approximate_tokens + s.recomputed_tokens  # the check pool

    _strip_hints(engine, handles[:1])
    engine.ingest(PASSAGES[:1])  # no waiting: ingest returns with the hint stored
    assert torch.equal(decode_hint(engine.store.get(handles[0].key).meta, handles[0].num_tokens),
                       decode_hint(before[handles[0].key].meta, handles[0].num_tokens))


def test_a_chunk_released_while_its_hint_is_computed_stays_released(default_model_dir, tmp_path):
    """The hint backfill reads an entry, computes its hint and writes it back; a release
    that landed in between was undone by the write."""
    import time

    model = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    engine = Engine.load(model, store="memory")
    handles = engine.ingest(PASSAGES)
    _strip_hints(engine, handles)
    slow = engine.chunks.hinted_meta

    def hinted_meta_slowly(ids, values):
        time.sleep(0.5)  # the release lands here
        return slow(ids, values)

    engine.chunks.hinted_meta = hinted_meta_slowly
    engine.generate(QUERY, handles, method="blend", max_new_tokens=1)  # queues the backfills
    assert engine.release(handles) == len(handles)
    engine.chunks.wait_learning()
    assert all(engine.store.get(h.key) is None for h in handles)


def test_a_chunk_released_while_it_is_learned_in_the_background_stays_released(default_model_dir, tmp_path):
    """A passage first seen in a prompt is stored by a background job; a release that came
    before the job stored it (the document was deleted meanwhile) was undone by the job."""
    import time

    model = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    engine = Engine.load(model, store="memory")
    engine.learn_min_chars = 60
    slow = engine.chunks.precompute

    def precompute_slowly(ids):
        time.sleep(0.5)  # the release lands here
        return slow(ids)

    engine.chunks.precompute = precompute_slowly
    messages = [{"role": "user", "content": f"{PASSAGES[0]}\n\nQuestion: {QUERY}"}]
    gen = engine.start_chat(messages, max_new_tokens=1)
    "".join(gen.pieces)
    assert gen.result.stats.chunks_learned == 1
    assert engine.release(PASSAGES[0]) == 1  # the job's entry, once it has landed
    engine.chunks.wait_learning()
    assert engine.store.get(engine.handle(PASSAGES[0]).key) is None


def test_a_handle_without_the_trailing_separator_releases_the_entry_that_serves_it(default_model_dir, tmp_path):
    """A chunk's entry is stored under the key of its ids plus the chunk separator; a handle
    of the ids alone (token spans, the vLLM worker's releases) deleted a key nothing used."""
    model = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    engine = Engine.load(model, store="memory")
    (stored,) = engine.ingest([PASSAGES[1]])
    sep = len(engine.chunks.separator)
    bare = engine.chunks.handle(list(stored.token_ids)[:-sep]) if sep else stored
    assert engine.chunks.release(bare) and engine.store.get(stored.key) is None


def test_an_entry_the_store_did_not_take_is_tried_again_after_the_retry_interval():
    """A hint the store refused (read-only) is not retried on every prompt, but is tried
    again once the retry interval has passed, so a store that becomes writable gets it."""
    from concurrent.futures import ThreadPoolExecutor

    from cacheblend.cache.background import KeyedJobs

    now = [0.0]
    runs: list[str] = []
    writable = [False]

    def job() -> bool:
        runs.append("try")
        return writable[0]

    with ThreadPoolExecutor(max_workers=1) as pool:
        jobs = KeyedJobs(pool, "hint backfill", retry_after=600.0, clock=lambda: now[0])
        for _ in range(3):  # three prompts within the interval: one attempt
            jobs.submit("k", job)
            jobs.wait()
        assert runs == ["try"]
        now[0] = 599.0
        jobs.submit("k", job)
        jobs.wait()
        assert runs == ["try"]
        writable[0], now[0] = True, 601.0
        jobs.submit("k", job)
        jobs.wait()
        assert runs == ["try", "try"]
        now[0] = 10_000.0  # it succeeded: nothing is remembered against the key
        jobs.submit("k", job)
        jobs.wait()
        assert runs == ["try", "try", "try"]


def test_background_work_on_a_step_executor_runs_only_between_forwards():
    """vLLM's worker multiplies with vLLM's own layers, which must not run on two threads
    at once: its hint backfills used to run on a background thread during vLLM's forward
    (once a stored hint decoded to nothing). On a StepExecutor they run only when the
    worker drains it after the forward, or when a caller on its thread waits for them."""
    import threading

    from cacheblend.cache.background import KeyedJobs, StepExecutor

    step = StepExecutor()
    jobs = KeyedJobs(step, "hint backfill")
    threads: list[threading.Thread] = []

    def job() -> bool:
        threads.append(threading.current_thread())
        return True

    def broken() -> bool:
        raise RuntimeError("a failing backfill is logged, never raised into the step")

    jobs.submit("a", job)
    jobs.submit("b", broken)
    jobs.submit("a", job)  # one pending per key
    assert threads == []
    assert step.run_pending() == 2 and threads == [threading.current_thread()]
    assert step.run_pending() == 0
    jobs.submit("c", job)
    jobs.wait("c")  # a wait on the worker's thread (a release) runs it rather than deadlocking
    assert threads == [threading.current_thread()] * 2
