"""One disk store, several writers: index rebuilds and maintenance that run while another
process writes, and entries this process cannot delete.  Each failed before its fix: a
file left outside the index (served, never counted against the capacity nor evicted), or
an error raised into the request that read the entry."""

from __future__ import annotations

import torch

from cacheblend.store import ChunkKV, DiskStore
from conftest import immutable


def _kv(seed: int = 0, tokens: int = 50) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(torch.randn(4, 2, tokens, 16, generator=g), torch.randn(4, 2, tokens, 16, generator=g), {})


def _key(i: int) -> str:
    return f"{i + 1:02x}" + "5" * 62  # each in a folder of its own (entries go by the key's first two digits)


def test_a_rebuild_keeps_what_another_process_wrote_after_its_scan(tmp_path, monkeypatch):
    """A rebuild (or the fill of an empty index, or a heal) read the headers, then wiped the
    table and inserted what it had read: an entry written in between lost its row."""
    ours, theirs = DiskStore(tmp_path / "kv"), DiskStore(tmp_path / "kv")
    assert ours.put(_key(0), _kv(0))
    scan = ours.index._scan  # noqa: SLF001 - the scan is where another process's write must land

    def scan_then_another_write():
        rows = scan()
        assert theirs.put(_key(1), _kv(1))  # between the scan and the fill
        return rows

    monkeypatch.setattr(ours.index, "_scan", scan_then_another_write)
    ours.index.rebuild()
    assert sorted(ours.keys()) == [_key(0), _key(1)] and ours.open(_key(1)) is not None


def test_gc_keeps_the_row_of_an_entry_published_while_it_ran(tmp_path, monkeypatch):
    """gc listed rows without a file, then deleted them one by one: a writer that published
    its file in between lost its row (a reservation is a row before it is a file)."""
    store, writer = DiskStore(tmp_path / "kv"), DiskStore(tmp_path / "kv")
    store.index.write("INSERT INTO entries (key, bytes, used) VALUES (?, ?, ?)", (_key(0), 1, 0.0))
    gone = store._gone  # noqa: SLF001 - the check gc makes before it drops a row
    published: list[bool] = []

    def gone_then_published(key: str) -> bool:
        answer = gone(key)
        if not published:
            published.append(writer.put(key, _kv(0)))  # lands right after the first check
        return answer

    monkeypatch.setattr(store, "_gone", gone_then_published)
    store.gc()
    assert published == [True] and store.keys() == [_key(0)] and store.open(_key(0)) is not None


def test_an_entry_this_process_cannot_delete_stays_indexed_and_never_fails_a_request(tmp_path):
    """In a store shared between users an entry may sit in a folder this process cannot
    write.  Its delete (a damaged entry condemned mid-read) raised PermissionError into the
    request, and as the least recently used entry it made every eviction, so every write
    needing room, fail."""
    store = DiskStore(tmp_path / "kv")
    assert store.put(_key(0), _kv(0))
    one = store.nbytes
    store = DiskStore(tmp_path / "kv", capacity_bytes=2 * one + one // 2)
    assert store.put(_key(1), _kv(1))  # _key(0) is the least recently used
    with immutable(store.path(_key(0)).parent):
        assert store.delete(_key(0)) is False and _key(0) in store.keys()
        assert store.put(_key(2), _kv(2))  # room made from the entry it can delete
        assert _key(0) in store.keys() and _key(1) not in store.keys() and store.open(_key(0)) is not None
