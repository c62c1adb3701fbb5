"""benchmarks/fidelity_merge.py: studies run one data set at a time pool into one report,
and an earlier study's variants join a new one on the same prompts (renamed, their speed-up
kept against their own full prefill), unless full prefill disagrees between the two."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STUDY = {"split": "test", "model": "m", "chunks": 6, "chunk_sink": "bos", "baselines": ["blend@0.15"]}


def _sample(example: int, variant: str, ttft: float, agree: float = 1.0, kl: float = 0.0,
            margin: float = 0.5) -> dict:
    return {"dataset": "musique", "example": example, "variant": variant, "agree": agree, "kl": kl, "p_full": 0.5,
            "margin": margin, "output_f1": 1.0, "quality": 0.0, "ttft_s": ttft, "ratio_used": 0.15, "risk": 0.5,
            "escalated": False, "exact": False}


def _write(path: Path, samples: list[dict]) -> Path:
    path.write_text(json.dumps({"study": STUDY, "samples": samples, "seconds": 60.0}))
    return path


def _merge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fidelity_merge.py"), *args],
                          capture_output=True, text=True, timeout=300)


def test_an_earlier_study_joins_renamed_with_its_own_speed_up(tmp_path):
    new = _write(tmp_path / "new.json", [s for i in range(4) for s in (
        _sample(i, "full", 10.0, margin=0.1 * i), _sample(i, "blend@0.15", 2.0, kl=0.01))])
    old = _write(tmp_path / "old.json", [s for i in range(5) for s in (  # one prompt the new study lacks
        _sample(i, "full", 20.0, margin=0.1 * i), _sample(i, "blend@0.15", 5.0, agree=0.0, kl=0.2))])
    run = _merge(str(new), "--earlier", str(old), "--rename", "blend@0.15=blend@0.15:shift_share=0",
                 "--baselines", "blend@0.15:shift_share=0", "--json", str(tmp_path / "out.json"))
    assert run.returncode == 0, run.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    old_rows = [s for s in out["samples"] if s["variant"] == "blend@0.15:shift_share=0"]
    assert len(old_rows) == 4 and len([s for s in out["samples"] if s["variant"] == "full"]) == 4
    assert all(s["ttft_s"] == 2.5 for s in old_rows)  # 5 s against its own 20 s full: 4x, kept
    pooled = {r["variant"]: r for r in out["study"]["all"]}
    assert pooled["blend@0.15:shift_share=0"]["speedup_median"] == pytest.approx(4.0)
    assert pooled["blend@0.15"]["vs"]["blend@0.15:shift_share=0"]["kl"]["mean"] == pytest.approx(-0.19)


def test_a_full_prefill_that_differs_stops_the_merge(tmp_path):
    new = _write(tmp_path / "new.json", [_sample(0, "full", 10.0, margin=0.3), _sample(0, "blend@0.15", 2.0)])
    old = _write(tmp_path / "old.json", [_sample(0, "full", 10.0, margin=0.2), _sample(0, "blend@0.15", 2.0)])
    run = _merge(str(new), "--earlier", str(old), "--rename", "blend@0.15=old")
    assert run.returncode != 0 and "not the same prompt" in run.stderr
    clash = _merge(str(new), "--earlier", str(_write(tmp_path / "same.json", [_sample(0, "full", 10.0, margin=0.3),
                                                                             _sample(0, "blend@0.15", 2.0)])))
    assert clash.returncode != 0 and "--rename it" in clash.stderr


def test_a_variant_name_with_an_equals_sign_is_renamed(tmp_path):
    """``--rename blend@0.15:shift_share=0=hkvd`` renames that variant (the split at its
    first '=' named no variant, and the merge used to stop with a clash)."""
    new = _write(tmp_path / "new.json", [_sample(0, "full", 10.0), _sample(0, "blend@0.15:shift_share=0", 2.0)])
    old = _write(tmp_path / "old.json", [_sample(0, "full", 10.0), _sample(0, "blend@0.15:shift_share=0", 4.0)])
    run = _merge(str(new), "--earlier", str(old), "--rename", "blend@0.15:shift_share=0=hkvd",
                 "--json", str(tmp_path / "out.json"))
    assert run.returncode == 0, run.stderr
    assert {s["variant"] for s in json.loads((tmp_path / "out.json").read_text())["samples"]} == {
        "full", "blend@0.15:shift_share=0", "hkvd"}
    bad = _merge(str(new), "--earlier", str(old), "--rename", "nothing=x")
    assert bad.returncode != 0 and "no earlier variant" in bad.stderr


def test_an_empty_plots_folder_writes_no_plot(tmp_path):
    """``--plots ''`` means no plot, as for ``cacheblend bench`` (an empty path used to
    become the working folder, and the merge left fidelity_frontier.png there)."""
    study = _write(tmp_path / "s.json", [_sample(0, "full", 10.0), _sample(0, "blend@0.15", 2.0)])
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fidelity_merge.py"), str(study), "--plots", ""],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert not (tmp_path / "fidelity_frontier.png").exists() and "plot:" not in run.stdout
