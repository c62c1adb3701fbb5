"""The command line and the loop shared by the interleaved A/B scripts on musique dev
prompts (``blend_attention.py``, ``kv_reuse.py``, ``onednn_weights.py``, ``compiled_decode.py``),
and the command line of the one-engine fidelity switches (``exact_behind_sink.py``,
``system_instruction.py``)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable


def ab_arguments(doc: str | None,
                 extra: Callable[[argparse.ArgumentParser], object] | None = None) -> argparse.Namespace:
    """``--limit`` prompts, ``--ratios``, ``--rounds``, ``--data``, ``--model``, ``--out``,
    ``--answer-tokens``, ``--dtype``; ``extra(parser)`` adds a script's own."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    ap.add_argument("--limit", type=int, default=3, help="musique dev prompts")
    ap.add_argument("--ratios", default="0.05,0.15")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--data", default=None, help="data folder (default: $CACHEBLEND_DATA)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None, help="JSON output")
    ap.add_argument("--answer-tokens", type=int, default=0,
                    help="engine A/Bs: each request also answers with exactly N tokens; decode ms/token reported")
    ap.add_argument("--dtype", default=None, help="what the engines compute in (default: float32)")
    if extra is not None:
        extra(ap)
    return ap.parse_args()


def switch_arguments(doc: str | None, skip: int,
                     extra: Callable[[argparse.ArgumentParser], object] | None = None) -> argparse.Namespace:
    """``--skip`` (the first dev prompt), ``--limit``, ``--rounds``, ``--data``, ``--model``,
    ``--out``; ``extra(parser)`` adds a script's own."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    ap.add_argument("--skip", type=int, default=skip, help="start at this dev prompt")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="timed runs per prompt and variant (0: no timing)")
    ap.add_argument("--data", default=None, help="data folder (default: $CACHEBLEND_DATA)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None, help="JSON output")
    if extra is not None:
        extra(ap)
    return ap.parse_args()


def engine_ab(args: argparse.Namespace, settings: dict[str, dict], script: str) -> None:
    """Engines that differ only in ``settings`` (name → ``Engine.load`` keywords), alternating
    request by request: for each 6-passage musique dev prompt (chunk caches in memory) and
    round, each engine answers with full prefill and at each ratio, after one warm-up request
    per engine and prompt.  Prints the median TTFT (and decode ms/token) per setting and
    method, each blend's speed-up over its own engine's full prefill, and how often the
    settings gave the same first-token logits and greedy tokens."""
    import torch

    from cacheblend import Engine
    from cacheblend.datasets import QA_PREAMBLE, load_qa

    methods = [("full", dict(method="full"))] + [
        (f"blend@{float(r):g}", dict(recompute_ratio=float(r))) for r in args.ratios.split(",")]
    engines = {name: Engine.load(args.model, store="memory", dtype=args.dtype, **kw) for name, kw in settings.items()}
    ttft: dict[str, dict[str, list[float]]] = {name: {} for name in settings}
    decode: dict[str, dict[str, list[float]]] = {name: {} for name in settings}
    same, same_tokens, compared = 0, 0, 0
    tokens = max(1, args.answer_tokens)
    for ex in load_qa("musique", "dev", limit=args.limit, passages=6, data=args.data):
        for engine in engines.values():
            engine.ingest(ex.passages)
            # warm-up, with decode steps (a compiled step compiles at its first)
            engine.generate(ex.query, ex.passages, preamble=QA_PREAMBLE, max_new_tokens=3, ignore_eos=True)
        for _ in range(args.rounds):
            for label, options in methods:
                results = []
                for name, engine in engines.items():
                    t0 = time.perf_counter()
                    r = engine.generate(ex.query, ex.passages, preamble=QA_PREAMBLE, max_new_tokens=tokens,
                                        ignore_eos=True, **options)
                    total = time.perf_counter() - t0
                    ttft[name].setdefault(label, []).append(r.ttft_s)
                    if tokens > 1:
                        decode[name].setdefault(label, []).append(1000 * (total - r.ttft_s) / (tokens - 1))
                    results.append(r)
                same += all(torch.equal(results[0].first_token_logits, r.first_token_logits) for r in results)
                same_tokens += all(results[0].token_ids == r.token_ids for r in results)
                compared += 1
    summary = {}
    for name, per in ttft.items():
        full = statistics.median(per["full"])
        summary[name] = {label: {"ttft_s": statistics.median(v), "speedup_over_full": full / statistics.median(v),
                                 "runs": len(v)} for label, v in per.items()}
        for label, s in summary[name].items():
            if decode[name]:
                s["decode_ms_per_token"] = statistics.median(decode[name][label])
            ms = f"  decode {s['decode_ms_per_token']:5.1f} ms/token" if "decode_ms_per_token" in s else ""
            print(f"{name:26s} {label:11s} {s['ttft_s'] * 1000:8.0f} ms  {s['speedup_over_full']:5.2f}x  "
                  f"({s['runs']} runs){ms}")
    print(f"same first-token logits under every setting: {same}/{compared}; same tokens: {same_tokens}/{compared}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": f"benchmarks/{script} " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
                "threads": torch.get_num_threads(), "summary": summary,
                "same_first_token_logits": [same, compared], "same_tokens": [same_tokens, compared],
                "ttft_s": ttft, "decode_ms_per_token": decode}, f, indent=2)
