"""The native attention kernels (``cacheblend.native``): each kernel against attention
computed in float64 over every shape it takes (the decode step's; the prefill's by position,
contiguous, scattered and windowed), the engine's greedy tokens with them on and off, and the
fall-back where they cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cacheblend import CacheBlendError, Engine, native
from cacheblend.config import EngineConfig
from conftest import PASSAGES, QUERY, make_tiny_model

needs_kernel = pytest.mark.skipif(native.unavailable_reason() is not None,
                                  reason=f"native kernel unavailable: {native.unavailable_reason()}")


def reference(q, k, v, n, scale):
    """Softmax attention in float64 of q [H, 1, hd] over keys 0..n-1 of k, v [KVH, cap, hd]."""
    h, kvh = q.shape[0], k.shape[0]
    qg = q.double().reshape(kvh, h // kvh, -1)
    scores = torch.einsum("kgd,ktd->kgt", qg, k[:, :n].double()) * scale
    out = torch.einsum("kgt,ktd->kgd", torch.softmax(scores, -1), v[:, :n].double())
    return out.reshape(h, 1, -1)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("hd", native.HEAD_DIMS)
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4), (14, 2), (5, 1)])
def test_kernel_matches_softmax_attention(dtype, hd, heads, kv_heads):
    kernel = native.decode_attention()
    g = torch.Generator().manual_seed(hd + heads)
    cap = 700
    k = torch.randn(kv_heads, cap, hd, generator=g).to(dtype)
    v = torch.randn(kv_heads, cap, hd, generator=g).to(dtype)
    q = torch.randn(heads, 1, hd, generator=g).to(dtype)
    scale = hd ** -0.5
    for n in (1, 2, 15, 16, 17, 100, 256, 511, 513, 699, 700):
        for splits in {1, 3, native.key_slices(kv_heads, n), 64}:
            out = kernel(q, k, v, n, scale, splits)
            assert out.dtype == dtype and out.shape == q.shape
            want = reference(q, k, v, n, scale)
            tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
            assert torch.allclose(out.double(), want, atol=tol, rtol=tol), (n, splits)


@needs_kernel
def test_kernel_reads_a_layer_of_the_fused_cache():
    """The decode step passes ``kv.k[layer]``: a view whose head stride is the capacity's,
    with garbage past the ``n`` keys; nothing past them may leak in."""
    kernel = native.decode_attention()
    k = torch.randn(3, 2, 50, 64)
    v = torch.randn(3, 2, 50, 64)
    k[1, :, 40:] = 1e4
    v[1, :, 40:] = float("nan")
    q = torch.randn(6, 1, 64)
    out = kernel(q, k[1], v[1], 40, 0.125, 2)
    assert torch.allclose(out.double(), reference(q, k[1], v[1], 40, 0.125), atol=1e-5)


@needs_kernel
def test_kernel_refuses_bad_input_by_name():
    kernel = native.decode_attention()
    k = torch.randn(2, 10, 64)
    with pytest.raises(RuntimeError, match="n must be in"):
        kernel(torch.randn(4, 1, 64), k, k, 11, 0.1, 1)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        kernel(torch.randn(3, 1, 64), k, k, 5, 0.1, 1)
    with pytest.raises(RuntimeError, match="head_dim must be"):
        kernel(torch.randn(4, 1, 48), torch.randn(2, 10, 48), torch.randn(2, 10, 48), 5, 0.1, 1)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel(torch.randn(4, 1, 64), k.half(), k.half(), 5, 0.1, 1)


@needs_kernel
def test_degenerate_shapes_raise_instead_of_killing_the_process():
    """No KV heads or a head_dim of 0 divided by zero inside the kernels (SIGFPE: the whole
    process died), and a q of another head_dim was read as another shape, silently."""
    script = """
import torch
from cacheblend import native
da, pa = native.decode_attention(), native.positional_attention()
cases = [lambda: da(torch.randn(0, 1, 64), torch.randn(0, 4, 64), torch.randn(0, 4, 64), 1, .1, 1),
         lambda: da(torch.randn(2, 1, 0), torch.randn(2, 4, 0), torch.randn(2, 4, 0), 1, .1, 1),
         lambda: pa(torch.randn(0, 3, 64), torch.randn(0, 4, 64), torch.randn(0, 4, 64), torch.arange(3), .1, 0),
         lambda: da(torch.randn(4, 1, 32), torch.randn(1, 8, 64), torch.randn(1, 8, 64), 8, .1, 1)]
for case in cases:
    try:
        case()
        print("computed")
    except RuntimeError:
        print("refused")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and out.stdout.split() == ["refused"] * 4, (out.returncode, out.stderr[-500:])


def test_a_compiler_named_with_its_wrapper_is_found(monkeypatch):
    """``CXX="ccache g++"`` was looked up whole on PATH: the kernels were reported
    unavailable although PyTorch's builder runs that command as it is."""
    monkeypatch.setenv("CXX", "env c++")
    assert native.unavailable_reason() is None or "compiler" not in native.unavailable_reason()


def reference_by_position(q, k, v, q_pos, scale, window=None):
    """Float64 attention of q [H, m, hd] at positions ``q_pos`` over keys 0..q_pos[i]."""
    h, kvh = q.shape[0], k.shape[0]
    n = int(q_pos[-1]) + 1
    scores = torch.einsum("kgmd,knd->kgmn", q.double().reshape(kvh, h // kvh, *q.shape[1:]), k[:, :n].double()) * scale
    keys = torch.arange(n)
    hidden = keys[None, :] > q_pos[:, None]
    if window:
        hidden |= keys[None, :] <= q_pos[:, None] - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("kgmn,knd->kgmd", torch.softmax(scores, -1), v[:, :n].double()).reshape(q.shape)


@needs_kernel
@pytest.mark.parametrize("hd", native.HEAD_DIMS)
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4), (14, 2)])
@pytest.mark.parametrize("window", [None, 7, 600])
def test_prefill_kernel_matches_attention_by_position(hd, heads, kv_heads, window):
    kernel = native.positional_attention()
    g = torch.Generator().manual_seed(hd * heads)
    n = 1300  # more than two key blocks of 512
    k = torch.randn(kv_heads, n + 20, hd, generator=g)  # the cache is longer than the keys attended
    v = torch.randn(kv_heads, n + 20, hd, generator=g)
    scattered = torch.randperm(n - 40, generator=g)[:150].sort().values
    for q_pos in (torch.arange(n), torch.cat([scattered, torch.arange(n - 40, n)]), torch.tensor([0]),
                  torch.tensor([n - 1]), torch.arange(5, 37)):
        q = torch.randn(heads, q_pos.numel(), hd, generator=g)
        out = kernel(q, k, v, q_pos, hd ** -0.5, window or 0)
        want = reference_by_position(q, k, v, q_pos, hd ** -0.5, window)
        assert torch.allclose(out.double(), want, atol=2e-5, rtol=1e-5), (q_pos.numel(), window)


@needs_kernel
@pytest.mark.parametrize("window", [0, 300])
def test_a_row_gets_the_same_bits_whatever_rows_share_its_call(window):
    """Each 8-row tile walks the keys up to its own last position, so rows far apart in one
    work item (a blend's scattered rows) skip what they cannot see; the keys skipped would
    only add exact zeros, so every row's bits equal those of the row attended alone."""
    kernel = native.positional_attention()
    g = torch.Generator().manual_seed(5)
    n = 1800
    k, v = torch.randn(3, n, 64, generator=g), torch.randn(3, n, 64, generator=g)
    q_pos = torch.cat([torch.arange(3, 9), torch.tensor([600, 1030, 1031]), torch.arange(1500, 1520),
                       torch.tensor([n - 1])])
    q = torch.randn(9, q_pos.numel(), 64, generator=g)
    together = kernel(q, k, v, q_pos, 0.125, window)
    for i in range(q_pos.numel()):
        alone = kernel(q[:, i : i + 1].contiguous(), k, v, q_pos[i : i + 1], 0.125, window)
        assert torch.equal(together[:, i : i + 1], alone), int(q_pos[i])


@needs_kernel
def test_prefill_kernel_takes_strided_queries_and_refuses_bad_input():
    """The fusor's queries are a view, and the cache a layer of the fused cache."""
    kernel = native.positional_attention()
    cache = torch.randn(2, 2, 300, 64)
    q = torch.randn(100, 4, 64).transpose(0, 1)  # [H, m, hd] with the rows 4 * 64 apart
    pos = torch.arange(150, 250)
    want = reference_by_position(q, cache[1], cache[1], pos, 0.125)
    assert torch.allclose(kernel(q, cache[1], cache[1], pos, 0.125, 0).double(), want, atol=2e-5)
    with pytest.raises(RuntimeError, match="sorted"):
        kernel(q, cache[1], cache[1], pos.flip(0), 0.125, 0)
    with pytest.raises(RuntimeError, match="past the keys"):
        kernel(q, cache[1], cache[1], pos + 100, 0.125, 0)
    with pytest.raises(RuntimeError, match="one position per query row"):
        kernel(q, cache[1], cache[1], pos[:50], 0.125, 0)
    with pytest.raises(RuntimeError, match="float32 only"):
        kernel(q.bfloat16(), cache[1].bfloat16(), cache[1].bfloat16(), pos, 0.125, 0)


@needs_kernel
def test_a_float32_plan_with_the_kernel_equals_the_bucket_plan():
    """The blend's plans take the kernel; without it they run PyTorch's kernel in buckets."""
    from cacheblend.blend.attention import AttentionPlan

    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(3, 900, 64, generator=g), torch.randn(3, 900, 64, generator=g)
    pos = torch.cat([torch.randperm(850, generator=g)[:120].sort().values, torch.arange(850, 900)])
    q = torch.randn(9, pos.numel(), 64, generator=g)
    fast = AttentionPlan(pos, torch.float32, None, 3, native.positional_attention())
    slow = AttentionPlan(pos, torch.float32, None, 3)
    assert fast.kernel is not None and not fast.buckets and slow.buckets
    assert torch.allclose(fast(q, k, v, 0.125), slow(q, k, v, 0.125), atol=2e-6)
    assert AttentionPlan(pos, torch.bfloat16, None, 3, native.positional_attention()).kernel is None


def test_key_slices_keep_both_cores_busy():
    assert native.key_slices(3, 3800, threads=2) == 4  # 12 items, 6 a thread
    assert native.key_slices(2, 3800, threads=2) == 4
    assert native.key_slices(3, 600, threads=2) == 2  # at least 256 keys a slice
    assert native.key_slices(3, 10, threads=2) == 1


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2-window", "qwen3"])
def test_engine_tokens_equal_with_and_without_the_kernel(tmp_path, default_model_dir, family):
    folder = make_tiny_model(tmp_path / family, family, default_model_dir)
    fast = Engine.load(folder, store="memory")
    plain = Engine.load(folder, store="memory", native_attention=False)
    assert (fast.decoder.attention, plain.decoder.attention) == ("native", "PyTorch")
    for method in ("full", "blend"):
        a = plain.generate(QUERY, PASSAGES, method=method, max_new_tokens=16, ignore_eos=True)
        b = fast.generate(QUERY, PASSAGES, method=method, max_new_tokens=16, ignore_eos=True)
        assert b.token_ids == a.token_ids


@needs_kernel
def test_default_model_tokens_equal_with_and_without_the_kernel(default_engine):
    """SmolLM2 in float32, past the split-key threshold (512 keys), on a long prompt: the
    prefill kernel rounds differently from PyTorch's, so the logits are close, not equal."""
    plain = Engine.load(default_engine.model_dir, store="memory", native_attention=False)
    assert default_engine.decoder.attention == "native"
    passages = [p * 6 for p in PASSAGES]
    for e in (default_engine, plain):
        e.ingest(passages)
    a = plain.generate(QUERY, passages, max_new_tokens=12, ignore_eos=True)
    b = default_engine.generate(QUERY, passages, max_new_tokens=12, ignore_eos=True)
    assert a.stats.prompt_tokens > 600
    assert b.token_ids == a.token_ids
    assert torch.allclose(a.first_token_logits, b.first_token_logits, atol=1e-3)


def test_the_setting_is_checked():
    with pytest.raises(CacheBlendError, match="native_attention must be True or False"):
        EngineConfig(native_attention="yes")  # type: ignore[arg-type]


def test_without_a_compiler_the_engine_decodes_with_pytorch(tmp_path, default_model_dir):
    """A machine without a C++ compiler: the default engine logs why and answers with
    PyTorch's kernel; asking for the kernel outright is an error naming the cause."""
    folder = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    code = (
        "import logging, sys; logging.basicConfig(level=logging.WARNING)\n"
        "from cacheblend import Engine, CacheBlendError\n"
        f"e = Engine.load({str(folder)!r}, store='memory')\n"
        "assert e.decoder.attention == 'PyTorch', e.decoder.attention\n"
        "print(e.generate('Who?', ['A passage.'], max_new_tokens=4, ignore_eos=True).token_ids)\n"
        "try:\n"
        f"    Engine.load({str(folder)!r}, store='memory', native_attention=True)\n"
        "except CacheBlendError as err:\n"
        "    print('refused:', err)\n"
    )
    env = {**os.environ, "CXX": "/nonexistent/c++", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "native attention kernels are off" in out.stderr
    assert "refused: native_attention=True, but the native attention kernels cannot run" in out.stdout
    assert "no C++ compiler" in out.stdout or "AVX-512" in out.stdout


def test_the_build_folder_follows_the_kernel_sources(tmp_path, monkeypatch):
    """ninja rebuilds by timestamps: a source edited but older than the cached build (a
    rollback, ``cp -p``, a Docker copy) kept the old kernels.  The folder now names the
    sources' digest, so other sources build anew."""
    copies = []
    for source in native.SOURCES:
        copy = tmp_path / source.name
        copy.write_bytes(source.read_bytes())
        copies.append(copy)
    monkeypatch.setattr(native, "SOURCES", copies)
    before = native.build_dir()
    stat = copies[0].stat()
    copies[0].write_bytes(copies[0].read_bytes() + b"\n// changed\n")
    os.utime(copies[0], ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and dated as before
    assert native.build_dir() != before



def test_every_source_and_header_of_the_build_names_its_folder():
    """A header left out of ``SOURCES`` would change the kernels without moving the build
    folder, so a cached module built from the old header would keep being loaded."""
    folder = Path(native.__file__).parent
    on_disk = {p.name for p in folder.iterdir() if p.suffix in (".cpp", ".h")}
    assert on_disk == {s.name for s in native.SOURCES}

@needs_kernel
def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_one():
    """PyTorch's build lock is a plain file it waits on for ever: a build killed mid-way left
    it, and every later process hung in ``Decoder.__init__``."""
    code = (
        "from cacheblend import native\n"
        "folder = native.build_dir(); folder.mkdir(parents=True, exist_ok=True)\n"
        "(folder / 'lock').touch()  # as a killed build leaves it\n"
        "print('built:', native.layer_ops() is not None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0 and "built: True" in out.stdout, out.stderr[-2000:]
