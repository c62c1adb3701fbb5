"""benchmarks/guard_sweep.py: the guard replayed from a study's samples, one study per
model side by side, and the pair of limits picked by the rule the defaults were picked by
(best worst-study agreement among the pairs under an escalation cap)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = "blend@0.15:max_exposure=1"


def _study(path: Path, prompts: list[tuple[float, float, float]]) -> Path:
    """One study: per prompt (risk, exposure, agree) of the base blend, at a fixed 5x speed-up."""
    samples = []
    for i, (risk, exposure, agree) in enumerate(prompts):
        samples.append({"dataset": "musique", "example": i, "variant": "full", "agree": 1.0, "kl": 0.0,
                        "ttft_s": 5.0, "risk": 0.0, "exposure": 0.0})
        samples.append({"dataset": "musique", "example": i, "variant": BASE, "agree": agree,
                        "kl": 0.0 if agree else 0.5, "ttft_s": 1.0, "risk": risk, "exposure": exposure})
    path.write_text(json.dumps({"study": {}, "samples": samples}))
    return path


def _sweep(*args: str) -> str:
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "guard_sweep.py"), *args, "--base", BASE],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_the_pair_is_chosen_by_the_worst_study_under_the_cap(tmp_path):
    # Model a: its one miss is a near-tie (risk 0.97), caught by max_risk 0.95 alone.
    a = _study(tmp_path / "a.json", [(0.97, 0.001, 0.0)] + [(0.3, 0.01, 1.0)] * 9)
    # Model b: its one miss is confident (risk 0.5) with a high exposure (risk x exposure 0.05).
    b = _study(tmp_path / "b.json", [(0.5, 0.1, 0.0), (0.97, 0.001, 1.0)] + [(0.3, 0.01, 1.0)] * 8)
    out = _sweep(str(a), str(b), "--max-exposure", "0.02", "--max-escalated", "0.25")
    # 0.95 with 0.02 catches both misses at 10 % and 20 % escalated; every lower max_risk
    # escalates nothing more useful and 1.0 leaves a's near-tie.
    assert "chosen (at most 25% escalated in every study): max_risk=0.95, max_exposure=0.02" in out
    assert out.count("a  ") > 0 and out.count("b  ") > 0  # one row per study


def test_a_cap_that_rules_out_every_escalation_leaves_the_blend_unguarded(tmp_path):
    a = _study(tmp_path / "a.json", [(0.99, 0.5, 0.0)] * 10)
    out = _sweep(str(a), "--max-exposure", "0.02", "--max-escalated", "0.5")
    assert "chosen (at most 50% escalated in every study): max_risk=1.0, max_exposure=None" in out
