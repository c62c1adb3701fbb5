"""The tiered store: promotion of hits, the write-behind queue and its deletes, layer-wise
reads promoted whole (real files for the disk tier)."""

from __future__ import annotations

import pytest
import torch

from cacheblend.store import ChunkKV, CorruptEntry, DiskStore, MemoryStore, TieredStore

KEY_A, KEY_B = "ab" + "0" * 62, "cd" + "1" * 62


def _kv(layers=3, tokens=5, seed=0) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(torch.randn(layers, 2, tokens, 4, generator=g), torch.randn(layers, 2, tokens, 4, generator=g))


def test_tiered_promotes_hits(tmp_path):
    mem, disk = MemoryStore(), DiskStore(tmp_path)
    disk.put(KEY_A, _kv())
    store = TieredStore([mem, disk])
    assert store.get(KEY_A) is not None
    assert mem.get(KEY_A) is not None and store.stats_counts.hits == [0, 1]


def test_a_store_nobody_holds_is_collected_and_its_writer_ends(tmp_path):
    """The background writer used to hold its store through a bound method: every tiered
    store ever opened stayed alive with its thread and its memory tier's tensors."""
    import gc
    import threading
    import weakref

    def writers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "cacheblend-store-writer"}

    # This store's own writer, by identity: other tests' stores may be collected meanwhile
    # (their writers ending), so a count of writers proves nothing.
    before = writers()
    store = TieredStore([MemoryStore(), DiskStore(tmp_path)])
    store.put(KEY_A, _kv())
    store.flush()
    (mine,) = writers() - before
    assert store.stats_counts.background_writes == 1
    ref = weakref.ref(store)
    del store
    gc.collect()
    assert ref() is None
    mine.join(timeout=10)
    assert not mine.is_alive()
    assert DiskStore(tmp_path).get(KEY_A) is not None  # what it had queued was written


class _SlowTier(MemoryStore):
    """A slower tier whose writes take ``seconds`` each (a remote Redis under load)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def put(self, key, kv):
        import time

        time.sleep(self.seconds)
        return super().put(key, kv)


def test_delete_does_not_wait_behind_other_keys_queued_writes(tmp_path):
    """A delete (a request dropping a damaged entry) flushed the whole write-behind queue
    first: it waited for every queued write to the slow tier, of every key."""
    import time

    slow = _SlowTier(0.5)
    store = TieredStore([MemoryStore(), slow])
    for seed in range(6):  # 3 s of queued writes to other keys
        store.put(f"{seed:02d}" + "e" * 62, _kv(seed=seed))
    store.put(KEY_A, _kv())
    t0 = time.monotonic()
    assert store.delete(KEY_A)
    assert time.monotonic() - t0 < 1.0
    store.flush()
    assert slow.get(KEY_A) is None and store.get(KEY_A) is None  # the queued write was skipped
    assert sum(slow.get(f"{seed:02d}" + "e" * 62) is not None for seed in range(6)) == 6
    store.put(KEY_A, _kv(seed=9))  # written again after the delete: lands
    store.flush()
    assert torch.equal(slow.get(KEY_A).k, _kv(seed=9).k)


def test_deleted_keys_are_forgotten_once_no_write_is_queued():
    """Every deleted key's generation was kept for the store's lifetime: a server that
    releases chunks for weeks grew that map without end.  It is needed only while writes
    are queued, and a delete with nothing queued records nothing."""
    slow = _SlowTier(0.2)
    store = TieredStore([MemoryStore(), slow])
    store.put(KEY_A, _kv())
    store.put(KEY_B, _kv(seed=1))
    assert store.stats()["queued_writes"] >= 1
    assert store.delete(KEY_B)  # its queued write is skipped
    assert store.stats()["deletes_tracked"] == 1
    store.flush()
    assert store.stats()["deletes_tracked"] == 0 and store.stats()["queued_writes"] == 0
    assert slow.get(KEY_A) is not None and slow.get(KEY_B) is None
    for seed in range(20):
        key = f"{seed:02d}" + "d" * 62
        store.delete(key)
    assert store.stats()["deletes_tracked"] == 0
    store.put(KEY_B, _kv(seed=2))  # written again after the delete: lands
    store.flush()
    assert torch.equal(slow.get(KEY_B).k, _kv(seed=2).k)


def test_delete_waits_for_a_write_of_its_key_that_is_landing():
    """A write of the key already under way when the delete comes lands first and is then
    deleted, never after the delete."""
    import time

    slow = _SlowTier(0.5)
    store = TieredStore([MemoryStore(), slow])
    store.put(KEY_A, _kv())
    time.sleep(0.1)  # the writer has taken the job
    assert store.delete(KEY_A)
    store.flush()
    assert slow.get(KEY_A) is None and store.get(KEY_A) is None


def test_a_layer_wise_read_promotes_the_whole_entry_once_and_never_a_damaged_one(tmp_path):
    """Read layer by layer from disk (as the fused prefill does), the entry reaches memory
    whole and equal once its last layer is read: each layer is copied once, into the buffer
    that becomes the memory tier's entry, and the layers served are views of it.  A layer
    that fails its digest on the way stops the read; nothing is promoted."""
    mem, disk = MemoryStore(), DiskStore(tmp_path)
    kv = _kv(layers=4, tokens=7)
    disk.put(KEY_A, kv)
    store = TieredStore([mem, disk], background=False)
    source = store.open(KEY_A)
    served = [source.layer(i) for i in range(kv.num_layers)]
    promoted = mem.get(KEY_A)
    assert promoted is not None and torch.equal(promoted.k, kv.k) and torch.equal(promoted.v, kv.v)
    for i, (k, v) in enumerate(served):
        assert torch.equal(k, kv.k[i]) and k.data_ptr() == promoted.k[i].data_ptr()
        assert torch.equal(v, kv.v[i]) and v.data_ptr() == promoted.v[i].data_ptr()

    mem.clear()
    path = disk.path(KEY_A)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x55  # the last layer's bytes
    path.write_bytes(bytes(data))
    source = store.open(KEY_A)
    with pytest.raises(CorruptEntry):
        for i in range(kv.num_layers):
            source.layer(i)
    assert mem.get(KEY_A) is None and disk.get(KEY_A) is None


def test_a_second_pass_over_a_promoted_read_serves_the_checked_copy(tmp_path):
    """The guard's ladder and the question probe read a prompt's sources twice.  The second
    pass used to copy the disk's bytes into the entry memory already held, checking them
    only afterwards, and put the whole entry into memory again for every layer: a file
    damaged in between left the damage in memory, served as trusted."""
    mem, disk = MemoryStore(), DiskStore(tmp_path)
    kv = _kv(layers=4, tokens=7)
    disk.put(KEY_A, kv)
    puts = []
    put = mem.put
    mem.put = lambda key, entry: (puts.append(key), put(key, entry))[1]
    store = TieredStore([mem, disk], background=False)
    source = store.open(KEY_A)
    for i in range(kv.num_layers):
        source.layer(i)
    path = disk.path(KEY_A)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x55  # damaged in place between the passes
    path.write_bytes(bytes(data))
    for i in range(kv.num_layers):
        k, v = source.layer(i)
        assert torch.equal(k, kv.k[i]) and torch.equal(v, kv.v[i])
    assert puts == [KEY_A]
    promoted = mem.get(KEY_A)
    assert torch.equal(promoted.k, kv.k) and torch.equal(promoted.v, kv.v)


class _Untagged:
    """A lazy source from a store written before the protocol named its tier (no ``tier``)."""

    def __init__(self, kv: ChunkKV) -> None:
        self._kv, self.num_layers, self.num_tokens, self.meta = kv, kv.num_layers, kv.num_tokens, {}

    def layer(self, index: int):
        return self._kv.layer(index)


class _UntaggedTier(MemoryStore):
    def open(self, key):
        kv = self.get(key)
        return None if kv is None else _Untagged(kv)


def test_a_source_that_names_no_tier_still_serves(tmp_path):
    """``LayerSource.tier`` is part of the protocol now (the loader reads a socket-bound tier
    ahead); a store object handed to the engine whose sources lack it reads as a tier of
    unknown cost, wrapped by the tiered store or shape-checked alone, never a failed request."""
    from cacheblend.blend.loader import LayerLoader
    from cacheblend.store.entry import ShapeChecked

    custom = _UntaggedTier()
    custom.put(KEY_A, _kv())
    wrapped = TieredStore([MemoryStore(), custom]).open(KEY_A)
    alone = ShapeChecked(custom.open(KEY_A), kv_heads=2, head_dim=4, on_bad=lambda: None)
    assert wrapped is not None and wrapped.tier == "unknown" and alone.tier == "unknown"
    loader = LayerLoader([wrapped, alone], 3, None)
    try:
        for layer in range(3):
            (k1, _), (k2, _) = loader.layer(layer)
            assert torch.equal(k1, _kv().k[layer]) and torch.equal(k2, _kv().k[layer])
    finally:
        loader.close(wait_for_reads=True)
