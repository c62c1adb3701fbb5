"""Processes that open the same new disk stores at the same instants (a race on creating
the index), printing how many opens failed."""

from __future__ import annotations

import json
import subprocess
import sys
import time


def main(start: float, step: float, folders: list[str]) -> None:
    from cacheblend.store import DiskStore

    failed = []
    for i, folder in enumerate(folders):
        while time.time() < start + i * step:  # spin: all processes open at once
            pass
        try:
            DiskStore(folder)
        except Exception as e:  # noqa: BLE001 - reported to the test
            failed.append(f"{type(e).__name__}: {e}")
    print(json.dumps({"failed": failed}))


def open_at_once(folders: list[str], processes: int = 4, step: float = 0.25) -> list[str]:
    """Failures of ``processes`` processes each opening every folder, in lockstep."""
    start = time.time() + 12  # after every process has imported torch
    procs = [subprocess.Popen([sys.executable, __file__, str(start), str(step), *folders], stdout=subprocess.PIPE,
                              text=True) for _ in range(processes)]
    return [f for p in procs for f in json.loads(p.communicate(timeout=300)[0].splitlines()[-1])["failed"]]


if __name__ == "__main__":
    main(float(sys.argv[1]), float(sys.argv[2]), sys.argv[3:])
