"""Layer loading beside the fusor or before it: the default follows the cores torch leaves
free, either way gives the same answer, and the loading controller knows which it is."""

from __future__ import annotations

import os

import pytest
import torch

from cacheblend import CacheBlendError, Engine
from cacheblend.blend import loader
from cacheblend.blend.controller import LoadingController
from conftest import PASSAGES, QUERY, make_tiny_model


@pytest.fixture
def threads():
    """Set torch's thread count for one test, restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_pipelined_only_where_a_core_is_left_for_the_loader(monkeypatch, threads):
    monkeypatch.setattr(loader.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    threads(4)
    assert loader.pipelined(None) is False  # every core runs a compute thread
    threads(3)
    assert loader.pipelined(None) is True
    assert loader.pipelined(False) is False and loader.pipelined(True) is True  # set: as set
    monkeypatch.setattr(loader.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    threads(2)
    assert loader.pipelined(None) is False
    assert loader.pipelined(None, {"redis", "memory"}) is True  # a read that waits on a socket
    assert loader.pipelined(None, {"disk", "memory"}) is False and loader.pipelined(False, {"redis"}) is False


class _Recorded:
    """A lazy source that records which layers were asked for."""

    num_layers, num_tokens, meta = 3, 1, {}

    def __init__(self, tier: str) -> None:
        self.tier, self.asked = tier, []

    def layer(self, index: int):
        self.asked.append(index)
        return torch.zeros(1, 1, 1), torch.zeros(1, 1, 1)


@pytest.mark.parametrize("tier, ahead", [("redis", True), ("disk", False)])
def test_by_default_layers_are_read_ahead_from_redis_only(monkeypatch, threads, tier, ahead):
    """On a host whose cores all run compute threads, a Redis read (mostly a wait on the
    socket) is read ahead of the fusor; a disk read (a copy and a digest) is not."""
    import time

    monkeypatch.setattr(loader.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    threads(2)
    source = _Recorded(tier)
    loading = loader.LayerLoader([source], 3, prefetch=None)
    try:
        loading.layer(0)
        give_up = time.monotonic() + (5.0 if ahead else 0.5)
        while len(source.asked) < 2 and time.monotonic() < give_up:
            time.sleep(0.01)
        assert source.asked == ([0, 1] if ahead else [0])
    finally:
        loading.close()


def test_the_controller_keeps_the_floor_when_nothing_hides_the_load():
    ctl = LoadingController(quality_floor=0.15, prefetch=False)
    ctl.observe_compute(compute_s=1.0, token_layers=100_000)  # 10 us per token-layer
    ctl.observe_load("disk", nbytes=1_000_000_000, seconds=1.0)
    ctl.observe_load("redis", nbytes=100_000_000, seconds=1.0)
    slow = ctl.decide(candidates=3000, fixed_tokens=40, bytes_per_layer=10_000_000, tier="disk")  # 10 ms/layer
    assert slow.ratio == 0.15 and "hides no loading" in slow.reason  # pipelined, it would rise (test_controller)
    assert slow.suggested_tier == "disk"  # no tier hides: the fastest measured one costs least


def test_the_controller_hides_loading_from_the_tiers_the_loader_reads_ahead(monkeypatch, threads):
    """The loader reads Redis ahead on any host (its reads wait on a socket), disk only
    where a core is free; the controller assumed one rule for every tier (the cores'), so
    on a busy host its ``auto`` ratio stayed at the floor for Redis reads that were hidden."""
    monkeypatch.setattr(loader.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    threads(2)  # no core left: disk reads are not read ahead, Redis reads are
    ctl = LoadingController(quality_floor=0.15, prefetch=None)
    ctl.observe_compute(compute_s=1.0, token_layers=100_000)  # 10 us per token-layer
    ctl.observe_load("disk", nbytes=1_000_000_000, seconds=1.0)
    ctl.observe_load("redis", nbytes=1_000_000_000, seconds=1.0)
    ask = dict(candidates=3000, fixed_tokens=40, bytes_per_layer=10_000_000)  # 10 ms/layer either way
    redis, disk = ctl.decide(**ask, tier="redis"), ctl.decide(**ask, tier="disk")
    assert redis.ratio > 0.15 and "raised" in redis.reason
    assert disk.ratio == 0.15 and "hides no loading" in disk.reason
    assert ctl.pipelined("redis") and not ctl.pipelined("disk")
    assert LoadingController(prefetch=False).pipelined("redis") is False  # set: as set


def test_serial_and_pipelined_loads_give_the_same_answer(tmp_path, default_model_dir):
    folder = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    answers = []
    for prefetch in (True, False):
        engine = Engine.load(folder, store=f"disk:{tmp_path / 'kv'}", prefetch=prefetch)
        assert engine.chunks.prefetch is prefetch and engine.controller.pipelined("disk") is prefetch
        r = engine.generate(QUERY, engine.ingest(PASSAGES), recompute_ratio=0.3, max_new_tokens=4)
        assert r.stats.store_hits >= len(PASSAGES)  # every chunk read from the disk tier, layer by layer
        answers.append(r)
    assert answers[1].stats.seconds["load"] > 0 and answers[1].stats.seconds["load_hidden"] == 0
    assert torch.equal(answers[0].first_token_logits, answers[1].first_token_logits)
    assert answers[0].token_ids == answers[1].token_ids


def test_prefetch_defaults_to_the_cores_and_refuses_a_non_bool(tmp_path, default_model_dir):
    folder = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    engine = Engine.load(folder, store="memory")
    assert engine.chunks.prefetch is None and engine.controller.prefetch is None
    assert engine.controller.pipelined("disk") is loader.pipelined(None)
    with pytest.raises(CacheBlendError, match="prefetch must be True or False"):
        Engine.load(folder, store="memory", prefetch="yes")


def test_a_split_gguf_is_assembled_again_when_its_parts_change(tmp_path, monkeypatch):
    """The assembled file was reused whenever its size equalled the parts': a release whose
    parts add up to the same size kept serving the old weights."""
    from cacheblend.models import loader as models_loader

    parts = [tmp_path / "a.part", tmp_path / "b.part"]
    parts[0].write_bytes(b"old-" * 8)
    parts[1].write_bytes(b"tail" * 4)
    monkeypatch.setenv("CACHEBLEND_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(models_loader, "SPLIT_GGUF", {"m": ("m.gguf", [("pkg", "a.part"), ("pkg", "b.part")])})
    monkeypatch.setattr(models_loader, "_package_file", lambda dist, file: tmp_path / file)
    first = models_loader.assemble_split_gguf("m")
    assert first.read_bytes() == b"old-" * 8 + b"tail" * 4
    parts[0].write_bytes(b"new-" * 8)  # same size, new content
    os.utime(parts[0], ns=(1, 2))
    assert models_loader.assemble_split_gguf("m").read_bytes() == b"new-" * 8 + b"tail" * 4


@pytest.mark.parametrize("prefetch", [True, False], ids=["read-ahead", "inline"])
def test_a_hung_layer_read_ends_the_request_at_its_deadline(tmp_path, default_model_dir, monkeypatch, prefetch):
    """A prefetched read that hangs (a stalled network mount) held the fused prefill until
    the read returned, whatever the request's timeout: the fusor waited on the read with no
    limit, and closing the loader waited for the read in flight again.  Without read-ahead
    (the default where torch's threads take every core) the read ran on the request's own
    thread, which nothing interrupts."""
    import threading
    import time

    from cacheblend.store import disk_source

    folder = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    engine = Engine.load(folder, store=f"disk:{tmp_path / 'kv'}", prefetch=prefetch)
    handles = engine.ingest(PASSAGES)
    release = threading.Event()
    read = disk_source.DiskSource.layer_into

    def hanging(self, index, *args):
        if index >= 1:
            release.wait(30)
        return read(self, index, *args)

    monkeypatch.setattr(disk_source.DiskSource, "layer_into", hanging)
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="waiting for a cached layer"):
            engine.generate(QUERY, handles, recompute_ratio=0.3, max_new_tokens=2, timeout=1.0)
        waited = time.monotonic() - t0
    finally:
        release.set()
    assert waited < 10
    monkeypatch.setattr(disk_source.DiskSource, "layer_into", read)
    assert engine.generate(QUERY, handles, recompute_ratio=0.3, max_new_tokens=2).token_ids  # the engine goes on
