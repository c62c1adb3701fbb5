"""The fused KV buffer kept between requests (``EngineConfig.reuse_kv_buffer``): reused,
never shared by two requests at once, and never a source of stale K/V."""

from __future__ import annotations

import pytest
import torch

from cacheblend import Engine
from cacheblend.config import EngineConfig
from cacheblend.errors import CacheBlendError
from cacheblend.models.kernels import apply_rope, rope_into
from conftest import PASSAGES, QUERY

OPTIONS = [dict(method="full"), dict(method="blend", recompute_ratio=0.15), dict(method="reuse")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_into_the_cache_is_apply_rope_bit_for_bit(dtype):
    """The re-positioning writes RoPE straight into the fused cache; a float32 cache may
    receive keys stored in bfloat16 (``kv_dtype``)."""
    torch.manual_seed(0)
    x, cos, sin = torch.randn(3, 50, 64).to(dtype), torch.randn(50, 64), torch.randn(50, 64)
    cache = torch.full((3, 80, 64), float("nan"))
    rope_into(cache[:, 20:70], x, cos, sin)
    assert torch.equal(cache[:, 20:70], apply_rope(x, cos, sin))
    assert cache[:, :20].isnan().all() and cache[:, 70:].isnan().all()


@pytest.fixture(scope="module")
def fresh_engine(default_model_dir):
    """The reference: every request on newly allocated K/V."""
    return Engine.load(default_model_dir, store="memory", reuse_kv_buffer=False)


def _answers(engine, passages, n=6):
    handles = engine.ingest(passages)
    return [engine.generate(QUERY, handles, max_new_tokens=n, **o) for o in OPTIONS]


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.first_token_logits, y.first_token_logits)
        assert x.token_ids == y.token_ids


def test_a_kept_buffer_is_reused_and_stale_kv_never_leaks(default_engine, fresh_engine):
    pool = default_engine.kv_pool
    _answers(default_engine, PASSAGES)  # a long prompt leaves its buffer behind
    held = pool.idle_bytes
    assert held > 0
    # Poison the kept buffer: whatever a later request does not write must never be read.
    kv = pool.take(default_engine.decoder.shape, 8, default_engine.device)
    assert kv.storage[0].numel() * kv.storage[0].element_size() * 2 == held  # the kept one
    for t in kv.storage:
        t.fill_(float("nan"))
    pool.give_back(kv)
    short = _answers(default_engine, PASSAGES[:2])
    assert pool.idle_bytes == held  # the larger buffer stays, a smaller one is not kept over it
    _same(short, _answers(fresh_engine, PASSAGES[:2]))
    assert fresh_engine.kv_pool.idle_bytes == 0


def test_an_open_answer_keeps_its_buffer_to_itself(default_engine, fresh_engine):
    """A stream that has prefilled holds its K/V while it decodes; a request that runs
    meanwhile gets other storage, and both answers are the reference's."""
    handles = default_engine.ingest(PASSAGES)
    gen = default_engine.start(QUERY, handles, max_new_tokens=8, method="blend", recompute_ratio=0.15)
    first = next(gen.pieces)  # prefilled: the buffer is in use
    meanwhile = _answers(default_engine, PASSAGES[1:])
    rest = "".join(gen.pieces)
    _same(meanwhile, _answers(fresh_engine, PASSAGES[1:]))
    ref = fresh_engine.generate(QUERY, fresh_engine.ingest(PASSAGES), max_new_tokens=8, method="blend",
                                recompute_ratio=0.15)
    assert first + rest == ref.text and gen.result.token_ids == ref.token_ids


def test_an_abandoned_stream_gives_its_buffer_back(default_engine):
    pool = default_engine.kv_pool
    pool.take(default_engine.decoder.shape, 1, default_engine.device)  # empty the pool
    gen = default_engine.start(QUERY, PASSAGES[:1], max_new_tokens=8)
    next(gen.pieces)
    assert pool.idle_bytes == 0
    gen.pieces.close()  # the consumer stops reading
    assert pool.idle_bytes > 0


def test_devices_match_by_the_index_they_resolve_to():
    """``torch.device("cuda") != torch.device("cuda:0")``: the pool compared them as written and
    never reused a buffer on a GPU."""
    from unittest import mock

    from cacheblend.generate.kv_pool import _same_device

    assert _same_device(torch.device("cpu"), torch.device("cpu"))
    assert not _same_device(torch.device("cpu"), torch.device("cuda"))
    with mock.patch("torch.cuda.current_device", return_value=0):
        assert _same_device(torch.device("cuda:0"), torch.device("cuda"))
        assert not _same_device(torch.device("cuda:1"), torch.device("cuda"))
    assert _same_device(torch.device("cuda:1"), torch.device("cuda:1"))


def test_the_setting_is_checked():
    with pytest.raises(CacheBlendError, match="reuse_kv_buffer"):
        EngineConfig(reuse_kv_buffer="yes")  # type: ignore[arg-type]


def test_a_reserved_buffer_serves_every_method_alike(default_engine):
    """The bench's warm-up: full prefill, timed first on each prompt, used to allocate the
    larger buffer (page faults in its TTFT, two buffers in its peak memory) that the methods
    after it reused for free.  Reserved, every method of the prompt gets the same buffer."""
    from cacheblend.generate.kv_pool import KVPool

    pool, shape = KVPool(), default_engine.decoder.shape
    pool.reserve(shape, 300, "cpu")
    held = pool.idle_bytes
    pool.reserve(shape, 100, "cpu")  # a smaller one keeps the larger
    assert pool.idle_bytes == held > 0
    kv = pool.take(shape, 300, "cpu")
    assert pool.idle_bytes == 0 and not kv.storage[0].any()  # the reserved, written-once buffer
    pool.give_back(kv)
    off = KVPool(enabled=False)
    off.reserve(shape, 300, "cpu")
    assert off.idle_bytes == 0
