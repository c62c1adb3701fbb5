"""Bad input raises a clear error that names the problem."""

from __future__ import annotations

import pytest

from cacheblend import CacheBlendError, ChunkHandle, UnknownChunkError
from conftest import PASSAGES, QUERY


@pytest.fixture(scope="module")
def engine(tmp_path_factory, default_model_dir):
    from cacheblend import Engine
    from conftest import make_tiny_model

    return Engine.load(make_tiny_model(tmp_path_factory.mktemp("errs"), "llama", default_model_dir), store="memory")


@pytest.mark.parametrize("query", ["", "   ", None])
def test_no_query(engine, query):
    with pytest.raises(CacheBlendError, match="query"):
        engine.generate(query, PASSAGES[:1])


def test_empty_chunk_text(engine):
    with pytest.raises(ValueError, match="chunk must be a non-empty string"):
        engine.ingest([""])
    with pytest.raises(CacheBlendError, match="chunk must be a non-empty string"):
        engine.generate(QUERY, ["  "])


def test_prompt_longer_than_context(engine):
    long = "word " * (engine.context_length + 10)
    with pytest.raises(CacheBlendError, match="context"):
        engine.generate(QUERY, [long], method="full")


def test_unknown_handle(engine):
    with pytest.raises(UnknownChunkError, match="unknown chunk handle"):
        engine.generate(QUERY, [ChunkHandle(key="0" * 64, num_tokens=3)])


def test_handle_from_another_model(engine):
    h = engine.ingest(PASSAGES[:1])[0]
    foreign = ChunkHandle(h.key, h.num_tokens, h.token_ids, model_fingerprint="someone-else")
    with pytest.raises(UnknownChunkError, match="another model"):
        engine.generate(QUERY, [foreign])


@pytest.mark.parametrize("ratio", [-0.1, 1.01, 2])
def test_ratio_out_of_range(engine, ratio):
    with pytest.raises(CacheBlendError, match=r"recompute_ratio must be within \[0, 1\]"):
        engine.generate(QUERY, PASSAGES[:1], recompute_ratio=ratio)


def test_bad_method_and_options(engine):
    with pytest.raises(CacheBlendError, match="method"):
        engine.generate(QUERY, method="magic")
    with pytest.raises(CacheBlendError, match="check_layers"):
        engine.generate(QUERY, PASSAGES[:1], check_layers=(99,))
    with pytest.raises(CacheBlendError, match="deviation"):
        engine.generate(QUERY, PASSAGES[:1], deviation="q")
    with pytest.raises(CacheBlendError, match="max_new_tokens"):
        engine.generate(QUERY, max_new_tokens=0)
    with pytest.raises(CacheBlendError, match="top_p"):
        engine.generate(QUERY, temperature=1.0, top_p=0.0)


@pytest.mark.parametrize("options, name", [
    (dict(temperature="0.5"), "temperature"), (dict(temperature=True), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(top_p="1"), "top_p"),
    (dict(seed=2**64), "seed"),  # torch.Generator raised "Overflow when unpacking long long" after the prefill
    (dict(method="full", recompute_ratio=float("nan")), "recompute_ratio"),
    (dict(method="reuse", recompute_ratio=7), "recompute_ratio"), (dict(method="full", max_risk=9.0), "max_risk"),
])
def test_bad_values_are_refused_by_name_before_any_work(options, name):
    """Strings and bools were turned into floats, inf sampled noise, and the selection
    fields went unchecked beside method="full" or "reuse"."""
    from cacheblend.config import RequestOptions

    with pytest.raises(CacheBlendError, match=name):
        RequestOptions.parse(options)


def test_stream_validates_before_first_piece(engine):
    with pytest.raises(CacheBlendError):
        engine.stream("", PASSAGES[:1])


def test_evicted_chunk_is_recomputed_not_failed(engine):
    h = engine.ingest(PASSAGES[:1])[0]
    engine.store.delete(h.key)
    r = engine.generate(QUERY, [h], max_new_tokens=2)
    assert r.stats.store_misses >= 1
    assert engine.store.get(h.key) is not None


def test_timeout_interrupts_the_fused_prefill_between_layers(engine, monkeypatch):
    import re
    import time

    handles = engine.ingest(PASSAGES[:2])
    before = engine.generate(QUERY, handles, max_new_tokens=4)
    finish = engine.decoder.finish
    monkeypatch.setattr(engine.decoder, "finish", lambda *a: (time.sleep(0.05), finish(*a))[1])  # a slow model
    with pytest.raises(TimeoutError, match=r"fused prefill, before layer \d+") as caught:
        engine.generate(QUERY, handles, max_new_tokens=4, timeout=0.12)
    assert int(re.search(r"layer (\d+)", str(caught.value)).group(1)) > 0  # stopped mid-prefill, not before it
    monkeypatch.setattr(engine.decoder, "finish", finish)
    after = engine.generate(QUERY, handles, max_new_tokens=4)  # the engine and store are as they were
    assert after.token_ids == before.token_ids and after.stats.store_hits == before.stats.store_hits
    with pytest.raises(CacheBlendError, match="timeout"):
        engine.generate(QUERY, timeout=-1)


def test_a_request_queued_behind_other_prefills_times_out_in_the_queue(engine):
    """Prefills run one at a time; a request waiting its turn waited out every prefill ahead
    of it, however short its timeout (it raised only at its own first layer)."""
    import threading
    import time

    handles = engine.ingest(PASSAGES[:2])
    with engine.chunks.lock:  # another request's prefill, holding the turn
        outcome: list[BaseException | None] = []

        def ask():
            try:
                engine.generate(QUERY, handles, max_new_tokens=2, timeout=0.5)
                outcome.append(None)
            except BaseException as e:  # noqa: BLE001 - checked below
                outcome.append(e)

        t0 = time.monotonic()
        waiting = threading.Thread(target=ask)
        waiting.start()
        waiting.join(timeout=30)
        waited = time.monotonic() - t0
    assert isinstance(outcome[0], TimeoutError) and "wait for other requests' prefills" in str(outcome[0])
    assert waited < 5


def test_lone_surrogate_is_a_clear_error(engine):
    """A lone surrogate (e.g. from a badly decoded file) is named, not a tokenizers TypeError."""
    for call in (lambda: engine.ingest(["bad \ud800 text"]),
                 lambda: engine.generate("Why \udc00?", PASSAGES, max_new_tokens=1),
                 lambda: engine.generate(QUERY, ["chunk \ud800"], max_new_tokens=1)):
        with pytest.raises(CacheBlendError, match="not valid Unicode"):
            call()


def test_cancelled_async_stream_raises_cancelled_error():
    """Cancelling a consumer mid-step waits for the step, closes the generator and raises
    CancelledError (it raised 'generator already executing')."""
    import asyncio
    import time

    from cacheblend.aio import iterate_in_thread

    closed = []

    def slow():
        try:
            for i in range(100):
                time.sleep(0.05)
                yield i
        finally:
            closed.append(True)

    async def consume():
        async for _ in iterate_in_thread(slow):
            pass

    async def main():
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.12)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert closed == [True]
