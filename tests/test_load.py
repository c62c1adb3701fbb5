"""The short version of the load benchmark (benchmarks/load.py): a few requests at one
rate against plain vLLM and vLLM with the CacheBlend connector through a stock OpenAI
client; every request answers, the report and the plot are written, and blending answers
first sooner than plain vLLM's full prefill.  The benchmark's ``cacheblend-remote`` mode
is left to full runs: CI's minutes are dear, and RemoteEngine against the connector's
server is what tests/test_remote.py covers.  Three passages a request, from one example's
ten, and ten seconds of arrivals keep it to about half of the run with six passages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("CACHEBLEND_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def test_short_load_run_answers_every_request_and_blends_faster(tmp_path):
    """Also: the run's chunk store goes when it ends (it used to stay in the temp folder,
    273 MB a run); the servers' logs and the connector's stats stay in ``--out``."""
    if not VLLM_PYTHON.exists():
        if os.environ.get("CACHEBLEND_REQUIRE_VLLM") == "1":
            pytest.fail(f"{VLLM_PYTHON} is missing: `make vllm` builds the vLLM venv")
        pytest.skip("no vLLM venv (make vllm)")
    temp = tmp_path / "tmp"
    temp.mkdir()
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "load.py"), "--modes", "plain,cacheblend-openai",
         "--rates", "6", "--duration", "10", "--pool", "1", "--passages", "3", "--idle", "2", "--tokens", "4",
         "--vllm-python", str(VLLM_PYTHON), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(temp)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert not list(temp.glob("cacheblend-load-*"))
    out = tmp_path / "out"
    assert (out / "vllm-plain.log").stat().st_size > 0 and (out / "stats.jsonl").stat().st_size > 0
    report = json.loads((out / "load.json").read_text())
    assert (out / "ttft_vs_rate.png").stat().st_size > 0
    modes = {m["mode"]: m for m in report["modes"]}
    assert list(modes) == ["plain", "cacheblend-openai"]
    for m in modes.values():
        (rate,) = m["rates"]
        assert rate["sent"] >= 1 and rate["failed"] == 0 and rate["completed"] == rate["sent"], m
        assert m["idle"]["n"] == 2 and not m["idle"]["errors"], m["idle"]
    plain = modes["plain"]["idle"]["ttft_p50_s"]
    assert modes["cacheblend-openai"]["idle"]["ttft_p50_s"] < plain, (modes["cacheblend-openai"]["idle"], plain)
    assert report["target"]["ttft_bound_s"] == pytest.approx(2 * modes["plain"]["idle"]["ttft_p90_s"], rel=1e-3)
