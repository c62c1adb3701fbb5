"""The short version of the fault-injection run (benchmarks/faults.py): two clients on
a shared disk + Redis store for half a minute while every kind of fault is injected."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def test_no_wrong_answer_crash_or_lost_entry_under_faults(tmp_path, default_model_dir):
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (make test installs it: scripts/ensure-redis.sh)")
    model = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    out = tmp_path / "faults.json"
    temp = tmp_path / "tmp"
    temp.mkdir()
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "faults.py"), "--clients", "2", "--minutes", "0.6",
                          "--interval", "2.5", "--model", str(model), "--out", str(out)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": str(temp)})
    assert out.exists(), run.stderr[-3000:]
    assert not list(temp.glob("cacheblend-faults-*"))  # the run's folder goes (it used to stay)
    report = json.loads(out.read_text())
    assert report["served"] > 20 and report["generate"] > 10, report
    assert report["wrong_answers"] == 0, json.dumps({k: report[k] for k in ("wrong", "events")})
    assert report["failed_requests"] == 0, report["errors"]
    assert report["client_crashes"] == 0 and report["after"]["entries_lost"] == 0, report
    assert all(report["faults"][k] >= 1 for k in ("kill", "redis", "damage", "index")), report
    assert run.returncode == 0
