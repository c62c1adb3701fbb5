"""The native layer pieces (``cacheblend.native.layer_ops``: RMSNorm, RoPE, re-positioning, the SiLU gate)
and the prefill kernel's output layout: RoPE and the gate give PyTorch's own bits in float32
and bfloat16 (the chunk caches' re-positioning may compute RoPE in PyTorch, so the two must
agree), the norm is within rounding, every row's result is its own (whatever rows share the
call), and the decoder falls back to PyTorch where a call does not fit them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cacheblend import Engine, native
from cacheblend.models.kernels import Kernels, apply_rope, reposition, rms_norm, rope_into, silu_mul
from conftest import make_tiny_model

needs_kernel = pytest.mark.skipif(native.unavailable_reason() is not None,
                                  reason=f"native kernel unavailable: {native.unavailable_reason()}")


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])


@needs_kernel
@DTYPES
@pytest.mark.parametrize("hd", native.HEAD_DIMS)
@pytest.mark.parametrize(("n", "heads"), [(1, 12), (37, 9), (300, 3)])
def test_rope_gives_pytorchs_bits(hd, n, heads, dtype):
    ops = native.layer_ops()
    g = torch.Generator().manual_seed(hd + n)
    x = torch.randn(n, heads * hd, generator=g).to(dtype).view(n, heads, hd).transpose(0, 1)  # a projection's view
    cos, sin = torch.randn(n, hd, generator=g).to(dtype), torch.randn(n, hd, generator=g).to(dtype)
    out = ops.rope(x, cos, sin)
    assert out.is_contiguous() and torch.equal(out, apply_rope(x, cos, sin))
    into = torch.empty(heads, n, hd, dtype=dtype)
    rope_into(into, x, cos, sin)  # what re-positioning a chunk cache writes
    assert torch.equal(out, into)


@needs_kernel
@DTYPES
@pytest.mark.parametrize(("n", "inter"), [(1, 1536), (682, 1536), (3, 4864)])
def test_silu_gate_gives_pytorchs_bits(n, inter, dtype):
    gate, up = (torch.randn(n, 2 * inter, generator=torch.Generator().manual_seed(n)) * 4).to(dtype).chunk(2, dim=-1)
    assert torch.equal(native.layer_ops().silu_mul(gate, up), silu_mul(gate, up))
    assert torch.equal(silu_mul(gate, up), F.silu(gate) * up)


@needs_kernel
def test_silu_gate_of_an_odd_width_is_within_rounding():
    gate, up = torch.randn(5, 40) * 4, torch.randn(5, 40)  # two products' outputs, not one's halves
    assert torch.allclose(native.layer_ops().silu_mul(gate, up), silu_mul(gate, up), rtol=1e-6, atol=1e-7)


@needs_kernel
@DTYPES
@pytest.mark.parametrize(("n", "d"), [(1, 576), (700, 576), (5, 896), (7, 100)])
def test_norm_is_within_rounding_and_row_by_row(n, d, dtype):
    g = torch.Generator().manual_seed(d)
    x, w = (torch.randn(n, d, generator=g) * 3).to(dtype), torch.randn(d, generator=g).to(dtype)
    ops = native.layer_ops()
    out = ops.rms_norm(x, w, 1e-5)
    want = rms_norm(x, w, 1e-5)
    if dtype == torch.float32:
        assert torch.allclose(out, want, rtol=1e-6, atol=1e-6)
    else:  # the float32 norm rounds to bf16 once before the weight: at most one bf16 step apart
        assert torch.allclose(out.float(), want.float(), rtol=2 ** -7, atol=1e-6)
        assert (out != want).float().mean() < 0.01
    assert torch.equal(out[n // 2], ops.rms_norm(x[n // 2 : n // 2 + 1], w, 1e-5)[0])
    rows = torch.randn(2 * n, d, generator=g).to(dtype)[::2]  # a row stride of 2·d
    assert torch.equal(ops.rms_norm(rows, w, 1e-5), ops.rms_norm(rows.contiguous(), w, 1e-5))


@needs_kernel
def test_the_pieces_refuse_bad_input_by_name():
    ops = native.layer_ops()
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.rms_norm(torch.randn(3, 8).half(), torch.randn(8).half(), 1e-5)
    with pytest.raises(RuntimeError, match="weight must have the input's dtype"):
        ops.rms_norm(torch.randn(3, 8), torch.randn(8).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match=r"weight must be \[8\]"):
        ops.rms_norm(torch.randn(3, 8), torch.randn(9), 1e-5)
    with pytest.raises(RuntimeError, match=r"cos and sin must be \[5, 16\]"):
        ops.rope(torch.randn(2, 5, 16), torch.randn(4, 16), torch.randn(4, 16))
    with pytest.raises(RuntimeError, match="gate and up must have one shape"):
        ops.silu_mul(torch.randn(2, 7), torch.randn(2, 8))


@needs_kernel
def test_kernels_fall_back_where_the_pieces_do_not_fit():
    """Half precision, mixed dtypes and broadcast tables take the plain functions, with their results."""
    k = Kernels()
    k.use_native(native.layer_ops())
    assert k.native
    x = torch.randn(3, 10, 16).bfloat16()  # bf16 keys (a narrower kv_dtype) against float32 tables
    cos, sin = torch.randn(10, 16), torch.randn(10, 16)
    assert torch.equal(k.rope(x, cos, sin), apply_rope(x, cos, sin))
    out, want = torch.empty(3, 10, 16), torch.empty(3, 10, 16)
    k.rope_into(out, x, cos, sin)
    rope_into(want, x, cos, sin)
    assert torch.equal(out, want)
    x32, c1, s1 = torch.randn(3, 10, 16), torch.randn(1, 16), torch.randn(1, 16)  # one row's tables, broadcast
    assert torch.equal(k.rope(x32, c1, s1), apply_rope(x32, c1, s1))
    h, w = torch.randn(4, 32).half(), torch.randn(32).half()
    assert torch.equal(k.norm(h, w, 1e-5), rms_norm(h, w, 1e-5))
    gate, up = torch.randn(4, 64).half().chunk(2, dim=-1)
    assert torch.equal(k.act(gate, up), silu_mul(gate, up))


@needs_kernel
def test_prefill_kernel_output_is_row_major():
    """[H, m, hd] as a view of [m, H, hd] memory: the output projection reads its rows without a copy."""
    q, k = torch.randn(9, 40, 64), torch.randn(3, 40, 64)
    out = native.positional_attention()(q, k, k, torch.arange(40), 0.125, 0)
    assert out.shape == (9, 40, 64) and out.transpose(0, 1).is_contiguous()


@needs_kernel
def test_the_decoder_uses_the_pieces_where_the_kernels_are_on(tmp_path, default_model_dir):
    folder = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    assert Engine.load(folder, store="memory").decoder.kernels.native
    assert Engine.load(folder, store="memory", dtype="bfloat16").decoder.kernels.native
    assert not Engine.load(folder, store="memory", native_attention=False).decoder.kernels.native


@needs_kernel
def test_unpacked_weights_run_the_pieces_too(tmp_path, default_model_dir):
    """The vLLM worker's engine keeps transformers' weights as they are (pack_weights=False,
    shared file pages); its norms and gate still run through the pieces, and its tokens are
    the packed engine's (its products through oneDNN on those weights, in place)."""
    from conftest import PASSAGES, QUERY

    folder = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    unpacked = Engine.load(folder, store="memory", pack_weights=False)
    assert unpacked.decoder.kernels.native and unpacked.decoder.products == "oneDNN in place"
    calls = []
    norm = unpacked.decoder.kernels.norm
    unpacked.decoder.kernels.norm = lambda *a: calls.append(1) or norm(*a)  # type: ignore[method-assign]
    packed = Engine.load(folder, store="memory")
    for method in ("full", "blend"):
        a = packed.generate(QUERY, PASSAGES, method=method, max_new_tokens=8, ignore_eos=True)
        b = unpacked.generate(QUERY, PASSAGES, method=method, max_new_tokens=8, ignore_eos=True)
        assert b.token_ids == a.token_ids
    assert calls


@needs_kernel
def test_rope_into_a_cache_slice_gives_pytorchs_bits():
    """Re-positioning writes a chunk's keys into a slice of the fused cache [KVH, cap, hd]."""
    ops, g = native.layer_ops(), torch.Generator().manual_seed(5)
    x = torch.randn(3, 50, 64, generator=g)
    cos, sin = torch.randn(50, 64, generator=g), torch.randn(50, 64, generator=g)
    cache, want = torch.zeros(2, 3, 200, 64), torch.zeros(2, 3, 200, 64)
    ops.rope_into(cache[1, :, 100:150], x, cos, sin)
    rope_into(want[1, :, 100:150], x, cos, sin)
    assert torch.equal(cache, want)
    with pytest.raises(RuntimeError, match="out must have x's shape"):
        ops.rope_into(cache[1, :, 100:140], x, cos, sin)


def test_each_torch_installation_builds_in_its_own_folder(tmp_path, monkeypatch):
    """Two environments with one PyTorch version (an app's venv and a vLLM server's) must not
    share a build folder: the build names each installation's include and library folders, so
    they rebuilt each other's module (40 s) at every switch."""
    monkeypatch.setenv("CACHEBLEND_HOME", str(tmp_path))
    here = native.build_dir()
    assert here.parent == tmp_path / "extensions" and here.name.startswith(f"torch-{torch.__version__}-")
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    assert native.build_dir() != here and native.build_dir().parent == here.parent


def _spans_with_shifts(dtype, g):
    """Three reused spans of a 200-position cache (the shift on both halves, on K only, none),
    their K/V as stored (the first a strided view of an entry), and the RoPE tables."""
    entry = torch.randn(2, 3, 70, 64, generator=g).to(dtype)  # [K or V, KVH, tokens, hd]
    cached = [(entry[0], entry[1])] + [tuple(torch.randn(3, m, 64, generator=g).to(dtype) for _ in range(2))
                                       for m in (41, 1)]
    shift = torch.randn(3, 4, 64, generator=g).to(dtype)  # the segment means [KVH, spans, hd]
    shifts = [(shift[:, 0:1], shift[:, 1:2]), (shift[:, 2:3], None), None]
    cos, sin = torch.randn(200, 64, generator=g).to(dtype), torch.randn(200, 64, generator=g).to(dtype)
    return [5, 90, 150], cached, shifts, cos, sin


@needs_kernel
@DTYPES
def test_reposition_gives_the_per_span_pytorch_bits(dtype):
    """One call re-positions every span of a layer: keys plus their shift, rotated; values
    plus theirs; the same bits as the per-span PyTorch ops, and nothing else written."""
    starts, cached, shifts, cos, sin = _spans_with_shifts(dtype, torch.Generator().manual_seed(9))
    cache, want = torch.zeros(2, 2, 3, 210, 64, dtype=dtype), torch.zeros(2, 2, 3, 210, 64, dtype=dtype)
    native.layer_ops().reposition(cache[0, 1], cache[1, 1], starts, [k for k, _ in cached], [v for _, v in cached],
                                  [s[0] if s else None for s in shifts], [s[1] if s else None for s in shifts],
                                  cos, sin)
    reposition(want[0, 1], want[1, 1], starts, cached, shifts, cos, sin)
    assert torch.equal(cache, want)
    k = Kernels()
    k.use_native(native.layer_ops())
    k.reposition(cache[0, 0], cache[1, 0], starts, cached, shifts, cos, sin)  # through the decoder's pieces
    assert torch.equal(cache[:, 0], want[:, 1])


@needs_kernel
def test_reposition_falls_back_and_refuses_bad_input_by_name():
    starts, cached, shifts, cos, sin = _spans_with_shifts(torch.float32, torch.Generator().manual_seed(3))
    k = Kernels()
    k.use_native(native.layer_ops())
    narrow = [(ck.bfloat16(), cv.bfloat16()) for ck, cv in cached]  # stored narrower than the cache
    nshifts = [None if s is None else tuple(None if d is None else d.bfloat16() for d in s) for s in shifts]
    out, want = torch.zeros(2, 3, 200, 64), torch.zeros(2, 3, 200, 64)
    k.reposition(out[0], out[1], starts, narrow, nshifts, cos, sin)
    reposition(want[0], want[1], starts, narrow, nshifts, cos, sin)
    assert torch.equal(out, want)
    ops, ks, vs = native.layer_ops(), [c[0] for c in cached], [c[1] for c in cached]
    none = [None] * 3
    with pytest.raises(RuntimeError, match="span 1 runs past the cache"):
        ops.reposition(out[0, :, :100], out[1, :, :100], starts, ks, vs, none, none, cos, sin)
    with pytest.raises(RuntimeError, match="one start, K, V, dk and dv per span"):
        ops.reposition(out[0], out[1], starts[:2], ks, vs, none, none, cos, sin)
    with pytest.raises(RuntimeError, match=r"a shift must be \[3, 1, 64\]"):
        ops.reposition(out[0], out[1], starts, ks, vs, [torch.zeros(3, 2, 64), None, None], none, cos, sin)
    with pytest.raises(RuntimeError, match="a span's K must have the input's dtype"):
        ops.reposition(out[0], out[1], starts, [ks[0].bfloat16(), *ks[1:]], vs, none, none, cos, sin)
