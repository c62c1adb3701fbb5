"""KV store tiers on real files: round trip, per-layer reads, corruption never served."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from cacheblend import Engine
from cacheblend.store import ChunkKV, DiskStore, MemoryStore, TieredStore, open_store, parse_size
from conftest import PASSAGES, QUERY

KEY_A, KEY_B = "ab" + "0" * 62, "cd" + "1" * 62


def _kv(layers=3, tokens=5, seed=0) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(torch.randn(layers, 2, tokens, 4, generator=g), torch.randn(layers, 2, tokens, 4, generator=g))


def test_disk_round_trip_and_per_layer_read(tmp_path):
    store = DiskStore(tmp_path)
    kv = _kv()
    assert store.put(KEY_A, kv)
    got = store.get(KEY_A)
    assert torch.equal(got.k, kv.k) and torch.equal(got.v, kv.v)
    with safe_open(store.path(KEY_A), framework="pt") as f:  # one layer without the rest
        torch.testing.assert_close(f.get_tensor("v.2"), kv.v[2])
        assert f.metadata()["format"] == "cacheblend-kv"
    assert not list(tmp_path.rglob(".tmp-*"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "overwrite", "empty"])
def test_damaged_entries_are_detected_and_dropped(tmp_path, damage):
    store = DiskStore(tmp_path)
    store.put(KEY_A, _kv())
    path = store.path(KEY_A)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-7] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "overwrite":
        data[len(data) // 2 : len(data) // 2 + 16] = b"\0" * 16
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    assert store.get(KEY_A) is None
    assert store.corrupt == 1
    assert not path.exists()


def test_a_layer_read_stays_as_verified_when_the_file_is_overwritten_in_place(tmp_path):
    """A layer that passed its digest must not change afterwards: safetensors returns
    views of a mapped file, so an in-place overwrite (damage, a foreign writer) used to
    show up in tensors already verified and served (a wrong answer in benchmarks/faults.py)."""
    store = DiskStore(tmp_path)
    kv = _kv()
    store.put(KEY_A, kv)
    source = store.open(KEY_A)
    k, v = source.layer(2)
    path = store.path(KEY_A)
    with open(path, "r+b") as f:  # every byte after the header, as the chaos run's damage does
        header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
        f.seek(header)
        f.write(b"\x7f" * (path.stat().st_size - header))
    assert torch.equal(k, kv.k[2]) and torch.equal(v, kv.v[2])


def _rewrite_digests(path, algorithm: str | None) -> None:
    """Rewrite a disk entry's header as an older version wrote it (``None``: SHA-256 digests
    under ``layer_sha256``, no ``digest`` field) or as naming ``algorithm``."""
    from safetensors.torch import save_file

    from cacheblend.store.entry import layer_digest

    with safe_open(path, framework="pt") as f:
        meta, tensors = dict(f.metadata()), {n: f.get_tensor(n) for n in f.keys()}
    del meta["layer_digests"], meta["digest"]
    layers = int(meta["layers"])
    if algorithm is None:
        meta["layer_sha256"] = json.dumps([layer_digest(tensors[f"k.{i}"], tensors[f"v.{i}"], "sha256")
                                           for i in range(layers)])
    else:
        meta |= {"digest": algorithm, "layer_digests": json.dumps(["00" * 32] * layers)}
    save_file(tensors, path, metadata=meta)


def test_entries_are_checked_with_blake3_and_older_sha256_entries_still_served(tmp_path):
    store = DiskStore(tmp_path)
    kv = _kv()
    store.put(KEY_A, kv)
    with safe_open(store.path(KEY_A), framework="pt") as f:
        assert f.metadata()["digest"] == "blake3" and "layer_sha256" not in f.metadata()
    _rewrite_digests(store.path(KEY_A), None)  # as written before the digest was recorded
    got = store.get(KEY_A)
    assert got is not None and torch.equal(got.k, kv.k) and store.corrupt == 0
    data = bytearray(store.path(KEY_A).read_bytes())
    data[-7] ^= 0xFF  # a damaged older entry is still caught by its SHA-256
    store.path(KEY_A).write_bytes(bytes(data))
    assert store.get(KEY_A) is None and store.corrupt == 1


@pytest.mark.parametrize("change", [{"layer_digests": "DICT"}, {"layers": "0", "layer_digests": "[]"}])
def test_a_header_damaged_into_another_shape_is_dropped_not_raised(tmp_path, change):
    """Digests as a dict raised KeyError out of the read, into the request; no layers at
    all crashed ``verify`` (an unsigned store trusts its headers' shape)."""
    from safetensors.torch import save_file

    store = DiskStore(tmp_path)
    store.put(KEY_A, _kv())
    with safe_open(store.path(KEY_A), framework="pt") as f:
        meta, tensors = dict(f.metadata()), {n: f.get_tensor(n) for n in f.keys()}
    if change["layer_digests"] == "DICT":  # as many digests as layers, keyed by number
        change = {"layer_digests": json.dumps(dict(enumerate(json.loads(meta["layer_digests"]))))}
    save_file(tensors, store.path(KEY_A), metadata=meta | change)
    assert store.get(KEY_A) is None and store.corrupt == 1
    assert store.verify()["stale_index_rows"] == 0


def test_an_entry_naming_an_unknown_digest_is_dropped_not_served(tmp_path):
    store = DiskStore(tmp_path)
    store.put(KEY_A, _kv())
    _rewrite_digests(store.path(KEY_A), "md5")
    assert store.get(KEY_A) is None and store.corrupt == 1
    assert not store.path(KEY_A).exists()


def test_entry_under_another_name_is_not_served(tmp_path):
    store = DiskStore(tmp_path)
    store.put(KEY_A, _kv())
    store.path(KEY_B).parent.mkdir(parents=True, exist_ok=True)
    store.path(KEY_B).write_bytes(store.path(KEY_A).read_bytes())
    assert store.get(KEY_B) is None and store.corrupt == 1
    assert store.get(KEY_A) is not None


def test_memory_lru_respects_capacity():
    kv = _kv()
    store = MemoryStore(capacity_bytes=kv.nbytes * 2)
    for i in range(5):
        store.put(f"{i:064x}", _kv(seed=i))
        assert store.nbytes <= kv.nbytes * 2
    assert len(store) == 2 and store.evictions == 3
    assert store.get(f"{4:064x}") is not None and store.get(f"{0:064x}") is None


@pytest.mark.parametrize("k, v", [
    (torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4, dtype=torch.float64)),  # mixed dtypes: nbytes lied
    (torch.zeros(0, 1, 3, 4), torch.zeros(0, 1, 3, 4)),  # no layer: the disk tier stored it, then could not read it
    (torch.zeros(2, 1, 0, 4), torch.zeros(2, 1, 0, 4)),  # no token
])
def test_entries_that_no_tier_could_serve_are_refused_when_made(k, v):
    with pytest.raises(ValueError, match="ChunkKV needs"):
        ChunkKV(k, v)


def test_the_memory_tier_never_evicts_the_entry_it_is_storing():
    """A learned entry that needs room used to be its own victim, once older entries had
    been evicted for it, and ``put`` still said True."""
    def entry(tokens, learned):
        return ChunkKV(torch.zeros(1, 1, tokens, 1), torch.zeros(1, 1, tokens, 1),
                       {"origin": "learned"} if learned else {})

    store = MemoryStore(capacity_bytes=100 * 4 * 2)  # 100 tokens of float32 K and V
    store.put(KEY_A, entry(30, learned=True))
    store.put(KEY_B, entry(50, learned=False))
    new = "ef" + "2" * 62
    assert store.put(new, entry(60, learned=True))
    assert new in store and len(store) == 1 and store.evictions == 2  # the other two made room
    assert store.nbytes <= store.capacity_bytes


def test_store_specs(tmp_path):
    assert isinstance(open_store("memory"), MemoryStore)
    assert open_store("memory:2KB").capacity_bytes == 2000
    tiered = open_store(f"memory,disk:{tmp_path}")
    assert isinstance(tiered, TieredStore) and isinstance(tiered.tiers[1], DiskStore)
    assert parse_size("1GiB") == 2**30
    with pytest.raises(ValueError, match="unknown store tier"):
        open_store("tape:/dev/st0")
    with pytest.raises(ValueError, match="cannot read size"):
        open_store("memory:lots")
    # a size without a unit was bytes: 'disk:PATH:512' took every write as too large, silently
    for spec in (f"disk:{tmp_path / 'kv'}:512", "memory:512", f"memory,disk:{tmp_path / 'kv'}:1.5"):
        with pytest.raises(ValueError, match="has no unit: write e.g. 512MB|has no unit: write e.g. 1.5MB"):
            open_store(spec)
    assert open_store(f"disk:{tmp_path / 'kv'}:512B").capacity_bytes == 512  # bytes, when meant


def test_engine_reuses_disk_entries_across_restarts_and_recomputes_corrupt(tmp_path, default_model_dir):
    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "m", "qwen2", default_model_dir)
    spec = f"memory,disk:{tmp_path / 'kv'}"
    first = Engine.load(folder, store=spec)
    handles = first.ingest(PASSAGES)
    want = first.generate(QUERY, handles, max_new_tokens=4)
    first.store.flush()  # slower tiers are written in the background

    second = Engine.load(folder, store=spec)  # a new process would see the same
    again = second.generate(QUERY, handles, max_new_tokens=4)
    assert again.stats.store_misses == 0 and again.stats.seconds["precompute"] == 0.0
    assert again.token_ids == want.token_ids

    third = Engine.load(folder, store=spec)
    path = third.store.tiers[1].path(handles[1].key)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x55
    path.write_bytes(bytes(data))
    healed = third.generate(QUERY, handles, max_new_tokens=4)
    assert healed.stats.store_rejected == 1 and third.store.tiers[1].corrupt == 1
    assert healed.token_ids == want.token_ids
    third.store.flush()
    assert third.store.tiers[1].get(handles[1].key) is not None  # replaced


def test_default_store_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEBLEND_HOME", str(tmp_path))
    store = open_store(None)
    assert store.tiers[0].capacity_bytes == 4 * 10**9
    assert store.tiers[1].capacity_bytes == 20 * 10**9 and store.tiers[1].root == tmp_path / "kv"


def test_entry_evicted_by_another_process_is_a_miss_not_corruption(tmp_path, monkeypatch):
    from pathlib import Path

    store = DiskStore(tmp_path)
    store.put(KEY_A, _kv())
    store.path(KEY_A).unlink()  # another process evicts the entry ...
    monkeypatch.setattr(Path, "is_file", lambda self: True)  # ... just after this one saw it
    assert store.open(KEY_A) is None
    assert store.corrupt == 0


def test_entry_evicted_while_safetensors_opens_it_is_a_miss(tmp_path, monkeypatch):
    """The eviction can also land inside safe_open, after its own existence check: then
    safetensors raises RuntimeError("unable to open file ... No such file or directory"),
    which was counted as corruption (seen in the two-process test under load)."""
    import cacheblend.store.disk_source as disk_source

    store = DiskStore(tmp_path)
    store.put(KEY_A, _kv())

    def racing_open(path, **kw):  # what safetensors 0.8 raised when the file went mid-open
        from pathlib import Path

        Path(path).unlink()  # another process evicts the entry right now
        raise RuntimeError(f"unable to open file <{path}> in read-only mode: No such file or directory (2)")

    monkeypatch.setattr(disk_source, "safe_open", racing_open)
    assert store.open(KEY_A) is None
    assert store.corrupt == 0


def _entry(learned: bool = False, tokens: int = 4) -> ChunkKV:
    return ChunkKV(torch.randn(2, 1, tokens, 8), torch.randn(2, 1, tokens, 8), {"origin": "learned"} if learned else {})


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_learned_chunks_are_evicted_before_ingested_ones(tmp_path, tier):
    size = _entry().nbytes
    store = MemoryStore(3 * size) if tier == "memory" else DiskStore(tmp_path / "kv")
    if tier == "disk":  # capacity from the first file's size: headers differ a little from tensor bytes
        store.put("0" * 64, _entry())
        store.capacity_bytes = int(store.nbytes * 3.5)
        store.delete("0" * 64)
    keys = [f"{i:064x}" for i in range(4)]
    store.put(keys[0], _entry())  # ingested, the oldest
    store.put(keys[1], _entry(learned=True))
    store.put(keys[2], _entry())
    store.put(keys[3], _entry())  # over capacity: the learned one goes, not the oldest
    assert keys[1] not in store and all(k in store for k in (keys[0], keys[2], keys[3]))
    stats = store.stats()
    assert stats["learned_entries"] == 0 and stats["bytes_per_token"] > 0


def test_an_index_without_the_new_columns_is_upgraded(tmp_path):
    import sqlite3

    root = tmp_path / "kv"
    root.mkdir()
    db = sqlite3.connect(root / "index.sqlite3")
    db.execute("CREATE TABLE entries (key TEXT PRIMARY KEY, bytes INTEGER, used REAL)")
    db.commit()
    db.close()
    store = DiskStore(root)
    assert store.put("1" * 64, _entry(learned=True)) and store.stats()["learned_entries"] == 1


def test_chunk_caches_stored_in_bfloat16_take_half_the_bytes(tmp_path, default_model_dir):
    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    full32 = Engine.load(folder, store="memory")
    half = Engine.load(folder, store="memory", kv_dtype="bfloat16")
    (h32,), (h16,) = full32.ingest(PASSAGES[:1]), half.ingest(PASSAGES[:1])
    assert h32.key != h16.key  # another precision is another policy: entries never mix
    e32, e16 = full32.store.get(h32.key), half.store.get(h16.key)
    assert e16.k.dtype == torch.bfloat16 and e16.nbytes * 2 == e32.nbytes
    assert half.store.stats()["bytes_per_token"] * 2 == full32.store.stats()["bytes_per_token"]
    handles = half.ingest(PASSAGES)
    exact = half.generate(QUERY, handles, recompute_ratio=1.0, max_new_tokens=4)
    full = half.generate(QUERY, handles, method="full", max_new_tokens=4)
    assert exact.token_ids == full.token_ids  # recomputing everything still equals full prefill
    torch.testing.assert_close(exact.first_token_logits, full.first_token_logits, atol=1e-3, rtol=1e-3)
    assert half.generate(QUERY, handles, method="reuse", max_new_tokens=2).stats.store_hits == len(PASSAGES) + 1
