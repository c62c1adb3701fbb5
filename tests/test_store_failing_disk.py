"""Disks failing for real, in child processes so that nothing reaches pytest: a disk that
fails while its index heals (the fault run's failures on a clean-clone CI) degrades to
serving read-only, it never raises into a request (a file-size limit makes it fail); and
writers killed with SIGKILL mid-write leave nothing unaccounted (issue 14, item 10)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

from cacheblend.store import DiskStore
from conftest import kill_mid_write

# A child process's start (the file-size limit it sets must not reach pytest): a store
# at argv[1], and random K/V to fill it with.
CHILD_STORE = """
import resource, signal, sys
from pathlib import Path
import torch
from cacheblend.store import ChunkKV, DiskStore
from cacheblend.store.disk_index import DiskIndex

root = Path(sys.argv[1])
def kv(i):
    g = torch.Generator().manual_seed(i)
    return ChunkKV(torch.randn(4, 2, 50, 16, generator=g), torch.randn(4, 2, 50, 16, generator=g), {})
key = lambda i: f"{i + 1:064x}"
store = DiskStore(root)
"""

FOLLOW_ON_A_FAILING_DISK = CHILD_STORE + """
for i in range(3):
    store.put(key(i), kv(i))
for suffix in ("", "-wal", "-shm"):  # another process healed: the old index aside, a new empty one in place
    Path(f"{root}/index.sqlite3{suffix}").replace(f"{root}/aside{suffix}")
DiskIndex(root, scan=list).close()  # the healer's new index, still empty
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # from here no file may grow: SQLite's writes fail
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
got = store.get(key(1))
print(got is not None, store.put(key(5), kv(5)), len(store), store.index.read_only)
"""


def test_a_disk_that_fails_while_following_a_healed_index_degrades(tmp_path):
    """The fault run's failure (a clean-clone CI run): a process that follows an index another one
    healed must open it, and the disk may fail right then ("database or disk is full",
    "disk I/O error").  That error escaped the request as a raw OperationalError; now the
    tier serves its entries read-only and skips the write.  A file-size limit makes the
    disk fail for real, in a child process."""
    out = subprocess.run([sys.executable, "-c", FOLLOW_ON_A_FAILING_DISK, str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "False", "3", "True"], out.stdout + out.stderr[-2000:]
    assert "serving read-only" in out.stderr


HEAL_ON_A_FAILING_DISK = CHILD_STORE + """
for i in range(300):  # enough rows that the rebuilt index outgrows the limit below
    store.put(key(i), kv(i % 3))
store.index.close()  # checkpointed: the rows live in the file
index = root / "index.sqlite3"
with open(index, "r+b") as f:  # every page after the first overwritten, as after a torn write
    for page in range(1, index.stat().st_size // 4096):
        f.seek(page * 4096 + 100)
        f.write(bytes([0xFF]) * 512)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # from here no file grows past 64 KB: the rebuild fails
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
again = DiskStore(root)
got = again.get(key(1))
print(got is not None, again.put(key(400), kv(0)), len(again), again.index.read_only)
"""


def test_a_damaged_index_that_cannot_be_rebuilt_on_disk_is_rebuilt_in_memory(tmp_path):
    """The index is damaged and the disk fails while the new one is filled (the fault run:
    'database or disk is full' escaped the request as a raw OperationalError).  The new file
    opens, so the heal got past the move aside and then raised from the fill; now the tier
    rebuilds the index in memory and serves its entries read-only."""
    out = subprocess.run([sys.executable, "-c", HEAL_ON_A_FAILING_DISK, str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "False", "300", "True"], out.stdout + out.stderr[-2000:]
    assert "cannot be rebuilt" in out.stderr


# -- 10. killed writers in earnest ----------------------------------------------------------
_WRITER = """
import sys, torch
from cacheblend.store import ChunkKV, DiskStore
store = DiskStore(sys.argv[1])
kv = ChunkKV(torch.randn(16, 8, 1024, 64), torch.randn(16, 8, 1024, 64))
print("ready", flush=True)
i = 0
while True:
    store.put(f"{i % 7 + 1:064x}", kv)
    i += 1
"""


def test_kill_9_during_writes_leaves_nothing_unaccounted(tmp_path):
    root = tmp_path / "kv"
    DiskStore(root)
    for _ in range(4):
        kill_mid_write(_WRITER, root, "??/.tmp-*")
    time.sleep(2.1)  # past the grace a just-created temp file gets
    store = DiskStore(root)  # temp files and the killed writers' reservations go at open
    assert not list(root.glob("??/.tmp-*")) and store.stats()["reclaimed_bytes"] > 0
    on_disk = sum(p.stat().st_size for p in root.glob("??/*.safetensors"))
    assert store.nbytes == on_disk
    assert store.verify()["stale_index_rows"] == 0 and store.corrupt == 0
    shutil.rmtree(root)
