"""The benchmark's pictures (matplotlib, PNG): TTFT against the number of chunks, quality
and fidelity against the recompute ratio (paper Fig. 16), KV-deviation sparsity (Figs. 6, 8)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _label(ax, xlabel: str, ylabel: str, title: str, legend_size: int) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def ttft_vs_chunks(records: list[dict], path: Path) -> Path | None:
    return _against_chunks(records, path, "ttft_median_s", "median TTFT (s)",
                           "Time to first token against number of chunks")


def total_vs_chunks(records: list[dict], path: Path) -> Path | None:
    """The whole answer (TTFT plus the token loop) against the number of chunks."""
    timed = [r for r in records if r.get("answer_total_median_s") is not None]
    tokens = timed[0]["answer_tokens"] if timed else 0
    return _against_chunks(timed, path, "answer_total_median_s", f"median time to a {tokens}-token answer (s)",
                           "Total latency against number of chunks")


def _against_chunks(records: list[dict], path: Path, key: str, ylabel: str, title: str) -> Path | None:
    ours = [r for r in records if r.get("chunks") is not None and r.get(key) is not None]
    chunk_values = sorted({r["chunks"] for r in ours})
    if len(chunk_values) < 2:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for dataset in sorted({r["dataset"] for r in ours}):
        for variant in dict.fromkeys(r["variant"] for r in ours if r["dataset"] == dataset):
            pts = sorted((r["chunks"], r[key]) for r in ours
                         if r["variant"] == variant and r["dataset"] == dataset)
            label = variant if len({r["dataset"] for r in ours}) == 1 else f"{dataset} {variant}"
            ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=label)
    _label(ax, "chunks in the prompt", ylabel, title, legend_size=8)
    return _save(fig, path)


def ttft_vs_rate(summaries: list[dict], path: Path) -> Path | None:
    """p90 (solid) and p50 (dashed) TTFT against the offered request rate, one colour per
    serving mode (``benchmarks/load.py``)."""
    if not summaries:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for n, mode in enumerate(dict.fromkeys(s["mode"] for s in summaries)):
        pts = sorted((s["rate_per_min"], s["ttft_p90_s"], s["ttft_p50_s"]) for s in summaries
                     if s["mode"] == mode and s["ttft_p90_s"] is not None)
        colour = f"C{n}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colour, label=f"{mode} p90")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], marker=".", color=colour, linestyle="--", alpha=0.6,
                label=f"{mode} p50")
    ax.set_yscale("log")
    _label(ax, "offered load (requests per minute)", "TTFT (s)", "Time to first token under load", legend_size=7)
    return _save(fig, path)


def quality_vs_ratio(records: list[dict], path: Path) -> Path | None:
    """Per data set: quality against gold, first-token agreement and output F1 against
    full prefill, for reuse (r = 0), blend at each ratio and full prefill (r = 1)."""
    pts = [r for r in records if r["method"] in ("reuse", "blend", "full") and r.get("recompute_ratio") is not None]
    datasets = sorted({r["dataset"] for r in pts})
    if not datasets:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for dataset in datasets:
        chunks = max(r["chunks"] for r in pts if r["dataset"] == dataset)  # the largest prompt of the run
        mine = sorted((r for r in pts if r["dataset"] == dataset and r["chunks"] == chunks),
                      key=lambda r: r["recompute_ratio"])
        xs = [r["recompute_ratio"] for r in mine]
        for ax, key in zip(axes, ("quality", "first_token_agreement", "output_f1_vs_full"), strict=True):
            ax.plot(xs, [r[key] for r in mine], marker="o", label=dataset)
    titles = ("quality vs gold (F1 / Rouge-L)", "first-token agreement with full prefill",
              "output token F1 vs full prefill")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xlabel("recompute ratio")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(fig, path)


def deviation_sparsity(profile: dict, path: Path) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    shares = sorted(profile["top_share"], key=float)
    layers = profile["layers"]
    for layer_index in sorted({0, len(layers) // 4, len(layers) // 2, 3 * len(layers) // 4, len(layers) - 1}):
        left.plot([100 * float(s) for s in shares], [profile["top_share"][s][layer_index] for s in shares],
                  marker="o", label=f"layer {layers[layer_index]}")
    left.set_xlabel("top k % of chunk tokens (by deviation)")
    left.set_ylabel("share of squared KV deviation")
    left.set_title("KV deviation is sparse (cf. paper Fig. 6)", fontsize=10)
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    right.plot(layers[:-1], profile["rank_correlation_next_layer"], marker="o")
    right.set_xlabel("layer l")
    right.set_ylabel("Spearman correlation, layer l vs l+1")
    right.set_ylim(0, 1)
    right.set_title("HKVD tokens persist across layers (cf. paper Fig. 8)", fontsize=10)
    right.grid(alpha=0.3)
    return _save(fig, path)


def fidelity_frontier(records: list[dict], path: Path) -> Path | None:
    """The fidelity study's frontier: median TTFT speed-up over full prefill against
    first-token agreement and against first-token KL, one point per variant with its 95 %
    interval; the Pareto-optimal variants are joined."""
    pts = [r for r in records if r["variant"] != "full"]
    if not pts:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, metric, better in ((axes[0], "agree", max), (axes[1], "kl", min)):
        for r in pts:
            m = r[metric]
            ax.errorbar(r["speedup_median"], m["mean"], yerr=[[m["mean"] - m["low"]], [m["high"] - m["mean"]]],
                        fmt="o", capsize=3, label=r["variant"])
        front, best = [], None
        for r in sorted(pts, key=lambda r: -r["speedup_median"]):  # fastest first: keep what improves
            v = r[metric]["mean"]
            if best is None or better(v, best) == v and v != best:
                front.append((r["speedup_median"], v))
                best = v
        ax.plot([x for x, _ in front], [y for _, y in front], "k--", alpha=0.5, label="Pareto frontier")
        ax.set_xlabel("median TTFT speed-up over full prefill (x)")
        ax.set_ylabel("first-token agreement" if metric == "agree" else "first-token KL (full ‖ variant)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6, loc="lower left")
    fig.suptitle("Fidelity to full prefill against speed (95 % bootstrap intervals)")
    return _save(fig, path)
