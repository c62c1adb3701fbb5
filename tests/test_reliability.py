"""What must never go wrong with stored caches, on real files and processes."""

from __future__ import annotations

import time

import pytest
import torch

from cacheblend import Engine
from cacheblend.store import ChunkKV, DiskStore
from conftest import PASSAGES, QUERY, kill_mid_write, make_tiny_model
from sharer import run_sharers

GEN = dict(max_new_tokens=6)


@pytest.fixture(scope="module")
def model(tmp_path_factory, default_model_dir):
    return make_tiny_model(tmp_path_factory.mktemp("rel"), "llama", default_model_dir)


def _kv(tokens=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(torch.randn(4, 2, tokens, 16, generator=g), torch.randn(4, 2, tokens, 16, generator=g))


# -- LMCache blend-mode failures users reported ------------------------------------
def test_same_prompt_twice(model, tmp_path):  # LMCache #854
    engine = Engine.load(model, store=f"memory,disk:{tmp_path}")
    a = engine.generate(QUERY, PASSAGES, **GEN)
    b = engine.generate(QUERY, PASSAGES, **GEN)
    assert a.token_ids == b.token_ids
    assert torch.equal(a.first_token_logits, b.first_token_logits)
    assert b.stats.store_misses == 0


def test_reordered_chunks_with_full_hit(model):  # LMCache #938
    engine = Engine.load(model, store="memory")
    handles = engine.ingest(PASSAGES)
    order = handles[::-1]
    hit = engine.generate(QUERY, order, **GEN)
    assert hit.stats.store_misses == 1  # the system prefix only; every chunk hit
    fresh = Engine.load(model, store="memory").generate(QUERY, [PASSAGES[i] for i in (3, 2, 1, 0)], **GEN)
    assert hit.token_ids == fresh.token_ids
    full = engine.generate(QUERY, order, method="full", **GEN)
    exact = engine.generate(QUERY, order, recompute_ratio=1.0, **GEN)
    assert exact.token_ids == full.token_ids


def test_uncached_chunk_in_the_middle(model):  # LMCache #3238
    engine = Engine.load(model, store="memory")
    handles = engine.ingest([PASSAGES[0], PASSAGES[2]])
    mixed = [handles[0], PASSAGES[1], handles[1]]
    r = engine.generate(QUERY, mixed, **GEN)
    assert r.stats.store_misses == 2  # the new chunk and the system prefix
    fresh = Engine.load(model, store="memory").generate(QUERY, PASSAGES[:3], **GEN)
    assert r.token_ids == fresh.token_ids
    full = engine.generate(QUERY, mixed, method="full", **GEN)
    assert engine.generate(QUERY, mixed, recompute_ratio=1.0, **GEN).token_ids == full.token_ids


# -- disk tier -------------------------------------------------------------------
def test_disk_capacity_is_never_exceeded(tmp_path):
    store = DiskStore(tmp_path / "kv", capacity_bytes=3 * 40_000)
    for i in range(8):
        store.put(f"{i:064x}", _kv(tokens=50, seed=i))  # ~51 KB each
        files = sum(p.stat().st_size for p in (tmp_path / "kv").glob("??/*.safetensors"))
        assert files <= store.capacity_bytes and store.nbytes <= store.capacity_bytes
    assert store.evictions >= 5
    restarted = DiskStore(tmp_path / "kv", capacity_bytes=3 * 40_000)  # the index survives restarts
    assert sorted(restarted.keys()) == sorted(store.keys()) and len(restarted) >= 1


def test_disk_lru_keeps_recently_read(tmp_path):
    store = DiskStore(tmp_path, capacity_bytes=130_000)
    store.put("aa" * 32, _kv(seed=1))
    store.put("bb" * 32, _kv(seed=2))
    time.sleep(0.01)
    assert store.get("aa" * 32) is not None  # touch: now bb is the least recently used
    store.put("cc" * 32, _kv(seed=3))
    assert "aa" * 32 in store and "bb" * 32 not in store


_WRITER = """
import sys, torch
from cacheblend.store import ChunkKV, DiskStore
store = DiskStore(sys.argv[1])
kv = ChunkKV(torch.randn(16, 8, 2048, 64), torch.randn(16, 8, 2048, 64))  # ~134 MB a write
print("ready", flush=True)
while True:
    store.put("ab" * 32, kv)
"""


def test_writer_killed_mid_write_leaves_nothing_half_written(tmp_path):
    kill_mid_write(_WRITER, tmp_path, "ab/.tmp-*")
    store = DiskStore(tmp_path)
    kv = store.get("ab" * 32)
    assert kv is None or kv.k.shape == (16, 8, 2048, 64)  # the whole entry or none of it
    assert store.corrupt == 0
    assert not list(tmp_path.glob("ab/*.safetensors")) or kv is not None
    store.gc(older_than_s=0)
    assert not list(tmp_path.glob("ab/.tmp-*"))


def test_two_processes_share_one_disk_store(tmp_path):
    """No partial or wrong entry is read, and the capacity holds on disk.  It failed about
    every other run on 2026-11-30: a writer evicted by the other process while writing its
    file still moved the file into place, outside the index (now ``DiskStore._publish``)."""
    cap = 4 * 160_000
    outs = run_sharers(f"disk:{tmp_path}:{cap}B", processes=2, rounds=60)
    assert all(o["bad"] == 0 and o["corrupt"] == 0 for o in outs), outs
    assert sum(o["seen"] for o in outs) > 0
    files = sum(p.stat().st_size for p in tmp_path.glob("??/*.safetensors"))
    assert files <= cap


def test_disk_full_carries_on_with_memory(model, tmp_path):
    engine = Engine.load(model, store=f"memory,disk:{tmp_path}")
    disk = engine.store.tiers[1]
    # Every write now fails with an OSError, as on a full disk (ENOSPC) — a tmpfs of our
    # own would need mount rights, so the tier's folder is put under a plain file.
    (tmp_path / "blocker").write_text("a file where a folder should be")
    disk.root = tmp_path / "blocker" / "kv"
    r = engine.generate(QUERY, PASSAGES, **GEN)
    engine.store.flush()
    assert r.token_ids
    assert disk.write_errors >= 1 and disk.last_error
    stats = engine.store.stats()
    assert stats["failed_writes"] >= 1
    again = engine.generate(QUERY, PASSAGES, **GEN)  # served from memory
    assert again.stats.store_misses == 0 and again.token_ids == r.token_ids


def test_foreign_model_entry_is_rejected(model, tmp_path, default_model_dir):
    other = make_tiny_model(tmp_path / "other", "qwen2", default_model_dir)
    a = Engine.load(model, store=f"disk:{tmp_path / 'kv'}")
    b = Engine.load(other, store=f"disk:{tmp_path / 'kv'}")
    (h,) = a.ingest(PASSAGES[:1])
    # Plant model A's entry under the key model B will look for.
    key_b = b.ingest(PASSAGES[:1])[0].key
    b.store.delete(key_b)
    b.store.put(key_b, a.store.get(h.key))
    r = b.generate(QUERY, PASSAGES[:1], **GEN)
    assert r.stats.store_rejected == 1
    assert b.store.get(key_b).meta["model"] == b.fingerprint  # replaced by B's own


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_entry_is_counted_as_rejected_and_replaced(model, tmp_path, damage):
    """Damage found when the entry is opened (a truncated header) counts as rejected just
    like damage found mid-read (flipped data bytes): it was found and not trusted."""
    engine = Engine.load(model, store=f"disk:{tmp_path}")
    (h,) = engine.ingest(PASSAGES[:1])
    clean = engine.generate(QUERY, [h], **GEN)
    path = engine.store.path(h.key)
    data = path.read_bytes()
    mid = len(data) // 2
    path.write_bytes(data[:mid] if damage == "truncate" else data[:-64] + bytes(b ^ 0xFF for b in data[-64:]))
    r = engine.generate(QUERY, [h], **GEN)
    assert r.stats.store_rejected == 1 and r.stats.store_misses == 1
    assert r.token_ids == clean.token_ids and engine.store.get(h.key) is not None


def test_processes_opening_a_new_disk_store_at_once(tmp_path):
    """Several servers starting on one new store folder: none fails to open it.  Switching
    the index to WAL takes a lock SQLite does not wait for; it once failed CI with
    "database is locked" (in test_two_processes_share_one_disk_store)."""
    from opener import open_at_once

    failed = open_at_once([str(tmp_path / f"s{i}") for i in range(24)])
    assert failed == []


def test_an_evicted_write_leaves_a_newer_writers_entry_alone(tmp_path, monkeypatch):
    """A write evicted while it wrote must not delete the key's row afterwards: another
    process may have reserved and published the same key meanwhile, and its file would sit
    outside the index, over the capacity (the race behind a failure of
    test_two_processes_share_one_disk_store on 2026-12-05)."""
    key = "cd" * 32
    kv = ChunkKV(torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16))
    ours, theirs = DiskStore(tmp_path), DiskStore(tmp_path)

    def evicted_then_rewritten(key_: str, tmp: str, path) -> bool:
        theirs.index.write("DELETE FROM entries WHERE key = ?", (key_,))  # they evict our reservation ...
        assert theirs.put(key_, kv)  # ... and write the key themselves
        return False  # so our publish finds no row

    monkeypatch.setattr(ours, "_publish", evicted_then_rewritten)  # the race, made to happen
    assert not ours.put(key, kv)
    assert theirs.keys() == [key] and theirs.get(key) is not None  # their row stands
    assert theirs.nbytes == sum(p.stat().st_size for p in tmp_path.glob("??/*.safetensors"))
    assert not list(tmp_path.glob("cd/.tmp-*"))
    assert ours.write_errors == 0  # a lost race, not a failing disk
