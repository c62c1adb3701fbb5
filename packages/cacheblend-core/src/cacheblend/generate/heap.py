"""Keep freed memory in the process for the next request (glibc's malloc settings).

Why: a prefill's temporaries are a few large tensors per layer (on a 3.8K-token SmolLM2
prompt the first layers' activations are about 9 MB each).  glibc serves blocks that large
from ``mmap`` until its dynamic threshold has grown past them, and gives freed heap memory
back to the kernel once more than twice that threshold lies free at the top.  Either way
the next request writes to fresh pages, and every first write to a page is a fault: about
10,000 of them (40 MB) per request here, 2–4 % of a blend's TTFT at 5–15 % (the same
measurement with the settings below: none, docs/internals/latency.md).

The settings are process-wide, so they come with a bound: blocks up to 32 MiB come from
the heap, and up to ``keep_mib`` of freed memory stays in the process instead of going back
to the kernel.  This is what serving stacks get from tcmalloc or jemalloc, without
preloading another allocator.  Where malloc is not glibc's (macOS, musl) nothing changes.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import threading

__all__ = ["MMAP_THRESHOLD", "keep_freed_memory"]

log = logging.getLogger("cacheblend.heap")
MMAP_THRESHOLD = 32 << 20  # glibc's largest mmap threshold on 64-bit hosts
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_lock = threading.Lock()
_kept: list[int] = [0]  # the largest keep set in this process (bytes)


def keep_freed_memory(keep_mib: int) -> bool:
    """Serve blocks up to :data:`MMAP_THRESHOLD` from the heap and keep up to ``keep_mib``
    MiB of freed memory in the process (the largest value asked in a process holds).
    Returns whether glibc's settings are in force; ``keep_mib`` 0 changes nothing."""
    if keep_mib <= 0 or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    keep = keep_mib << 20
    with _lock:
        if keep <= _kept[0]:
            return True
        try:
            libc = ctypes.CDLL("libc.so.6")
            ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, keep) == 1
        except (OSError, AttributeError) as e:
            log.warning("cacheblend: malloc's settings are unchanged (%s)", e)
            return False
        if ok:
            _kept[0] = keep
        return ok
