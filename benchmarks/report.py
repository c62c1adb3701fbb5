"""Markdown tables from ``cacheblend bench --json`` files, for docs/benchmarks.md.

    .venv/bin/python benchmarks/report.py bench-out/test/main.json [more.json ...]
"""

from __future__ import annotations

import json
import sys


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def table(records: list[dict]) -> str:
    rows = ["| data set | chunks | method | TTFT median | p90 | speed-up vs our full | quality | "
            "1st-token agree | KL | output F1 vs full | store hits |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        rows.append(
            f"| {r['dataset']} | {r['chunks']} | {r['variant']} | {_fmt(r['ttft_median_s'], '.2f')} s | "
            f"{_fmt(r['ttft_p90_s'], '.2f')} s | {_fmt(r['speedup_vs_full'], '.2f')}× | {_fmt(r['quality'], '.3f')} | "
            f"{_fmt(r['first_token_agreement'], '.0%')} | {_fmt(r['kl_first_token'], '.3f')} | "
            f"{_fmt(r['output_f1_vs_full'], '.2f')} | {_fmt(r['store_hit_rate'], '.0%')} |")
    return "\n".join(rows)


def main(paths: list[str]) -> None:
    for path in paths:
        report = json.loads(open(path).read())
        m = report["machine"]
        tokens = {(r["dataset"], r["chunks"]): r.get("mean_prompt_tokens") for r in report["records"]
                  if r["method"] == "full"}
        print(f"### `{report['command']}`\n")
        print(f"{m['processor']}, {m['cpus']} CPUs, torch {m['torch']} with {m['torch_threads']} threads; "
              f"{report['seconds'] / 60:.1f} min. Mean prompt tokens: "
              + ", ".join(f"{d} x{c}: {t:.0f}" for (d, c), t in tokens.items() if t) + "\n")
        print(table(report["records"]) + "\n")
        if report.get("peer_error"):
            print(f"vLLM peer failed: {report['peer_error']}\n")
        if "deviation" in report:
            dev = report["deviation"]
            share = dev["top_share"]
            last = len(dev["layers"]) - 1
            print(f"KV deviation ({dev['dataset']}, {dev['chunks']} chunks, {dev['prompts']} prompts): the top 15 % "
                  f"of chunk tokens hold {share['0.15'][0]:.0%} of the squared deviation at layer {dev['layers'][0]}, "
                  f"{share['0.15'][last // 2]:.0%} at layer {dev['layers'][last // 2]} and {share['0.15'][last]:.0%} "
                  f"at layer {dev['layers'][last]}; rank correlation between consecutive layers: mean "
                  f"{sum(dev['rank_correlation_next_layer']) / len(dev['rank_correlation_next_layer']):.2f}, "
                  f"min {min(dev['rank_correlation_next_layer']):.2f}.", end="")
            if "shift_share_k" in dev:  # reports written before the chunk shift have no such field
                k, v = dev["shift_share_k"], dev["shift_share_v"]
                print(f" Each chunk's mean error (its shift) holds {sum(k[1:]) / len(k[1:]):.0%} of the key and "
                      f"{sum(v[1:]) / len(v[1:]):.0%} of the value error from layer {dev['layers'][1]} on.", end="")
            print("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
