"""Damage that must degrade service, never fail it (issue 14, items 7-10; each of these
failed before the fix): a damaged or read-only index, stray and dangling files, a full
disk, entries of the wrong shape, Redis answers that are not data (killed writers:
test_store_failing_disk.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest
import redis
import torch

from cacheblend import Engine
from cacheblend.store import ChunkKV, DiskStore, MemoryStore, TieredStore
from conftest import PASSAGES, QUERY, immutable, make_tiny_model

GEN = dict(max_new_tokens=6)
KEY = "ab" + "5" * 62


@pytest.fixture(scope="module")
def model(tmp_path_factory, default_model_dir):
    return make_tiny_model(tmp_path_factory.mktemp("heal"), "llama", default_model_dir)


@pytest.fixture(scope="module")
def reference(model):
    return Engine.load(model, store="memory").generate(QUERY, PASSAGES, **GEN).token_ids


def _kv(seed=0, tokens=50, learned=False):
    g = torch.Generator().manual_seed(seed)
    meta = {"origin": "learned"} if learned else {}
    return ChunkKV(torch.randn(4, 2, tokens, 16, generator=g), torch.randn(4, 2, tokens, 16, generator=g), meta)


def _key(i: int) -> str:
    return f"{i + 1:064x}"


# -- 7. the index ------------------------------------------------------------------------
def test_a_damaged_index_is_moved_aside_and_rebuilt_from_the_headers(model, reference, tmp_path):
    root = tmp_path / "kv"
    engine = Engine.load(model, store=f"disk:{root}")
    engine.ingest(PASSAGES)
    engine.store.put(_key(0), _kv(learned=True))
    before = engine.store.stats()
    engine.store.index.close()  # checkpointed: the rows now live in the file
    index = root / "index.sqlite3"
    with open(index, "r+b") as f:  # several pages overwritten (a checkpointed WAL lives in the file)
        for page in range(0, max(4, index.stat().st_size // 4096)):
            f.seek(page * 4096 + 100)
            f.write(os.urandom(512))
    again = Engine.load(model, store=f"memory,disk:{root}")
    disk = again.store.tiers[1]
    stats = disk.stats()
    assert again.generate(QUERY, PASSAGES, **GEN).token_ids == reference
    assert stats["index_rebuilds"] == 1 and (root / "index.sqlite3.damaged").exists()
    for field in ("entries", "learned_entries", "bytes_per_token"):
        assert stats[field] == before[field], field
    for action in ("verify", "gc"):
        assert getattr(disk, action)()["stale_index_rows"] == 0


def test_an_index_damaged_while_serving_heals_in_place(tmp_path):
    store = DiskStore(tmp_path)
    for i in range(3):
        store.put(_key(i), _kv(i))
    store.index.close()
    (tmp_path / "index.sqlite3").write_bytes(b"this is not a database" * 200)
    for suffix in ("-wal", "-shm"):
        (tmp_path / f"index.sqlite3{suffix}").unlink(missing_ok=True)
    store.index._db = __import__("sqlite3").connect(tmp_path / "index.sqlite3", check_same_thread=False,  # noqa: SLF001
                                                    isolation_level=None)
    assert store.get(_key(1)) is not None and len(store) == 3 and store.index.rebuilds == 1


def _ingest_and_close(model, root):
    engine = Engine.load(model, store=f"disk:{root}")
    engine.ingest(PASSAGES)
    engine.store.index.close()  # no connection of ours may write the files once they are read-only


def test_a_read_only_index_serves_hits_and_skips_writes(model, reference, tmp_path, caplog):
    root = tmp_path / "kv"
    _ingest_and_close(model, root)
    files = [root / "index.sqlite3", root / "index.sqlite3-wal", root / "index.sqlite3-shm"]
    with immutable(*[f for f in files if f.exists()]), caplog.at_level("WARNING"):
        engine = Engine.load(model, store=f"disk:{root}")
        result = engine.generate(QUERY, PASSAGES, **GEN)
        assert result.token_ids == reference and result.stats.store_hits >= len(PASSAGES)
        engine.ingest(["a passage the store cannot take"])
        assert engine.store.stats()["read_only"] is True
    assert "read-only" in caplog.text


def test_a_read_only_store_directory_serves_read_only(model, reference, tmp_path, caplog):
    root = tmp_path / "kv"
    _ingest_and_close(model, root)
    paths = sorted(root.rglob("*"), reverse=True) + [root]
    with immutable(*paths), caplog.at_level("WARNING"):
        engine = Engine.load(model, store=f"memory,disk:{root}")
        assert engine.generate(QUERY, PASSAGES + ["new text"], **GEN).token_ids
        assert engine.generate(QUERY, PASSAGES, **GEN).token_ids == reference
        assert engine.store.tiers[1].read_only
    assert str(root) in caplog.text


@pytest.mark.parametrize("what", ["index", "folder"])
def test_a_read_only_tier_takes_writes_again_once_it_can(tmp_path, monkeypatch, what):
    """A tier that went read-only (the index could not be opened for writing, the folder
    was read-only) stayed so for the life of the process: a server wrote nothing to disk
    again after a remount or a permission fix until it was restarted."""
    root = tmp_path / "kv"
    first = DiskStore(root)
    assert first.put(_key(0), _kv(0))
    first.index.close()
    paths = [p for p in (root / "index.sqlite3", root / "index.sqlite3-wal", root / "index.sqlite3-shm")
             if p.exists()] if what == "index" else [*sorted(root.rglob("*"), reverse=True), root]
    with immutable(*paths):
        store = DiskStore(root)
        assert not store.put(_key(1), _kv(1)) and store.read_only
        assert store.get(_key(0)) is not None  # served meanwhile
    assert not store.put(_key(1), _kv(1)) and store.read_only  # tried again once a minute, not per write
    monkeypatch.setattr("cacheblend.store.disk_index.RETRY_WRITES_S", 0.0)
    assert store.put(_key(1), _kv(1)) and not store.read_only
    store.index.close()
    again = DiskStore(root)
    assert len(again) == 2 and again.get(_key(1)) is not None  # in the file index, for every process


def test_a_read_only_store_without_hints_is_served_and_the_hint_tried_once(model, tmp_path):
    """Entries stored before deviation hints, in a store that cannot be written: every prompt
    is served (with the full check) and each entry's hint is attempted once per retry
    interval (ten minutes), not per prompt."""
    from cacheblend.blend.hint import HINT_FIELD

    root = tmp_path / "kv"
    engine = Engine.load(model, store=f"disk:{root}")
    engine.generate(QUERY, PASSAGES, **GEN)  # stores the prompt's prefix too
    for h in engine.ingest(PASSAGES):
        kv = engine.store.get(h.key)
        engine.store.put(h.key, ChunkKV(kv.k, kv.v, {k: v for k, v in kv.meta.items() if k != HINT_FIELD}))
    engine.store.index.close()
    full_check = Engine.load(model, store="memory").generate(QUERY, PASSAGES, check_pool=1.0, **GEN).token_ids
    paths = sorted(root.rglob("*"), reverse=True) + [root]
    with immutable(*paths):
        engine = Engine.load(model, store=f"disk:{root}")
        for _ in range(3):
            r = engine.generate(QUERY, PASSAGES, **GEN)
            engine.chunks.wait_learning()
            assert r.token_ids == full_check
            assert r.stats.checked_tokens == r.stats.approximate_tokens + r.stats.recomputed_tokens
        assert engine.store.skipped_writes == len(PASSAGES)  # one attempt per entry


# -- 8. strays, symlinks, capacity -------------------------------------------------------
def test_stray_and_dangling_files_are_skipped_and_reported(model, reference, tmp_path):
    root = tmp_path / "kv"
    Engine.load(model, store=f"disk:{root}").ingest(PASSAGES)
    (root / "ab").mkdir(exist_ok=True)
    (root / "ab" / "notakey.safetensors").write_bytes(b"junk")
    (root / "ab" / f"{KEY}.safetensors").symlink_to(tmp_path / "gone.safetensors")  # dangling
    (root / "index.sqlite3").unlink()  # an index loss: rebuilt from what is there
    store = DiskStore(root)
    assert store.verify()["stray_files"] == 2 and store.gc()["stray_files"] == 2
    assert (root / "ab" / "notakey.safetensors").exists()
    assert Engine.load(model, store=f"disk:{root}").generate(QUERY, PASSAGES, **GEN).token_ids == reference


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MB filesystem (tmpfs), to fill up."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_disk_skips_writes_and_never_fails_a_request(model, reference, small_disk, caplog):
    disk_only = Engine.load(model, store=f"disk:{small_disk / 'a'}")
    tiered = Engine.load(model, store=f"memory,disk:{small_disk / 'b'}")
    st = os.statvfs(small_disk)
    (small_disk / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 8192))  # the disk is full
    with caplog.at_level("WARNING"):
        for _ in range(2):
            assert disk_only.generate(QUERY, PASSAGES, **GEN).token_ids == reference
        assert tiered.generate(QUERY, PASSAGES, **GEN).token_ids == reference
        tiered.store.flush()
    assert disk_only.store.stats()["write_errors"] >= 1 and "cannot be written" in caplog.text


@pytest.fixture
def world_dir():
    """A folder every user can reach (pytest's tmp_path is private to its owner)."""
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix="cacheblend-shared-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_an_entry_folder_this_user_cannot_read_is_a_miss(world_dir):
    """A store shared between users: an entry folder another user made without access for
    this one made ``open`` (and opening the store) raise PermissionError."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to act as another user")
    root = world_dir / "shared"
    store = DiskStore(root)
    store.put(KEY, _kv())
    other = "cd" + KEY[2:]
    store.index.close()
    for path in [root, *root.iterdir()]:
        os.chmod(path, 0o777 if path.is_dir() else 0o666)
    os.chmod(root / KEY[:2], 0o700)  # root's own folder: no access for anyone else
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other user
        try:
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            mine = DiskStore(root)
            verdict = [mine.open(KEY) is None, mine.put(other, _kv(1)), mine.get(other) is not None]
            os.write(write, json.dumps(verdict).encode())
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            os.write(write, json.dumps(repr(e)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        verdict = json.loads(f.read())
    os.waitpid(pid, 0)
    assert verdict == [True, True, True]
    assert DiskStore(root).get(KEY) is not None  # the owner's entry is untouched, still indexed


def test_a_rewrite_that_fails_keeps_the_entry_it_meant_to_replace_indexed(tmp_path, monkeypatch):
    """The hint backfill rewrites stored entries.  When the rewrite failed (disk full), its
    reservation's row was deleted while the older file stayed: served, but outside the
    index, never counted against the capacity nor evicted."""
    import errno

    import cacheblend.store.disk as disk_module

    store = DiskStore(tmp_path / "kv", capacity_bytes=10_000_000)
    kv = _kv()
    assert store.put(KEY, kv)
    size = store.nbytes

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_module.os, "fsync", full)
    assert not store.put(KEY, ChunkKV(kv.k, kv.v, {"hint": "x"}))
    monkeypatch.undo()
    assert len(store) == 1 and store.nbytes == size
    assert store.get(KEY) is not None and store.write_errors == 1


def test_killed_writers_temp_files_are_reclaimed_at_open(tmp_path):
    root = tmp_path / "kv"
    DiskStore(root)
    (root / "ab").mkdir()
    orphan = root / "ab" / f".tmp-{KEY}-x1"
    orphan.write_bytes(b"\0" * 100_000)
    old = time.time() - 60
    os.utime(orphan, (old, old))
    store = DiskStore(root)
    assert not orphan.exists() and store.stats()["reclaimed_bytes"] == 100_000


def test_a_live_writers_temp_file_is_left_alone(tmp_path):
    import fcntl

    store = DiskStore(tmp_path)
    (tmp_path / "ab").mkdir()
    live = tmp_path / "ab" / f".tmp-{KEY}-x2"
    with open(live, "wb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        os.utime(live, (time.time() - 60, time.time() - 60))
        assert store.gc(older_than_s=0)["temp_files_removed"] == 0 and live.exists()
    assert store.gc(older_than_s=0)["temp_files_removed"] == 1


def test_verify_drops_index_rows_without_a_file(tmp_path):
    store = DiskStore(tmp_path)
    store.put(_key(0), _kv())
    store.path(_key(0)).unlink()
    assert store.verify()["stale_index_rows"] == 1 and len(store) == 0


# -- 9. entries that are not what they claim ---------------------------------------------
def _reshaped(kv: ChunkKV) -> ChunkKV:
    """Same bytes, another shape: [layers, kv_heads*2, tokens, head_dim/2]."""
    n_layers, heads, tokens, dim = kv.k.shape
    def f(t):
        return t.reshape(n_layers, heads, tokens, 2, dim // 2).permute(0, 1, 3, 2, 4).reshape(
            n_layers, heads * 2, tokens, dim // 2).contiguous()
    return ChunkKV(f(kv.k), f(kv.v), kv.meta)


@pytest.mark.parametrize("tier", ["disk", "redis"])
@pytest.mark.parametrize("damage", ["shape", "fewer_layers"])
def test_entries_of_the_wrong_shape_are_recomputed_and_replaced(model, reference, tmp_path, redis_server, tier, damage):
    spec = f"disk:{tmp_path / 'kv'}" if tier == "disk" else redis_server.url
    engine = Engine.load(model, store=spec)
    handles = engine.ingest(PASSAGES)
    store = engine.store
    good = store.get(handles[1].key)
    bad = _reshaped(good) if damage == "shape" else ChunkKV(good.k[:2], good.v[:2], good.meta)
    store.put(handles[1].key, bad)  # valid digests, the wrong shape
    result = Engine.load(model, store=spec).generate(QUERY, PASSAGES, **GEN)
    assert result.token_ids == reference and result.stats.store_rejected >= 1
    assert torch.equal(store.get(handles[1].key).k, good.k)  # replaced
    store.clear()


@pytest.mark.parametrize("damage", ["three_bytes", "wrong_type_layer", "wrong_type_meta"])
def test_redis_values_that_are_not_layers_are_dropped(model, reference, redis_server, damage):
    engine = Engine.load(model, store=redis_server.url)
    key = engine.ingest(PASSAGES)[2].key
    client = redis.Redis.from_url(redis_server.url)
    layer, meta = f"cacheblend:{key}:0", f"cacheblend:{key}:meta"
    if damage == "three_bytes":
        client.set(layer, b"abc")
    elif damage == "wrong_type_layer":
        client.delete(layer)
        client.rpush(layer, b"x")
    else:
        client.delete(meta)
        client.hset(meta, "a", "b")
    for _ in range(2):
        r = Engine.load(model, store=redis_server.url).generate(QUERY, PASSAGES, **GEN)
        assert r.token_ids == reference
    assert client.type(meta) == b"string" and client.type(layer) == b"string"  # replaced
    engine.store.clear()


def test_a_redis_that_refuses_writes_or_has_no_such_db_is_a_miss(model, reference, redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", str(client.info("memory")["used_memory"] + 10_000))
    try:
        engine = Engine.load(model, store=f"memory,{redis_server.url}")
        assert engine.generate(QUERY, PASSAGES, **GEN).token_ids == reference
        engine.store.flush()
        alone = Engine.load(model, store=redis_server.url)
        assert alone.generate(QUERY, PASSAGES, **GEN).token_ids == reference
        assert alone.store.stats()["refused"] >= 1
    finally:
        client.config_set("maxmemory", "0")
    bad_db = redis_server.url.rsplit("/", 1)[0] + "/99"
    assert Engine.load(model, store=bad_db).generate(QUERY, PASSAGES, **GEN).token_ids == reference


def test_the_tiers_report_what_they_skipped(tmp_path):
    store = TieredStore([MemoryStore(), DiskStore(tmp_path, capacity_bytes=10_000)])
    store.put(_key(0), _kv())  # larger than the disk tier: skipped there, counted
    store.flush()
    assert store.stats()["failed_writes"] == 1 and store.tiers[1].stats()["skipped_writes"] == 1
    assert json.dumps(store.stats())


def test_a_process_follows_an_index_another_one_healed(tmp_path):
    """Two processes: the first to find the damage heals; the other opens the new index
    instead of healing again (which would move a good index aside)."""
    other = DiskStore(tmp_path)
    for i in range(3):
        other.put(_key(i), _kv(i))
    other.index.run(lambda db: db.execute("PRAGMA wal_checkpoint(TRUNCATE)"))  # the rows now in the file
    (tmp_path / "index.sqlite3").write_bytes(b"garbage" * 1000)  # damaged under both
    healer = DiskStore(tmp_path)
    healed = (tmp_path / "index.sqlite3").stat().st_ino
    assert healer.index.rebuilds == 1 and len(healer) == 3
    assert other.get(_key(2)) is not None and len(other) == 3 and other.index.rebuilds == 0
    other.put(_key(3), _kv(3))
    assert (tmp_path / "index.sqlite3").stat().st_ino == healed and len(healer) == 4
