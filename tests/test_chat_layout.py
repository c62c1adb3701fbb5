"""How a chat is laid out around its chunks: the prefix (read exactly from the prefix
cache) stops where the first user message starts; text after that and before the first
chunk is the prompt's lead, computed in place."""

from __future__ import annotations

import pytest
import torch

from cacheblend import Engine
from conftest import PASSAGES, QUERY

SYSTEM = "Answer from the passages the user gives, in one short sentence."


@pytest.fixture
def engine(default_model_dir, tmp_path_factory):
    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", default_model_dir)
    return Engine.load(folder, store="memory")


def _run(gen):
    for _ in gen.pieces:
        pass
    return gen.result


def _conversation(turns: int) -> list[dict]:
    """Earlier turns keep their questions only; the passages come with the last one."""
    msgs = [{"role": "system", "content": SYSTEM}]
    for i in range(turns - 1):
        msgs += [{"role": "user", "content": f"Earlier question number {i}?"},
                 {"role": "assistant", "content": f"An earlier answer, number {i}."}]
    return msgs + [{"role": "user", "content": "\n\n".join(PASSAGES) + "\n\n" + QUERY}]


def test_a_conversations_earlier_turns_are_not_stored_as_a_prefix(engine):
    """The prefix ran up to the first chunk, through every earlier turn: a new prefix on
    each turn, computed apart and stored on the request's path, never read again."""
    engine.ingest(PASSAGES)
    entries = []
    for turns in (1, 2, 3):
        r = _run(engine.start_chat(_conversation(turns), max_new_tokens=2, learn=False))
        entries.append(engine.store.stats()["entries"])
        assert r.stats.chunks == len(PASSAGES)
    assert entries[2] == entries[1] == entries[0]  # the system prefix, stored once
    system_turn = engine.start_chat(_conversation(1), max_new_tokens=1, learn=False)
    assert _run(system_turn).stats.exact_cached_tokens == r.stats.exact_cached_tokens


def test_the_lead_is_computed_exactly(engine):
    """Identity: with every chunk token recomputed, a conversation's answer is full
    prefill's; the lead's tokens are computed, never approximated."""
    engine.ingest(PASSAGES)
    msgs = _conversation(3)
    full = _run(engine.start_chat(msgs, method="full", max_new_tokens=4, learn=False))
    blend = _run(engine.start_chat(msgs, method="blend", recompute_ratio=1.0, max_new_tokens=4, learn=False))
    reuse = _run(engine.start_chat(msgs, method="reuse", max_new_tokens=4, learn=False))
    assert blend.token_ids == full.token_ids
    torch.testing.assert_close(blend.first_token_logits, full.first_token_logits, atol=1e-3, rtol=1e-3)
    assert reuse.stats.reused_tokens > 0
    prefix = _run(engine.start_chat(msgs, method="prefix", max_new_tokens=4, learn=False))
    assert prefix.token_ids == full.token_ids  # exact through the first chunk


def test_a_templates_fixed_text_above_the_context_stays_prefix(engine):
    """Text a template puts above the context in the user message is the same on every
    request: the lead on the first, then prefix again, read exactly from the prefix cache."""
    engine.ingest(PASSAGES)
    above = ("Use the following pieces of context to answer the question at the end. If you don't know the "
             "answer, just say that you don't know, don't try to make up an answer.\n\n")  # LangChain's stuff prompt
    msgs = [{"role": "user", "content": above + "\n\n".join(PASSAGES) + "\n\n" + QUERY}]
    frame = len(engine.prompts.encode(engine.prompts.frame(None)[0]))
    runs = [_run(engine.start_chat(msgs, max_new_tokens=1, learn=False)).stats for _ in range(3)]
    assert runs[0].exact_cached_tokens in (0, frame)  # the lead computed; the frame read if stored before
    assert runs[1].exact_cached_tokens == 0 and runs[1].store_misses == 1  # the recurring lead: prefix, stored now
    assert runs[2].exact_cached_tokens > frame and runs[2].store_hits == len(PASSAGES) + 1


def test_prefix_caching_of_a_short_chat_without_chunks_is_full_prefill(engine):
    """A chat with no passage and no kept system instruction has an empty prefix: method
    "prefix" asked the prefix cache for an empty prompt and raised, where the other methods
    answered."""
    msgs = [{"role": "user", "content": "Hi"}]
    full = _run(engine.start_chat(msgs, method="full", max_new_tokens=3, learn=False))
    prefix = _run(engine.start_chat(msgs, method="prefix", max_new_tokens=3, learn=False))
    assert prefix.token_ids == full.token_ids
