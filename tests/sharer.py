"""Processes that write, read and (optionally) delete the same few entries of one store
at once, checking every entry they read against what it must hold."""

from __future__ import annotations

import json
import subprocess
import sys


def main(spec: str, rounds: int, delete_every: int) -> None:
    import torch

    from cacheblend.store import ChunkKV, open_store

    store = open_store(spec)
    seen = bad = 0
    for i in range(rounds):
        key = f"{i % 5:064x}"
        g = torch.Generator().manual_seed(i % 5)
        want = ChunkKV(torch.randn(6, 2, 300, 16, generator=g), torch.randn(6, 2, 300, 16, generator=g))
        if i % 2:
            store.put(key, want)
        got = store.get(key)
        if got is not None:
            seen += 1
            bad += not (torch.equal(got.k, want.k) and torch.equal(got.v, want.v))
        if delete_every and i % delete_every == 0:
            store.delete(key)
    print(json.dumps({"seen": seen, "bad": bad, "corrupt": store.corrupt}))


def run_sharers(spec: str, processes: int = 2, rounds: int = 60, delete_every: int = 0) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, __file__, spec, str(rounds), str(delete_every)],
                              stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    return [json.loads(p.communicate(timeout=300)[0].splitlines()[-1]) for p in procs]


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
