"""Decoding from the fused cache: streaming, stop strings, EOS, sampling, chat template."""

from __future__ import annotations

import pytest
import torch

from cacheblend.generate.sampling import TextStream
from conftest import PASSAGES, QUERY

pytestmark = pytest.mark.slow


def test_stream_pieces_concatenate_to_generate_text(default_engine):
    handles = default_engine.ingest(PASSAGES)
    pieces = list(default_engine.stream(QUERY, handles, max_new_tokens=24))
    result = default_engine.generate(QUERY, handles, max_new_tokens=24)
    assert len(pieces) > 1
    assert "".join(pieces) == result.text


def test_stop_string_truncates(default_engine):
    handles = default_engine.ingest(PASSAGES)
    free = default_engine.generate(QUERY, handles, max_new_tokens=24)
    words = free.text.split()
    assert len(words) >= 3, free.text
    stop = words[2]
    stopped = default_engine.generate(QUERY, handles, max_new_tokens=24, stop=[stop])
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text
    assert free.text.startswith(stopped.text)
    streamed = "".join(default_engine.stream(QUERY, handles, max_new_tokens=24, stop=[stop]))
    assert streamed == stopped.text


def test_eos_ends_generation(default_engine):
    r = default_engine.generate("Say hello.", max_new_tokens=64)
    assert r.finish_reason == "stop"
    assert r.token_ids and all(t not in default_engine.eos_ids for t in r.token_ids)


def test_ignore_eos_decodes_past_the_end_to_max_new_tokens(default_engine):
    """Fixed-length answers (the bench's end-to-end timing): the greedy answer is the same
    up to where EOS came, then decoding goes on to exactly max_new_tokens."""
    natural = default_engine.generate("Say hello.", max_new_tokens=64)
    assert natural.finish_reason == "stop" and len(natural.token_ids) < 40
    fixed = default_engine.generate("Say hello.", max_new_tokens=40, ignore_eos=True)
    assert len(fixed.token_ids) == 40 and fixed.finish_reason == "length"
    assert fixed.token_ids[: len(natural.token_ids)] == natural.token_ids
    assert fixed.token_ids[len(natural.token_ids)] in default_engine.eos_ids
    with pytest.raises(Exception, match="ignore_eos must be True or False"):
        default_engine.generate("Say hello.", ignore_eos="yes")


def test_sampling_is_seeded_and_differs_from_greedy(default_engine):
    handles = default_engine.ingest(PASSAGES)
    a = default_engine.generate(QUERY, handles, temperature=1.2, top_p=0.95, seed=7, max_new_tokens=16)
    b = default_engine.generate(QUERY, handles, temperature=1.2, top_p=0.95, seed=7, max_new_tokens=16)
    assert a.token_ids == b.token_ids
    outs = {tuple(default_engine.generate(QUERY, handles, temperature=1.5, seed=s, max_new_tokens=16).token_ids)
            for s in range(4)}
    assert len(outs) > 1


def test_chat_template_frames_the_prompt(default_engine):
    prompt = default_engine.prompts.build(QUERY, [], "You are terse.")
    text = default_engine.tokenizer.decode(prompt.all_ids)
    expected = default_engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": QUERY}],
        tokenize=False, add_generation_prompt=True)
    assert text == expected


def test_text_stream_holds_back_partial_stop(default_engine):
    tok = default_engine.tokenizer
    ids = tok("Hello world. END here", add_special_tokens=False)["input_ids"]
    s = TextStream(tok, stop=["END"])
    out = "".join(s.push(i) for i in ids) + s.flush()
    assert out == "Hello world. " and s.stopped


def test_pieces_can_be_pulled_from_different_threads(default_engine):
    """Async adapters pull each piece on a worker thread; inference mode is per thread, so
    the engine must not rely on a mode entered by the thread that started the generation."""
    from concurrent.futures import ThreadPoolExecutor

    expected = default_engine.generate(QUERY, PASSAGES[:1], max_new_tokens=6).text
    gen = default_engine.start(QUERY, PASSAGES[:1], max_new_tokens=6)
    pieces = []
    for _ in range(64):
        with ThreadPoolExecutor(max_workers=1) as fresh:  # a new thread for every piece
            piece = fresh.submit(next, gen.pieces, None).result()
        if piece is None:
            break
        pieces.append(piece)
    assert "".join(pieces) == expected == gen.result.text


def test_a_character_cut_off_by_the_token_limit_is_in_neither_the_stream_nor_the_text(default_engine):
    """SmolLM2 spells an emoji in three tokens: an answer that stopped after the first of
    them streamed "I like " but its text ended in U+FFFD."""
    tok = default_engine.tokenizer
    ids = tok("I like \U0001F389 parties", add_special_tokens=False)["input_ids"]
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    s = TextStream(tok)
    streamed = "".join(s.push(i) for i in ids[:cut]) + s.flush()
    assert streamed == s.text and "\ufffd" not in s.text


def test_a_tiny_temperature_samples_the_top_token(default_engine):
    """temperature=1e-40 overflowed the scaled logits to inf and the softmax to NaN, and
    torch.multinomial raised after the prefill."""
    from cacheblend.config import SamplingConfig
    from cacheblend.generate.sampling import Sampler

    logits = torch.tensor([1.0, 3.0, 2.0])
    for t in (1e-40, 1e-320):
        assert Sampler(SamplingConfig(temperature=t, seed=0))(logits) == 1
    r = default_engine.generate(QUERY, PASSAGES, temperature=1e-40, seed=1, max_new_tokens=4)
    assert r.token_ids == default_engine.generate(QUERY, PASSAGES, max_new_tokens=4).token_ids


def test_the_explorer_reports_decode_time_per_token_not_per_piece(default_engine):
    """The UI divided by the streamed pieces, which may hold several tokens each."""
    from cacheblend.ui.live import stream_answer

    *_, answer = stream_answer(default_engine, QUERY, PASSAGES, "blend", 0.15, 12)
    s = answer.stats
    assert s["new_tokens"] > 1
    expected = s["seconds"]["decode"] / (s["new_tokens"] - 1) * 1000
    assert answer.decode_ms_per_token == pytest.approx(expected)


def test_decode_time_is_the_engines_not_the_consumers(default_engine):
    """The decode seconds counted the time a consumer held each piece (the explorer yields
    to Gradio on every one), so its "decode ms per token" measured the browser too."""
    import time

    run = default_engine.start(QUERY, PASSAGES[:1], max_new_tokens=6, ignore_eos=True)
    for _ in run.pieces:
        time.sleep(0.2)  # a slow consumer
    assert run.result is not None and run.result.stats.seconds["decode"] < 0.5


def test_a_cancelled_async_call_stops_its_thread_at_the_next_token(default_engine):
    """``asyncio.wait_for(llm.ainvoke(...), t)`` cancelled the awaiting task, but the engine
    went on decoding to ``max_new_tokens`` on its thread (holding a core and its buffer)."""
    import asyncio
    import time

    from cacheblend.aio import CallCancelled, run_in_thread

    ended: list[tuple[float, BaseException | None]] = []

    def work():
        try:
            default_engine.generate(QUERY, PASSAGES, max_new_tokens=2000, ignore_eos=True)
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion
            ended.append((time.monotonic(), e))
            raise
        ended.append((time.monotonic(), None))

    async def call_and_give_up():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(run_in_thread(work), timeout=3.0)

    asyncio.run(call_and_give_up())
    cancelled_at = time.monotonic()
    while not ended and time.monotonic() - cancelled_at < 120:
        time.sleep(0.05)
    when, error = ended[0]
    assert isinstance(error, CallCancelled)
    assert when - cancelled_at < 10  # 2000 tokens take minutes
    assert default_engine.generate(QUERY, PASSAGES, max_new_tokens=2).token_ids  # the engine serves on
