"""Kernels of our own, compiled from C++ on first use and cached on disk.

One so far: a decode step's attention (``decode_attention.cpp``).  A decode step reads every
cached K and V once; PyTorch's CPU flash kernel does that at about half the machine's memory
bandwidth when the query block is a single token's 3 grouped heads (docs/internals/latency.md).

The kernel is built with PyTorch's own extension builder (``torch.utils.cpp_extension``,
ninja and the system's C++ compiler) into ``$CACHEBLEND_HOME/extensions`` the first time a
process asks for it on this machine (about 20 s), and loaded from there afterwards (under a
second).  It needs AVX-512; where the CPU lacks it, or no compiler is found, or the build
fails, :func:`decode_attention` says why once and returns None, and the decode step keeps
PyTorch's kernel: a slower token, never a failed request.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from ..models.loader import cache_home

log = logging.getLogger("cacheblend.native")

# q [H, 1, hd], k and v [KVH, capacity, hd] (rows contiguous), n keys, scale, key slices per head
DecodeAttention = Callable[[Tensor, Tensor, Tensor, int, float, int], Tensor]

HEAD_DIMS = (16, 32, 64, 128)
DTYPES = (torch.float32, torch.bfloat16)
# -fopenmp: ATen's parallel_for is inline OpenMP (without it the kernel runs on one thread).
# Explicit ISA flags rather than -march=native, so a build cached on a shared home directory
# runs on any AVX-512 CPU; CPU_CAPABILITY_AVX512 selects ATen's AVX-512 vector types.
_FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
          "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"]
_SOURCE = Path(__file__).with_name("decode_attention.cpp")

_lock = threading.Lock()
_built: dict[str, DecodeAttention | None] = {}
_why_not: dict[str, str] = {}


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here (None: it can be built)."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return f"the CPU has no AVX-512 (PyTorch reports {torch.backends.cpu.get_cpu_capability()})"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++ or $CXX) on PATH"
    try:
        import ninja  # noqa: F401 - the builder's tool; its binary goes on PATH below
    except ImportError:
        return "the ninja package is not installed"
    return None


def build_dir() -> Path:
    """Where built kernels are cached: one folder per PyTorch version (ABI)."""
    return cache_home() / "extensions" / f"torch-{torch.__version__}"


def decode_attention() -> DecodeAttention | None:
    """The compiled kernel, built or loaded once per process; None where it cannot run (the
    reason is logged once)."""
    with _lock:
        if "decode_attention" not in _built:
            _built["decode_attention"] = _build()
        return _built["decode_attention"]


def last_failure() -> str | None:
    """Why the last build was refused or failed (None: it was built, or never tried)."""
    return _why_not.get("decode_attention")


def _build() -> DecodeAttention | None:
    reason = unavailable_reason()
    if reason is None:
        try:
            import ninja
            from torch.utils import cpp_extension

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
            folder = build_dir()
            folder.mkdir(parents=True, exist_ok=True)
            module = cpp_extension.load("cacheblend_decode_attention", [str(_SOURCE)], extra_cflags=_FLAGS,
                                        build_directory=str(folder), verbose=False)
            return module.decode_attention  # type: ignore[no-any-return]
        except Exception as e:  # noqa: BLE001 - any build failure: PyTorch's kernel runs instead
            reason = f"building it failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    _why_not["decode_attention"] = reason
    log.warning("cacheblend: the native decode attention is off: %s; using PyTorch's kernel", reason)
    return None


def fits(shape_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel handles a model's cache: float32 or bfloat16, a head_dim of :data:`HEAD_DIMS`."""
    return shape_dtype in DTYPES and head_dim in HEAD_DIMS


def key_slices(kv_heads: int, keys: int, threads: int | None = None) -> int:
    """Slices of the keys per KV head: enough work items for about four per thread, a
    multiple of the threads (so no core idles at the end), each at least 256 keys."""
    threads = threads or torch.get_num_threads()
    slices = max(1, -(-4 * threads // kv_heads))
    while (kv_heads * slices) % threads:
        slices += 1
    return max(1, min(slices, 64, keys // 256))
