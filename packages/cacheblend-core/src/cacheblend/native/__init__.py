"""Kernels of our own, compiled from C++ on first use and cached on disk.

Two attention kernels (docs/internals/latency.md says what each replaced and why):

* ``decode_attention.cpp``: a decode step's attention.  It reads every cached K and V once;
  PyTorch's CPU flash kernel does that at about half the machine's memory bandwidth when
  the query block is a single token's 3 grouped heads.
* ``positional_attention.cpp``: prefill attention of query rows at sorted positions (full
  prefill, and a blend's scattered recomputed rows) in float32.  PyTorch's causal kernel
  only takes contiguous positions, so a blend's rows went through masked buckets.
* ``layer_ops.cpp``: a layer's elementwise parts in float32 or bfloat16 (RMSNorm, RoPE, SiLU
  gate times up), one pass each where PyTorch's CPU ops make several passes and temporaries.  RoPE and
  the gate compute PyTorch's own expressions (the same bits); the norm sums in another
  order (the last bit can differ).

The kernels are built with PyTorch's own extension builder (``torch.utils.cpp_extension``,
ninja and the system's C++ compiler) into ``$CACHEBLEND_HOME/extensions`` the first time a
process asks for them on this machine (about 30 s on 2 cores), and loaded from there afterwards (under a
second).  They are written for AVX-512 and for AVX2 with FMA (``simd.h``: the same
kernels, with register tiles sized for each), and built for whichever of the two PyTorch
reports for this CPU.  Where the CPU has neither, or no compiler is found, or the build
fails, the module says why once and hands out None, and the engine keeps PyTorch's
kernels: a slower answer, never a failed request.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shlex
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..models.loader import cache_home

log = logging.getLogger("cacheblend.native")

# q [H, 1, hd], k and v [KVH, capacity, hd] (rows contiguous), n keys, scale, key slices per head
DecodeAttention = Callable[[Tensor, Tensor, Tensor, int, float, int], Tensor]
# q [H, m, hd], k and v [KVH, n, hd], q_pos [m] sorted int64, scale, window (0: none) -> [H, m, hd]
PositionalAttention = Callable[[Tensor, Tensor, Tensor, Tensor, float, int], Tensor]


@dataclass(frozen=True)
class LayerOps:
    """The layer pieces of ``layer_ops.cpp``, float32 or bfloat16 (shapes in its comments)."""

    rms_norm: Callable[[Tensor, Tensor, float], Tensor]  # x [n, d], weight [d], eps -> [n, d]
    rope: Callable[[Tensor, Tensor, Tensor], Tensor]  # x [heads, n, hd], cos, sin [n, hd] -> contiguous
    rope_into: Callable[[Tensor, Tensor, Tensor, Tensor], None]  # out, x (both [heads, n, hd]), cos, sin
    silu_mul: Callable[[Tensor, Tensor], Tensor]  # gate, up [n, I] -> silu(gate) * up
    # out_k, out_v (one layer of the fused cache), starts, Ks, Vs, dKs, dVs (one per span), cos, sin
    reposition: Callable[..., None]


HEAD_DIMS = (16, 32, 64, 128)
DTYPES = (torch.float32, torch.bfloat16)
# -fopenmp: ATen's parallel_for is inline OpenMP (without it the kernel runs on one thread).
# Explicit ISA flags rather than -march=native, so a build cached on a shared home directory
# runs on any CPU of its ISA; CPU_CAPABILITY_<ISA> selects ATen's vector types of that width
# (what PyTorch's own kernels use on this CPU).
# -ffp-contract=off: a product is never fused into a sum unless the source says so, so the
# bits do not depend on the compiler, and RoPE matches PyTorch's separate products and sum.
_COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
}
SOURCES = [Path(__file__).with_name(f)
           for f in ("decode_attention.cpp", "positional_attention.cpp", "layer_ops.cpp", "bindings.cpp",
                     "kernels.h", "simd.h")]

_lock = threading.Lock()
BUILD_TIMEOUT_S = 600.0  # a build takes about 30 s on 2 cores; past this, PyTorch's kernels run instead
_built: dict[str, Any] = {}
_why_not: dict[str, str] = {}


def isa() -> str | None:
    """The instruction set the kernels are built for on this CPU: ``"AVX512"``, ``"AVX2"``, or
    None where PyTorch reports neither (its own kernels then run on older vector units too)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return "AVX512" if capability.startswith("AVX512") else "AVX2" if capability == "AVX2" else None


def flags(target: str | None = None) -> list[str]:
    """The compiler flags of a build for ``target`` (default: this CPU's :func:`isa`)."""
    target = target or isa()
    if target not in ISA_FLAGS:
        raise ValueError(f"no kernel build for {target!r}; one of {sorted(ISA_FLAGS)}")
    return _COMMON_FLAGS + ISA_FLAGS[target]


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here (None: it can be built)."""
    if isa() is None:
        return f"the CPU has neither AVX-512 nor AVX2 (PyTorch reports {torch.backends.cpu.get_cpu_capability()})"
    compiler = shlex.split(os.environ.get("CXX", "c++")) or ["c++"]  # "ccache g++": the compiler is the wrapper
    if shutil.which(compiler[0]) is None:
        return "no C++ compiler (c++ or $CXX) on PATH"
    try:
        import ninja  # noqa: F401 - the builder's tool; its binary goes on PATH below
    except ImportError:
        return "the ninja package is not installed"
    return None


def build_dir() -> Path:
    """Where built kernels are cached: one folder per PyTorch installation (its version and
    where it is installed) and per kernel source.  Why the place too: the build names the
    installation's include and library folders, so two environments with the same PyTorch
    version (an app's and a vLLM server's) sharing one folder would rebuild each other's
    module at every switch, and could overwrite a module another process is loading.  Why
    the sources: ninja rebuilds by timestamps, so a source older than the cached build (a
    rollback, ``cp -p``, a tar or Docker copy) kept the old kernels, and two checkouts
    sharing a cache rebuilt each other's."""
    where = hashlib.sha256(str(Path(torch.__file__).resolve().parent).encode()).hexdigest()[:10]
    source = hashlib.sha256(" ".join(_COMMON_FLAGS + ISA_FLAGS.get(isa() or "", [])).encode())
    for path in SOURCES:
        source.update(path.read_bytes())
    return cache_home() / "extensions" / f"torch-{torch.__version__}-{where}-{source.hexdigest()[:10]}"


def _module() -> Any:
    """The built module, built or loaded once per process; None where it cannot run (the
    reason is logged once)."""
    with _lock:
        if "module" not in _built:
            _built["module"] = _build()
        return _built["module"]


def decode_attention() -> DecodeAttention | None:
    """The decode-step kernel; None where the kernels cannot run here."""
    module = _module()
    return None if module is None else module.decode_attention  # type: ignore[no-any-return]


def positional_attention() -> PositionalAttention | None:
    """The prefill kernel (float32, head_dim in :data:`HEAD_DIMS`); None where the kernels
    cannot run here."""
    module = _module()
    return None if module is None else module.positional_attention  # type: ignore[no-any-return]


def layer_ops() -> LayerOps | None:
    """The layer pieces (float32, bfloat16); None where the kernels cannot run here."""
    module = _module()
    return None if module is None else LayerOps(module.rms_norm, module.rope, module.rope_into, module.silu_mul,
                                                   module.reposition)


def last_failure() -> str | None:
    """Why the last build was refused or failed (None: it was built, or never tried)."""
    return _why_not.get("module")


def _build() -> Any:
    reason = unavailable_reason()
    if reason is None:
        try:
            import ninja
            from torch.utils import cpp_extension

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
            folder = build_dir()
            folder.mkdir(parents=True, exist_ok=True)
            with _builder(folder):
                return cpp_extension.load("cacheblend_native", [str(f) for f in SOURCES if f.suffix == ".cpp"],
                                          extra_cflags=flags(), extra_include_paths=[str(Path(__file__).parent)],
                                          build_directory=str(folder), verbose=False)
        except Exception as e:  # noqa: BLE001 - any build failure: PyTorch's kernel runs instead
            reason = f"building it failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    _why_not["module"] = reason
    log.warning("cacheblend: the native attention kernels are off: %s; using PyTorch's", reason)
    return None


@contextlib.contextmanager
def _builder(folder: Path, timeout_s: float = BUILD_TIMEOUT_S) -> Iterator[None]:
    """The right to build in ``folder``, one process at a time.  PyTorch's own build lock is
    a plain file (``lock``) that it waits on with no timeout: a build killed mid-way (the OOM
    killer, SIGKILL) left it behind, and every later process hung for good.  This lock is an
    ``flock``, released by the OS when its holder dies; whoever holds it knows any ``lock``
    file is a dead builder's, and removes it."""
    with open(folder / ".cacheblend-build.lock", "w") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building the kernels for {timeout_s:.0f} s") \
                        from None
                time.sleep(0.5)
        try:
            (folder / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


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
