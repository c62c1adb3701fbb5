"""The explorer's figures, drawn from data the engine measured (no model code here)."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from ..explain import AttentionMaps, Explanation

PART_TINT = {"system": "#eeeeee", "between": "#f4f4f4", "question": "#dbe9ff"}
METHOD_ORDER = ("full", "prefix", "reuse", "blend")


def token_map_html(ex: Explanation, ratio: float) -> str:
    """The prompt token by token: chunk tokens shaded by KV deviation at the check layer
    (darker = further from full prefill), the tokens recomputed at ``ratio`` outlined."""
    chosen = ex.recomputed(ratio)
    cand = ex.candidates
    top = float(ex.deviation[cand].max()) if cand.numel() else 0.0
    spans = []
    for i, tok in enumerate(ex.tokens):
        text = html.escape(tok.text).replace("\n", "↵<br>") or "&nbsp;"
        if tok.part == "chunk":
            level = float(ex.deviation[i]) / top if top > 0 else 0.0
            style = f"background: rgba(220, 60, 30, {0.08 + 0.8 * level:.2f});"
            if chosen[i]:
                style += " outline: 2px solid #1a3fbf; font-weight: 600;"
            title = f"chunk {tok.chunk + 1 if tok.chunk is not None else '?'} · deviation {float(ex.deviation[i]):.3g}"
        else:
            style, title = f"background: {PART_TINT.get(tok.part, '#fff')};", tok.part
        cls = "cb-token cb-recomputed" if chosen[i] else "cb-token"
        spans.append(f'<span class="{cls}" title="{html.escape(title)}" style="{style}">{text}</span>')
    n_chosen, n_cand = int(chosen.sum()), int(cand.numel())
    legend = (f"<p>Check layer {ex.check_layer}: {n_chosen} of {n_cand} chunk tokens recomputed at ratio "
              f"{ratio:.0%} (outlined); shade = KV deviation from full prefill. Grey: system prompt; "
              f"blue: question (always computed).</p>")
    return (f'<div id="cb-token-map" style="font-family: monospace; line-height: 1.9; white-space: normal">'
            f"{legend}{''.join(spans)}</div>")


def attention_figure(maps: AttentionMaps):
    """Three heatmaps (full prefill, full reuse, blend) with chunk boundaries drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 5.2), constrained_layout=True)
    for ax, (name, m) in zip(axes, (("full prefill", maps.full), ("full KV reuse", maps.reuse),
                                    ("CacheBlend", maps.blend)), strict=True):
        shown = m.clamp(min=1e-4).log10()
        im = ax.imshow(shown.numpy(), cmap="magma", vmin=-4, vmax=0, interpolation="nearest")
        for b in maps.boundaries:
            ax.axhline(b - 0.5, color="cyan", lw=0.6)
            ax.axvline(b - 0.5, color="cyan", lw=0.6)
        ax.set_title(f"{name} · layer {maps.layer}")
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
    fig.colorbar(im, ax=axes, shrink=0.8, label="log10 attention (mean over heads)")
    return fig


def speed_figure(records: Sequence[dict[str, Any]]):
    """TTFT against the number of chunks, one bar per method, quality (token F1 of the
    answer against full prefill's) written under each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chunks = sorted({int(r["chunks"]) for r in records})
    methods = [m for m in METHOD_ORDER if any(_method(r) == m for r in records)]
    fig, ax = plt.subplots(figsize=(10, 4.8), constrained_layout=True)
    width = 0.8 / max(1, len(methods))
    for j, method in enumerate(methods):
        for i, c in enumerate(chunks):
            rec = next((r for r in records if _method(r) == method and int(r["chunks"]) == c), None)
            if rec is None:
                continue
            x = i + (j - (len(methods) - 1) / 2) * width
            ax.bar(x, rec["ttft_median_s"], width * 0.95, color=f"C{METHOD_ORDER.index(method)}",
                   label=method if i == 0 else None)
            quality = rec.get("output_f1_vs_full")
            if quality is not None:
                ax.text(x, 0, f"{quality:.2f}", ha="center", va="top", fontsize=8, rotation=90)
    ax.set_xticks(range(len(chunks)), [f"{c} chunks" for c in chunks])
    ax.set_ylabel("TTFT (s, median)")
    ax.set_title("Time to first token; under each bar: answer F1 against full prefill")
    ax.legend()
    return fig


def _method(record: dict[str, Any]) -> str:
    return str(record.get("method", record.get("variant", "")))
