"""The paged-cache layout self-check (cacheblend.integrations.paged) against vLLM's real
CPU cache-update op: the ``vec`` (float32) and ``amx`` (bfloat16) layouts are derived from
the op and round-trip K/V over several blocks; a source-written layout that disagrees with
the op, and a backend without the op, are refused; and a server whose self-check fails
runs every request as plain vLLM (no externally loaded tokens)."""

from __future__ import annotations

import os
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import pytest  # noqa: E402

pytest.importorskip("vllm")

import torch  # noqa: E402

from cacheblend.integrations import paged  # noqa: E402
from cacheblend.integrations.paged import PagedKV, self_check  # noqa: E402

HEADS, HEAD_DIM, BLOCK, LAYERS = 3, 64, 32, 2


def _impl(dtype: torch.dtype):
    """vLLM's own CPU attention impl; its ISA is the one vLLM picks for ``dtype`` here."""
    from unittest import mock

    from vllm.v1.attention.backends import cpu_attn

    config = SimpleNamespace(model_config=SimpleNamespace(dtype=dtype))  # all the impl reads of vLLM's config
    with mock.patch.object(cpu_attn, "get_current_vllm_config", return_value=config):
        impl = cpu_attn.CPUAttentionBackendImpl(9, HEAD_DIM, HEAD_DIM ** -0.5, HEADS, None, None, "auto")
    isa = cpu_attn._get_attn_isa(dtype, BLOCK, HEAD_DIM)  # noqa: SLF001 - how vLLM picks it; no public API
    return SimpleNamespace(impl=impl, isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)


def _paged(dtype: torch.dtype, blocks: int = 6) -> PagedKV:
    layer = _impl(dtype)
    caches = [torch.zeros(blocks, HEADS, BLOCK, 2 * HEAD_DIM, dtype=dtype) for _ in range(LAYERS)]
    return PagedKV(caches, [layer] * LAYERS, BLOCK)


def _probe(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(LAYERS, HEADS, n, HEAD_DIM, generator=g), torch.randn(LAYERS, HEADS, n, HEAD_DIM, generator=g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layout_is_derived_from_vllms_op_and_round_trips(dtype):
    kv = _paged(dtype)
    isa = kv.layers[0].isa
    if dtype == torch.bfloat16 and isa != "amx":
        pytest.skip(f"no AMX here (vLLM picks {isa!r})")
    k, v = _probe(BLOCK - 5)
    check = self_check(kv, k, v)
    assert check.ok and kv.layout is not None, check
    assert all(not c.any() for c in kv.caches), "the scratch block is restored"
    k, v = _probe(70, seed=1)  # three blocks, out of order, starting mid-block
    kv.write([4, 1, 3, 2], 10, k, v)
    rk, rv = kv.read([4, 1, 3, 2], 10, 80)
    assert torch.equal(rk, k.to(dtype)) and torch.equal(rv, v.to(dtype))
    if isa == "vec":  # the op wrote what the layout written from vLLM's source says
        k_t, v_pg = paged.paged_views(kv.caches[0], BLOCK)
        assert torch.equal(k_t[4, :, :, 10], k[0, :, 0].to(dtype)) and torch.equal(v_pg[1, :, 3], v[0, :, 25].to(dtype))


def test_strided_writes_where_the_op_follows_strides_else_copies():
    """vLLM's CPU op takes [n, heads, head_dim] views of the fused K/V (no copy per layer);
    an op that reads its input as if contiguous gets copies, found out by the self-check."""
    kv = _paged(torch.float32)
    assert self_check(kv, *_probe(8)).ok and kv.strided

    def as_if_contiguous(module, key, value, cache, slots):  # reads the storage in [n, heads, dim] order
        flat = [torch.as_strided(t, t.shape, torch.empty(t.shape).stride(), t.storage_offset()) for t in (key, value)]
        return update(module, *flat, cache, slots)

    kv = _paged(torch.float32)
    update = kv.layers[0].impl.do_kv_cache_update
    kv.layers[0].impl.do_kv_cache_update = as_if_contiguous
    check = self_check(kv, *_probe(8))
    assert check.ok and not kv.strided and "contiguous copies" in check.reason, check
    k, v = _probe(70, seed=1)
    kv.write([4, 1, 3, 2], 10, k, v)
    rk, rv = kv.read([4, 1, 3, 2], 10, 80)
    assert torch.equal(rk, k) and torch.equal(rv, v)


def test_a_source_layout_that_disagrees_with_vllms_op_is_refused(monkeypatch):
    def wrong(cache, block_size):  # K not transposed: the classic mistake
        k_pg, v_pg = cache.view(cache.shape[0], cache.shape[1], 2, block_size, -1).unbind(2)

        def write(k, v, slots):
            k_pg[slots // block_size, :, slots % block_size] = k.to(cache.dtype)
            v_pg[slots // block_size, :, slots % block_size] = v.to(cache.dtype)
        return write

    kv = _paged(torch.float32)
    monkeypatch.setitem(paged.SOURCE_LAYOUTS, "vec", wrong)
    check = self_check(kv, *_probe(8))
    assert not check.ok and "does not store the 'vec' layout" in check.reason
    assert kv.layout is None
    with pytest.raises(RuntimeError, match="self-check"):
        kv.read([1], 0, 4)


def test_a_backend_without_the_op_is_refused():
    kv = PagedKV([torch.zeros(4, HEADS, BLOCK, 2 * HEAD_DIM)] * LAYERS, [SimpleNamespace(impl=object())] * LAYERS,
                 BLOCK)
    check = self_check(kv, *_probe(8))
    assert not check.ok and "do_kv_cache_update" in check.reason


def test_a_failed_self_check_makes_the_server_plain_vllm(monkeypatch, tmp_path, default_model_dir):
    """In-process engine core (so the patch reaches the worker): a wrong ``vec`` layout
    turns blending off at start-up; a request with known chunks is then computed by vLLM
    itself (no external tokens) and answers as plain vLLM does."""
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.config import KVTransferConfig

    from cacheblend import Engine
    from cacheblend.datasets import QA_PREAMBLE, load_qa

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setitem(paged.SOURCE_LAYOUTS, "vec", lambda cache, bs: paged.vec_writer(cache.flip(0), bs))
    ex = load_qa("musique", "dev", limit=1, passages=3)[0]
    engine = Engine.load(default_model_dir, store=f"disk:{tmp_path / 'kv'}")
    handles = engine.ingest(ex.passages)
    ids = engine.prompts.build(ex.query, [list(h.token_ids) for h in handles], None, QA_PREAMBLE).all_ids
    spans = engine.prompts.build(ex.query, [list(h.token_ids) for h in handles], None, QA_PREAMBLE)
    del engine
    from cacheblend.chat import chunk_spans

    llm = LLM(model=str(default_model_dir), dtype="float32", enforce_eager=True, enable_prefix_caching=False,
              max_model_len=4096, max_num_batched_tokens=4096, max_num_seqs=1, seed=0,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="CacheBlendConnector", kv_connector_module_path="cacheblend.integrations.vllm",
                  kv_role="kv_both", kv_connector_extra_config={"store": f"disk:{tmp_path / 'kv'}"}))
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, extra_args={"kv_transfer_params": {
            "chunks": [list(s) for s in chunk_spans(spans)], "recompute_ratio": 0.15}})
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        plain = SamplingParams(max_tokens=4, temperature=0.0)
        (ref,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], plain, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert out.num_cached_tokens == 0  # nothing was loaded from outside: vLLM computed the prompt
    assert list(out.outputs[0].token_ids) == list(ref.outputs[0].token_ids)


@pytest.fixture(scope="module")
def vllm_layers(default_model_dir):
    """vLLM's real config, two real ``Attention`` layers and their backend's metadata
    builder (which sets each layer's ISA), per cache dtype: what a worker registers."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    def make(dtype: torch.dtype, block: int):
        cfg = VllmConfig(model_config=ModelConfig(model=str(default_model_dir), dtype=dtype),
                         cache_config=CacheConfig(block_size=block))
        with set_current_vllm_config(cfg):
            layers = [Attention(9, HEAD_DIM, HEAD_DIM ** -0.5, num_kv_heads=HEADS, cache_config=cfg.cache_config,
                                prefix=f"model.layers.{i}.self_attn.attn") for i in range(LAYERS)]
            names = list(cfg.compilation_config.static_forward_context)
            spec = FullAttentionSpec(block_size=block, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=dtype)
            kvc = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
            layers[0].attn_backend.get_builder_cls()(spec, names, cfg, torch.device("cpu"))
        caches = [torch.zeros(4, HEADS, block, 2 * HEAD_DIM, dtype=dtype) for _ in names]
        return cfg, names, kvc, PagedKV(caches, layers, block)
    return make


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllms_attention_reads_the_reference_chunk_back(vllm_layers, dtype):
    """The self-check's last step runs the backend's own attention (metadata from its own
    builder) on the reference chunk and compares with the core's float32 attention; when
    the attention is pointed at a block the chunk was not written to (what a wrong layout
    looks like to the reader), the check fails and reading is turned off."""
    from vllm.config import set_current_vllm_config

    from cacheblend.integrations.readback import attention_readback, verify

    cfg, names, kvc, kv = vllm_layers(dtype, 32)
    if dtype == torch.bfloat16 and kv.layers[0].isa != "amx":
        pytest.skip(f"no AMX here (vLLM picks {kv.layers[0].isa!r})")
    k, v = _probe(BLOCK - 7, seed=3)
    with set_current_vllm_config(cfg):
        check = verify(kv, names, cfg, kvc, 3 * k, v)
        assert check.ok and "vLLM's attention read it back" in check.reason, check
        assert kv.layout is not None
        problem = attention_readback(kv, names, cfg, kvc, 3 * k, v, block=1)
    assert problem is not None and "read the reference chunk back wrong at layer 0" in problem
    assert all(not c.any() for c in kv.caches), "the scratch block is restored"


def test_a_failed_readback_turns_reading_off(vllm_layers, monkeypatch):
    from vllm.config import set_current_vllm_config

    from cacheblend.integrations import readback

    cfg, names, kvc, kv = vllm_layers(torch.float32, 32)
    real = readback.attention_readback  # the attention is told to read block 1, the chunk is in block 0
    monkeypatch.setattr(readback, "attention_readback", lambda *a, **kw: real(*a, block=1))
    with set_current_vllm_config(cfg):
        check = readback.verify(kv, names, cfg, kvc, *_probe(9))
    assert not check.ok and "read the reference chunk back wrong" in check.reason, check
    assert kv.layout is None


def test_caches_off_the_cpu_are_refused_before_anything_loads():
    """A CUDA backend's caches (here on the meta device, which no CPU op can touch): the
    worker blends on the CPU only, so the start-up check refuses them, naming the device,
    without computing the reference chunk (the core engine is not even loaded)."""
    from cacheblend.integrations.readback import start_up_check

    layer = _impl(torch.float32)
    kv = PagedKV([torch.zeros(4, HEADS, BLOCK, 2 * HEAD_DIM, device="meta")] * LAYERS, [layer] * LAYERS, BLOCK)

    def reference():
        raise AssertionError("the reference chunk must not be computed for caches off the CPU")
    check = start_up_check(kv, ["a", "b"], None, None, reference, lambda: None)
    assert not check.ok and "meta" in check.reason and "CPU only" in check.reason, check
    assert kv.layout is None


def test_a_self_check_that_cannot_run_turns_blending_off_instead_of_failing_the_worker():
    """Whatever breaks while the check runs (here the reference chunk's computation, as when
    the engine cannot load) is a failed check with its reason, not an exception out of
    ``register_kv_caches``, which would stop the vLLM server from starting."""
    from cacheblend.integrations.readback import start_up_check

    kv = _paged(torch.float32)

    def reference():
        raise RuntimeError("Expected all tensors to be on the same device")
    check = start_up_check(kv, ["a", "b"], None, None, reference, lambda: None)
    assert not check.ok and "could not run" in check.reason and "same device" in check.reason, check
    assert kv.layout is None
