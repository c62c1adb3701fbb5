"""Blend TTFT with chunk caches in memory, on disk and in Redis, side by side in one run.

CacheBlend's claim (paper §5) is that with pipelined, layer-wise loading the recompute of
each layer hides the loading of the next, so a slower, cheaper tier costs (almost) no
TTFT.  Every tier but memory is read both ways, pipelined and serial (layers read before
they are fused), interleaved prompt by prompt.  This machine cannot drop the page cache
(writes to /proc/sys/vm/drop_caches have no effect in its sandbox), so the disk tier is
also measured through a reader throttled to a stated SSD bandwidth; the unthrottled disk
row reads from the page cache.

    .venv/bin/python benchmarks/store_tiers.py --limit 6 --ssd-gbps 2.0

Needs redis-server on PATH (scripts/ensure-redis.sh); it starts its own on loopback.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from tqdm import tqdm

from cacheblend import Engine
from cacheblend.datasets import QA_PREAMBLE, load_qa
from cacheblend.store import DiskStore, MemoryStore, RedisStore


class ThrottledSource:
    """Reads layers no faster than ``bytes_per_s`` (an SSD's sequential read rate)."""

    def __init__(self, inner, bytes_per_s: float) -> None:
        self._inner, self._bps = inner, bytes_per_s
        self.num_layers, self.num_tokens, self.meta = inner.num_layers, inner.num_tokens, inner.meta
        self.tier = "disk-throttled"

    def layer(self, index: int):
        t = time.perf_counter()
        k, v = self._inner.layer(index)
        need = (k.numel() * k.element_size() * 2) / self._bps
        left = need - (time.perf_counter() - t)
        if left > 0:
            time.sleep(left)
        return k, v


class ThrottledDisk:
    """A disk tier whose reads are throttled; writes and the rest pass through."""

    def __init__(self, disk: DiskStore, bytes_per_s: float) -> None:
        self.disk, self.bps = disk, bytes_per_s

    def open(self, key):
        source = self.disk.open(key)
        return None if source is None else ThrottledSource(source, self.bps)

    def __getattr__(self, name):
        return getattr(self.disk, name)


def start_redis(folder: str) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server not found: run scripts/ensure-redis.sh")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly",
                             "no", "--dir", folder], stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}/0"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="musique")
    ap.add_argument("--data", default=None, metavar="DIR", help="the data directory; default: $CACHEBLEND_DATA")
    ap.add_argument("--split", default="dev", choices=["dev", "test"])
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--passages", type=int, default=6)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--ssd-gbps", default="2.0,0.5", help="throttled disk read bandwidths, GB/s, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="time only the rows whose names start with one of these "
                    "comma-separated words (memory is always timed: the baseline), e.g. 'redis'")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    work = tempfile.mkdtemp(prefix="cb-tiers-")
    redis_proc, url = start_redis(work)
    try:
        memory, disk, remote = MemoryStore(), DiskStore(os.path.join(work, "kv")), RedisStore(url)
        # Every tier but memory twice: layers read beside the fusor (pipelined) and before it
        # (serial), interleaved prompt by prompt (the engine's default picks one by cores).
        # A serial read under a request timeout runs on the loader's thread while the fusor
        # waits (so a hung read cannot hold the request): "serial, timeout" times that hand-off.
        stores = {"memory": memory, "disk (page cache), pipelined": disk, "disk (page cache), serial": disk,
                  "disk (page cache), serial, timeout": disk}
        for gbps in (float(x) for x in args.ssd_gbps.split(",")):
            stores[f"disk @{gbps:g} GB/s, pipelined"] = ThrottledDisk(disk, gbps * 1e9)
            stores[f"disk @{gbps:g} GB/s, serial"] = ThrottledDisk(disk, gbps * 1e9)
        stores["redis (loopback), pipelined"] = remote
        stores["redis (loopback), serial"] = remote
        stores["redis (loopback), serial, timeout"] = remote
        wanted = tuple(w.strip() for w in args.only.split(",") if w.strip())
        if wanted:
            stores = {n: st for n, st in stores.items() if n == "memory" or n.startswith(wanted)}
        engine = Engine.load(store=memory)
        examples = load_qa(args.dataset, args.split, limit=args.limit, passages=args.passages, data=args.data)
        rows = {name: {"ttft": [], "exposed": [], "hidden": []} for name in stores}
        for ex in tqdm(examples, desc="examples", file=sys.stderr):
            engine.store = memory
            handles = engine.ingest(ex.passages)
            prefix = engine.generate(ex.query, handles, preamble=QA_PREAMBLE, max_new_tokens=1)  # system prefix
            # every entry the memory tier holds (the chunks and the system prefix)
            for key in [h.key for h in handles] + memory.keys():
                kv = memory.get(key)
                disk.put(key, kv)
                remote.put(key, kv)
            del prefix
            for name, store in stores.items():
                engine.store = store
                engine.chunks.prefetch = name.endswith("pipelined")
                r = engine.generate(ex.query, handles, preamble=QA_PREAMBLE, recompute_ratio=args.ratio,
                                    max_new_tokens=1, timeout=600.0 if name.endswith("timeout") else None)
                assert r.stats.store_misses == 0, (name, r.stats)
                rows[name]["ttft"].append(r.ttft_s)
                rows[name]["exposed"].append(r.stats.seconds["load_exposed"])
                rows[name]["hidden"].append(r.stats.seconds["load_hidden"])
        base = statistics.median(rows["memory"]["ttft"])
        print(f"\nblend@{args.ratio:g}, {args.dataset} {args.split}: {len(examples)} prompts x {args.passages} "
              f"passages, {args.threads} threads on {len(os.sched_getaffinity(0))} cores, model {engine.model_name}")
        print(f"{'chunks from':<34}{'median TTFT s':>14}{'vs memory':>11}{'load exposed s':>16}{'load hidden s':>15}")
        for name, row in rows.items():
            med = statistics.median(row["ttft"])
            print(f"{name:<34}{med:>14.3f}{(med / base - 1):>+10.1%}{statistics.median(row['exposed']):>16.3f}"
                  f"{statistics.median(row['hidden']):>15.3f}")
    finally:
        redis_proc.terminate()
        redis_proc.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
