"""The Redis tier against a real redis-server on loopback."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import redis
import torch

from cacheblend import Engine
from cacheblend.store import ChunkKV, MemoryStore, RedisStore, TieredStore
from conftest import PASSAGES, QUERY, make_tiny_model
from sharer import run_sharers

KEY = "ef" + "2" * 62


@pytest.fixture
def tier(redis_server):
    store = RedisStore(redis_server.url, prefix=f"t{time.monotonic_ns()}")
    yield store
    store.clear()


def _kv():
    g = torch.Generator().manual_seed(3)
    return ChunkKV(torch.randn(3, 2, 5, 4, generator=g), torch.randn(3, 2, 5, 4, generator=g), {"model": "m"})


def test_round_trip_per_layer(tier):
    kv = _kv()
    assert tier.put(KEY, kv)
    source = tier.open(KEY)
    k1, v1 = source.layer(1)
    assert torch.equal(k1, kv.k[1]) and torch.equal(v1, kv.v[1])
    got = tier.get(KEY)
    assert torch.equal(got.k, kv.k) and got.meta["model"] == "m"
    assert tier.keys() == [KEY]


def test_entries_carry_blake3_digests_and_older_sha256_entries_are_still_served(tier):
    from cacheblend.store.entry import layer_digest

    kv = _kv()
    tier.put(KEY, kv)
    client = redis.Redis.from_url(tier.url)
    meta = json.loads(client.get(tier.entry_name(KEY, "meta")))
    assert meta["digest"] == "blake3" and len(meta["layer_digests"]) == 3
    del meta["digest"], meta["layer_digests"]  # as written before the digest was recorded
    meta["layer_sha256"] = [layer_digest(kv.k[i], kv.v[i], "sha256") for i in range(3)]
    client.set(tier.entry_name(KEY, "meta"), json.dumps(meta))
    got = tier.get(KEY)
    assert got is not None and torch.equal(got.v, kv.v) and tier.corrupt == 0
    client.setrange(tier.entry_name(KEY, 1), 5, b"\xff\xfe")
    assert tier.get(KEY) is None and tier.corrupt == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "meta"])
def test_damaged_entries_are_dropped(tier, damage):
    tier.put(KEY, _kv())
    client = redis.Redis.from_url(tier.url)
    if damage == "flip":
        client.setrange(tier.entry_name(KEY, 2), 5, b"\xff\xfe")
    elif damage == "truncate":
        client.set(tier.entry_name(KEY, 0), client.get(tier.entry_name(KEY, 0))[:-8])
    else:
        client.set(tier.entry_name(KEY, "meta"), b"{not json")
    assert tier.get(KEY) is None
    assert tier.corrupt == 1
    assert client.get(tier.entry_name(KEY, "meta")) is None  # dropped


def test_an_entry_naming_a_digest_unknown_here_is_dropped_not_raised(tier):
    """A Redis shared with another version may hold entries checked by a digest this one
    does not know: the lookup used to raise CorruptEntry out of the request."""
    tier.put(KEY, _kv())
    client = redis.Redis.from_url(tier.url)
    meta = json.loads(client.get(tier.entry_name(KEY, "meta")))
    meta["digest"] = "blake4"
    client.set(tier.entry_name(KEY, "meta"), json.dumps(meta))
    store = TieredStore([MemoryStore(), tier], background=False)
    assert store.open(KEY) is None and tier.corrupt == 1


def test_a_server_that_is_not_redis_is_unreachable_not_an_error():
    """A URL that points at another service (here one that answers HTTP): redis-py raises
    InvalidResponse, which used to escape the tier."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)

    def answer():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                except OSError:
                    pass

    threading.Thread(target=answer, daemon=True).start()
    try:
        tier = RedisStore(f"redis://127.0.0.1:{server.getsockname()[1]}/0", backoff_s=60)
        assert tier.open(KEY) is None and tier.unreachable == 1
        assert tier.put(KEY, _kv()) is False and not tier.available
    finally:
        server.close()


def test_an_entry_with_a_layer_redis_evicted_is_dropped_whole(tier):
    """Redis under maxmemory evicts single layer keys.  The read failed, but the meta stayed,
    so every later lookup opened the entry and failed on the same layer again."""
    tier.put(KEY, _kv())
    redis.Redis.from_url(tier.url).delete(tier.entry_name(KEY, 1))
    source = tier.open(KEY)
    assert source is not None
    from cacheblend.store import CorruptEntry

    with pytest.raises(CorruptEntry, match="evicted"):
        source.layer(1)
    assert tier.open(KEY) is None


def test_unreachable_server_is_a_quick_miss():
    tier = RedisStore("redis://127.0.0.1:1/0", timeout_s=0.2, backoff_s=60)
    t = time.perf_counter()
    assert tier.get(KEY) is None and tier.put(KEY, _kv()) is False
    assert time.perf_counter() - t < 2.0
    assert tier.unreachable == 1  # the second call did not even try: backing off


def test_a_write_outlasts_a_server_busy_for_longer_than_the_read_timeout(tier):
    """A chunk written while the server is busy (here held by CLIENT PAUSE WRITE for 1.5 s;
    in CI, starved of CPU by the engine's own threads) still lands: writes wait for the
    write timeout, not the request path's 0.5 s read timeout (a CI failure: a replica's
    write-behind to Redis timed out, and the other replica found fewer chunks)."""
    admin = redis.Redis.from_url(tier.url)
    admin.execute_command("CLIENT", "PAUSE", 1500, "WRITE")
    try:
        t = time.monotonic()
        assert tier.put(KEY, _kv())
        assert time.monotonic() - t > 1.0  # it really waited for the pause
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    assert tier.unreachable == 0 and torch.equal(tier.get(KEY).k, _kv().k)


def test_a_read_from_a_stalled_server_is_still_a_quick_miss(redis_server):
    tier = RedisStore(redis_server.url, prefix=f"t{time.monotonic_ns()}")
    admin = redis.Redis.from_url(redis_server.url)
    admin.execute_command("CLIENT", "PAUSE", 3000, "ALL")
    try:
        t = time.monotonic()
        assert tier.open(KEY) is None
        assert time.monotonic() - t < 1.5 and tier.unreachable == 1
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")


def test_two_processes_share_chunks_through_redis(tmp_path, redis_server, default_model_dir):
    model = make_tiny_model(tmp_path / "m", "qwen3", default_model_dir)
    prefix = f"share{time.monotonic_ns()}"
    script = f"""
import json, sys
from cacheblend import Engine
from cacheblend.store import MemoryStore, RedisStore, TieredStore
e = Engine.load({str(model)!r}, store=TieredStore([MemoryStore(), RedisStore({redis_server.url!r}, prefix={prefix!r})]))
r = e.generate({QUERY!r}, {PASSAGES!r}, max_new_tokens=4)
e.store.flush()
print(json.dumps({{"misses": r.stats.store_misses, "hits": r.stats.store_hits, "tokens": r.token_ids}}))
"""
    import json

    runs = [json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                      check=True, timeout=300).stdout.splitlines()[-1]) for _ in range(2)]
    assert runs[0]["misses"] == len(PASSAGES) + 1  # the first process computes everything
    assert runs[1]["misses"] == 0 and runs[1]["hits"] == len(PASSAGES) + 1  # the second reuses it
    assert runs[0]["tokens"] == runs[1]["tokens"]


def test_requests_survive_a_redis_restart(tmp_path, redis_server, default_model_dir):
    model = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    engine = Engine.load(model, store=f"memory,{redis_server.url}")
    remote = engine.store.tiers[1]
    remote.backoff_s = 0.2
    handles = engine.ingest(PASSAGES[:2])
    engine.store.flush()
    want = engine.generate(QUERY, handles, max_new_tokens=4)

    redis_server.stop()
    try:
        fresh = engine.ingest(["A passage ingested while Redis is down."])
        during = engine.generate(QUERY, handles + fresh, max_new_tokens=4)  # local tiers carry on
        engine.store.flush()
        assert remote.unreachable >= 1
        assert during.text is not None
    finally:
        redis_server.start()
    time.sleep(0.3)
    assert remote.put(fresh[0].key, engine.store.tiers[0].get(fresh[0].key))  # reconnected
    again = engine.generate(QUERY, handles, max_new_tokens=4)
    assert again.token_ids == want.token_ids


def test_concurrent_writers_never_show_a_partial_entry(redis_server):
    url = redis_server.url.rsplit("/", 1)[0] + "/5"  # a database of its own
    try:
        outs = run_sharers(url, processes=3, rounds=80, delete_every=7)
        assert all(o["bad"] == 0 and o["corrupt"] == 0 for o in outs), outs  # never a wrong or partial entry
        assert sum(o["seen"] for o in outs) > 0
    finally:
        redis.Redis.from_url(url).flushdb()


def test_store_commands_touch_only_their_own_entries(tier):
    """gc and clear leave the vLLM passage registry (and any other key under the prefix)
    alone, and a pattern given as a key deletes nothing."""
    client = redis.Redis.from_url(tier.url)
    registry, other_key = f"{tier.prefix}:passages", "fa" + "3" * 62
    client.sadd(registry, "a passage")
    assert tier.put(KEY, _kv()) and tier.put(other_key, _kv())
    assert tier.delete("*") is False and tier.delete(f"{KEY[:10]}*") is False
    assert tier.get(KEY) is not None and tier.get(other_key) is not None
    assert tier.gc() == {"orphan_layers_removed": 0}
    tier.clear()
    assert tier.get(KEY) is None and client.smembers(registry) == {b"a passage"}
    client.delete(registry)


def test_delete_drops_exactly_the_entrys_names_without_scanning_the_keyspace(tier):
    """Deleting an entry (a damaged one, on the request path) ran SCAN MATCH over every key
    of the server, seconds on a large shared Redis; the meta says which names are its own.
    Meta that cannot be read still gets everything under the entry's name removed."""
    client = redis.Redis.from_url(tier.url)

    def scans() -> int:
        return int(client.info("commandstats").get("cmdstat_scan", {}).get("calls", 0))

    def names(key: str) -> list[bytes]:
        return list(client.scan_iter(match=tier.entry_name(key, "*")))

    assert tier.put(KEY, _kv())
    before = scans()
    assert tier.delete(KEY)
    assert scans() == before and names(KEY) == []
    assert tier.put(KEY, _kv())
    client.set(tier.entry_name(KEY, "meta"), b"{not json")
    assert tier.delete(KEY) and names(KEY) == []


def test_release_takes_exact_keys_only(tmp_path, redis_server, default_model_dir):
    from cacheblend import CacheBlendError, ChunkHandle

    engine = Engine.load(make_tiny_model(tmp_path / "m", "llama", default_model_dir),
                         store=TieredStore([MemoryStore(), RedisStore(redis_server.url, prefix="rel")]))
    handles = engine.ingest(PASSAGES[:2])
    with pytest.raises(CacheBlendError, match="64 hex digits"):
        engine.release(ChunkHandle(key="*", num_tokens=1))
    assert all(engine.store.get(h.key) is not None for h in handles)
    assert engine.release(handles[:1]) == 1 and engine.store.get(handles[1].key) is not None
    engine.store.clear()


def test_the_password_of_a_redis_url_is_never_shown(caplog):
    tier = RedisStore("redis://:swordfish@127.0.0.1:1/0", timeout_s=0.2, backoff_s=60)
    with caplog.at_level("WARNING"):
        tier.get(KEY)
    assert "swordfish" not in caplog.text and "unreachable" in caplog.text
    assert "swordfish" not in str(tier.stats()) and tier.stats()["url"] == "redis://:***@127.0.0.1:1/0"
