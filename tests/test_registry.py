"""The vLLM connector's passage registry, used from a process without vLLM (the app that
ingests): a JSON-lines file or a Redis set, and token-level chunk matching."""

from __future__ import annotations

import sys

from cacheblend.integrations.registry import ChunkMatcher, read_passages, register_passages


def test_registry_needs_no_vllm_and_round_trips(tmp_path, redis_server):
    assert "vllm" not in sys.modules  # importing the registry did not pull vLLM in
    texts = ["First passage, about rivers.", "Second passage, about lakes.", "First passage, about rivers."]
    for where in (tmp_path / "p.jsonl", redis_server.url):
        assert register_passages(where, texts) == 2 and register_passages(where, texts[:1]) == 0
        assert sorted(read_passages(where)) == sorted(set(texts))
    with (tmp_path / "p.jsonl").open("a") as f:
        f.write('"a torn last li')  # a writer died mid-line: skipped, not an error
    assert len(read_passages(tmp_path / "p.jsonl")) == 2


def test_matcher_finds_chunks_by_token_ids(default_engine, tmp_path):
    prompts = default_engine.prompts
    passages = ["Paris is the capital of France and its largest city.",
                "Berlin is the capital of Germany, on the river Spree."]
    register_passages(tmp_path / "p.jsonl", passages)
    matcher = ChunkMatcher(prompts.encode, path=tmp_path / "p.jsonl")
    matcher.refresh()
    head, tail = prompts.encode("Answer from these:\n"), prompts.encode("Question: which is German?")
    chunks = [prompts.chunk_ids(p) for p in passages[::-1]]  # any order, any position
    ids = head + chunks[0] + chunks[1] + tail
    a = len(head)
    assert matcher.find(ids) == [(a, a + len(chunks[0])), (a + len(chunks[0]), a + len(chunks[0]) + len(chunks[1]))]
    assert matcher.find(head + tail) == []


def test_a_redis_registry_sees_an_add_that_follows_a_removal(default_engine, redis_server):
    """The connector re-reads a Redis registry when its version changes; the version was
    the set's size, so a passage added after one was removed kept the size and was never
    seen by a running server."""
    import redis

    url = redis_server.url.rsplit("/", 1)[0] + "/5"  # a database of its own
    redis.Redis.from_url(url).flushdb()
    prompts = default_engine.prompts
    old, new = "Lyon lies where the Rhone meets the Saone.", "Porto lies at the mouth of the Douro river."
    register_passages(url, [old])
    matcher = ChunkMatcher(prompts.encode, path=url)
    matcher.refresh()
    redis.Redis.from_url(url).srem("cacheblend:passages", old)  # removed by hand, then another added
    register_passages(url, [new])
    matcher.refresh()
    ids = prompts.encode("Read:\n") + prompts.chunk_ids(new) + prompts.encode("Where is Porto?")
    assert matcher.find(ids) != []
