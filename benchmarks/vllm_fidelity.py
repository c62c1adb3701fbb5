"""First-token agreement of the vLLM connector with plain vLLM, next to the core engine's
agreement with its own full prefill, on the same musique prompts.

    HF_HUB_OFFLINE=1 .venv-vllm/bin/python benchmarks/vllm_fidelity.py --split test --limit 20 \
        --data ../shared/data --out bench-out/vllm_fidelity.json

The core engine (this process) ingests each prompt's passages into a disk store and
registers their texts; then plain vLLM answers every prompt (one greedy token), then vLLM
with the CacheBlend connector answers each prompt once per variant (``--variants``,
request options sent in ``kv_transfer_params``), returning its fidelity receipt in the
response marker.  The core runs the same variants against its full prefill.  Agreement is
reported with a 95 % bootstrap interval; the connector's guard escalations from receipts.
Each one-token request is also timed (its TTFT): the median of plain vLLM, of the
connector and of the core engine per variant, and the connector's speed-up over plain
vLLM.  Each vLLM instance first serves ``--warmup`` untimed requests (the connector, per
variant): the core engine is warm when timed, its blend right after its full prefill.
The worker's own seconds per request (its fused prefill, its paged-cache writes) come from
the connector's ``stats`` file.  ``--store redis`` puts the chunk caches in a Redis server
started here on loopback (as replicas sharing one Redis tier read them) instead of a disk
store; needs ``redis-server`` on PATH (scripts/ensure-redis.sh).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")

from cacheblend.integrations.vllm_server import all_cores_bind, kv_transfer_config  # noqa: E402

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", all_cores_bind())  # before vLLM starts its engine

from cacheblend import Engine  # noqa: E402
from cacheblend.bench.fidelity import parse_spec  # noqa: E402
from cacheblend.bench.stats import bootstrap  # noqa: E402
from cacheblend.datasets import QA_PREAMBLE, load_qa  # noqa: E402
from cacheblend.integrations.vllm import register_passages  # noqa: E402

VARIANTS = ("blend@0.15", "blend@guard")  # the default and the guard


def llm(model: str, connector: dict | None, dtype: str = "float32", compile_model: bool = False):
    """An LLM, eager unless ``compile_model`` (vLLM's default, torch.compile: slower to start);
    with ``connector`` (``kv_transfer_config(...)``), the CacheBlend connector."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    # load_format="cacheblend": the connector recomputes on vLLM's own weights (cacheblend.integrations.vllm_model)
    kw = {"kv_transfer_config": KVTransferConfig(**connector), "load_format": "cacheblend"} if connector else {}
    return LLM(model=model, dtype=dtype, enforce_eager=not compile_model, enable_prefix_caching=False,
               max_model_len=8192, max_num_batched_tokens=8192, max_num_seqs=1, seed=0, **kw)


def first_tokens(engine_llm, prompts: list[list[int]], params: dict | None) -> list[tuple[int, dict | None, float]]:
    """(first token, receipt, seconds) per prompt, one request at a time."""
    from vllm import SamplingParams, TokensPrompt

    out = []
    for ids in prompts:
        extra = {"kv_transfer_params": params} if params is not None else None
        sp = SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra)
        t = time.perf_counter()
        (res,) = engine_llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
        marker = (res.kv_transfer_params or {}).get("cacheblend") or {}
        out.append((res.outputs[0].token_ids[0], marker.get("fidelity"), time.perf_counter() - t))
    return out


def shutdown(engine_llm) -> None:
    engine_llm.llm_engine.engine_core.shutdown()
    del engine_llm
    gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", default="test", choices=["dev", "test"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="what vLLM, its connector's worker and the core engine compute in")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--chunks", type=int, default=6)
    ap.add_argument("--data", default=None, help="the data directory (default: $CACHEBLEND_DATA)")
    ap.add_argument("--out", type=Path, default=Path("bench-out/vllm_fidelity.json"))
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed requests each vLLM instance serves first (per variant for the connector): "
                         "the core engine is warm when timed, its blend following its own full prefill")
    ap.add_argument("--compile", action="store_true",
                    help="run both vLLM instances compiled (vLLM's default) instead of eager")
    ap.add_argument("--store", default="disk", choices=["disk", "redis"],
                    help="where the chunk caches are kept: a disk store, or a Redis server started here")
    ap.add_argument("--variants", default=";".join(VARIANTS),
                    help="';'-separated blend variants, written as for `cacheblend bench --fidelity-only`")
    args = ap.parse_args()
    variants = {}
    for text in args.variants.split(";"):
        spec = parse_spec(text)
        if spec.method != "blend":
            raise SystemExit(f"variant {text!r}: the connector blends; method must be blend")
        variants[spec.name] = {k: v for k, v in spec.options.items() if k != "method"}

    root = Path(tempfile.mkdtemp(prefix="cacheblend-vllm-fidelity-"))
    redis_proc = None
    if args.store == "redis":
        from store_tiers import start_redis  # this folder's helper: a loopback redis-server

        redis_proc, store = start_redis(str(root))
    else:
        store = f"disk:{root / 'kv'}"
    try:
        run(args, variants, root, store)
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait()
        shutil.rmtree(root, ignore_errors=True)  # the chunk store, passages and stats of this run


def run(args: argparse.Namespace, variants: dict[str, dict], root: Path, store: str) -> None:
    examples = load_qa("musique", args.split, limit=args.limit, passages=args.chunks, data=args.data)
    engine = Engine.load(None, store=store, dtype=args.dtype)
    prompts, core = [], {name: [] for name in variants}
    core_ttft: dict[str, list[float]] = {"full": [], **{name: [] for name in variants}}
    for ex in examples:
        handles = engine.ingest(ex.passages)
        prompts.append(engine.prompts.build(ex.query, [list(h.token_ids) for h in handles], None,
                                            QA_PREAMBLE).all_ids)
        full = engine.generate(ex.query, handles, method="full", max_new_tokens=1, preamble=QA_PREAMBLE)
        core_ttft["full"].append(full.ttft_s)
        for name, opts in variants.items():
            r = engine.generate(ex.query, handles, max_new_tokens=1, preamble=QA_PREAMBLE, **opts)
            core[name].append((float(r.token_ids[:1] == full.token_ids[:1]), r.stats.escalated))
            core_ttft[name].append(r.ttft_s)
    register_passages(root / "passages.jsonl", [p for ex in examples for p in ex.passages])
    model = str(engine.model_dir)
    del engine
    gc.collect()

    plain_llm = llm(model, None, args.dtype, args.compile)
    first_tokens(plain_llm, prompts[: args.warmup], None)
    plain = first_tokens(plain_llm, prompts, None)
    shutdown(plain_llm)
    report: dict = {"command": "benchmarks/vllm_fidelity.py " + " ".join(os.sys.argv[1:]), "prompts": len(prompts),
                    "warmup": args.warmup, "split": args.split, "store": args.store, "variants": {},
                    "ttft_median_s": {"vllm_full": statistics.median(p[2] for p in plain),
                                      "core_full": statistics.median(core_ttft["full"])},
                    "ttft_s": {"vllm_full": [round(p[2], 4) for p in plain],
                               "core_full": [round(t, 4) for t in core_ttft["full"]]}}
    stats = root / "stats.jsonl"
    blend_llm = llm(model, kv_transfer_config(store, passages=str(root / "passages.jsonl"),
                                              stats=str(stats)), args.dtype, args.compile)
    for name, opts in variants.items():
        first_tokens(blend_llm, prompts[: args.warmup], opts)
        done = len(stats.read_text().splitlines()) if stats.exists() else 0
        got = first_tokens(blend_llm, prompts, opts)
        loads = [x for x in map(json.loads, stats.read_text().splitlines()[done:]) if x.get("op") == "load"]
        agree = [float(g[0] == p[0]) for g, p in zip(got, plain, strict=True)]
        receipts = [g[1] or {} for g in got]
        report["variants"][name] = {
            "vllm_agreement": bootstrap(agree).as_dict(),
            "vllm_escalated": sum(bool(r.get("escalated")) for r in receipts) / len(receipts),
            "vllm_receipts": sum(1 for g in got if g[1] is not None),
            "core_agreement": bootstrap([a for a, _ in core[name]]).as_dict(),
            "core_escalated": sum(e for _, e in core[name]) / len(core[name]),
            "vllm_ttft_median_s": statistics.median(g[2] for g in got),
            # the worker's own seconds per request: its fused prefill, and the paged-cache writes
            "worker_blend_median_s": statistics.median(x["blend_s"] for x in loads) if loads else None,
            "worker_write_median_s": statistics.median(x["write_s"] for x in loads) if loads else None,
            "core_ttft_median_s": statistics.median(core_ttft[name]),
            "vllm_ttft_s": [round(g[2], 4) for g in got], "core_ttft_s": [round(t, 4) for t in core_ttft[name]],
        }
    shutdown(blend_llm)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{len(prompts)} musique {args.split} prompts, {args.chunks} passages each, chunk caches in {args.store}")
    w = max(14, *(len(name) + 2 for name in report["variants"]))
    print(f"{'variant':<{w}}{'vLLM agreement':<28}{'escalated':>10}  {'core agreement':<28}{'escalated':>10}")
    for name, r in report["variants"].items():
        v, c = r["vllm_agreement"], r["core_agreement"]
        print(f"{name:<{w}}{v['mean']:.3f} [{v['low']:.3f}, {v['high']:.3f}]{'':<6}{r['vllm_escalated']:>9.0%}  "
              f"{c['mean']:.3f} [{c['low']:.3f}, {c['high']:.3f}]{'':<6}{r['core_escalated']:>9.0%}")
    t = report["ttft_median_s"]
    print(f"median TTFT: plain vLLM {t['vllm_full']:.2f} s, core full prefill {t['core_full']:.2f} s")
    for name, r in report["variants"].items():
        print(f"{name:<{w}}connector {r['vllm_ttft_median_s']:.2f} s ({t['vllm_full'] / r['vllm_ttft_median_s']:.2f}x "
              f"over plain vLLM; worker blend {r['worker_blend_median_s'] or 0:.2f} s, writes "
              f"{r['worker_write_median_s'] or 0:.3f} s); core engine {r['core_ttft_median_s']:.2f} s")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
