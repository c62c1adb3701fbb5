"""``cacheblend ui``: an explorer of what CacheBlend does to your prompt, in the browser.

Four tabs on the real engine (Gradio; loopback by default):

- **Ask**: passages and a question; full prefill's answer and the chosen method's,
  streamed side by side, with TTFT, decode speed, reused/recomputed tokens, store hits and
  the fidelity receipt;
- **Tokens**: the prompt token by token, shaded by KV deviation at the check layer, the
  recomputed tokens outlined; the ratio slider re-marks them without computing again;
- **Attention**: attention at one layer under full prefill, full reuse and blend;
- **Speed**: TTFT against the number of chunks per method, from ``cacheblend bench``
  JSON or measured now, with quality under each bar.

Every figure comes from :meth:`Engine.explain` or the engine's own results; this module
only lays them out.  With ``base_url`` the Ask tab talks to a vLLM server with the
CacheBlend connector; the other tabs need the model in this process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..explain import speed_sweep
from .figures import attention_figure, speed_figure, token_map_html
from .live import split_passages, stream_answer

METHODS = ["blend", "reuse", "prefix", "full"]
EXAMPLE_PASSAGES = [
    "Ida Haendel was a Polish-born British violinist. She was born in Chełm, Poland, in 1928.",
    "In 1952 Ida Haendel moved to London, and later to Montreal, Canada.",
    "She spent the last decades of her life in Miami, Florida, where she died in 2020.",
]
EXAMPLE_QUESTION = "Where did Ida Haendel live later in life?"


class Explorer:
    """The state behind the widgets: a backend for answers, an in-process engine for the
    explanations (None with a remote backend), examples from a data folder."""

    def __init__(self, backend: Any, engine: Any | None, data: str | None = None,
                 bench_json: str | None = None) -> None:
        self.backend, self.engine, self.bench_json = backend, engine, bench_json
        self.examples: dict[str, Any] = {}
        if data:
            from ..datasets import load_qa

            for i, ex in enumerate(load_qa("musique", "dev", limit=20, passages=6, data=data)):
                self.examples[f"musique dev {i}: {ex.question[:60]}"] = ex

    def pick(self, name: str | None) -> tuple[str, str]:
        ex = self.examples.get(name or "")
        if ex is None:
            return f"\n{'---'}\n".join(EXAMPLE_PASSAGES), EXAMPLE_QUESTION
        return f"\n{'---'}\n".join(ex.passages), ex.query

    def ask(self, text: str, files: list[str] | None, question: str, method: str, ratio: float, tokens: int):
        """Stream full prefill's answer, then the chosen method's."""
        passages = split_passages(text, files or ())
        if not passages or not question.strip():
            raise ValueError("give at least one passage and a question")
        full = None
        for full in stream_answer(self.backend, question, passages, "full", ratio, int(tokens)):
            yield full.text, "", full.summary()
        assert full is not None
        for ans in stream_answer(self.backend, question, passages, method, ratio, int(tokens)):
            yield full.text, ans.text, full.summary() + "\n\n" + ans.summary()

    def explain(self, text: str, files: list[str] | None, question: str, ratio: float, layer: int | None,
                progress: Any = None):
        if self.engine is None:
            raise ValueError("explanations need the model in this process: start `cacheblend ui` without --base-url")
        passages = split_passages(text, files or ())
        if not passages or not question.strip():
            raise ValueError("give at least one passage and a question")
        if progress is not None:
            progress(0.1, desc="full prefill and the chunk caches")
        return self.engine.explain(question, passages, attention_layer=layer, answers=False,
                                   recompute_ratio=ratio)

    def speed(self, text: str, files: list[str] | None, question: str, ratio: float, source: str,
              progress: Any = None):
        if source == "bench JSON":
            if not self.bench_json:
                raise ValueError("no bench JSON: start with --bench-json FILE (written by cacheblend bench --json)")
            records = json.loads(Path(self.bench_json).read_text())["records"]
        else:
            if self.engine is None:
                raise ValueError("a live sweep needs the model in this process")
            passages = split_passages(text, files or ())[:6]
            if not passages or not question.strip():
                raise ValueError("give at least one passage and a question")
            records = speed_sweep(self.engine, question, passages, ("full", "prefix", "reuse", "blend"), ratio,
                            progress=(lambda f, d: progress(f, desc=d)) if progress is not None else None)
        return speed_figure(records), records


def build(explorer: Explorer):
    """The Gradio app."""
    import gradio as gr

    theme = gr.themes.Default(font=["system-ui", "sans-serif"], font_mono=["monospace"])  # no web fonts: offline
    with gr.Blocks(title="CacheBlend explorer", theme=theme) as app:
        gr.Markdown("# CacheBlend explorer\nWhat CacheBlend does to your prompt, measured on the real engine.")
        passages0, question0 = explorer.pick(None)
        with gr.Row():
            with gr.Column(scale=3):
                text = gr.Textbox(passages0, lines=8, label="Passages (a line '---' between them)",
                                  elem_id="passages")
                files = gr.File(file_count="multiple", file_types=[".txt", ".md"], type="filepath",
                                label="or upload passages (one per file)")
            with gr.Column(scale=2):
                example = gr.Dropdown(list(explorer.examples), label="musique dev example (--data)",
                                      visible=bool(explorer.examples))
                question = gr.Textbox(question0, label="Question", elem_id="question")
                method = gr.Dropdown(METHODS, value="blend", label="Method", elem_id="method")
                ratio = gr.Slider(0.0, 1.0, value=0.15, step=0.01, label="Recompute ratio", elem_id="ratio")
                tokens = gr.Slider(1, 128, value=24, step=1, label="Answer tokens")
        example.change(explorer.pick, example, [text, question])
        _ask_tab(gr, explorer, [text, files, question, method, ratio, tokens])
        _tokens_tab(gr, explorer, [text, files, question], ratio)
        _attention_tab(gr, explorer, [text, files, question, ratio])
        _speed_tab(gr, explorer, [text, files, question, ratio])
    return app


def _ask_tab(gr, explorer: Explorer, inputs: list) -> None:
    with gr.Tab("Ask"):
        ask = gr.Button("Ask", variant="primary", elem_id="ask")
        with gr.Row():
            full = gr.Textbox(label="Full prefill", lines=6, elem_id="answer-full")
            chosen = gr.Textbox(label="Chosen method", lines=6, elem_id="answer-method")
        stats = gr.Markdown(elem_id="ask-stats")
        ask.click(explorer.ask, inputs, [full, chosen, stats])


def _tokens_tab(gr, explorer: Explorer, inputs: list, ratio) -> None:
    with gr.Tab("Tokens"):
        go = gr.Button("Explain (KV deviation and recompute set)", elem_id="explain")
        state = gr.State()
        view = gr.HTML(elem_id="token-map")

        def run(text, files, question, r, progress=gr.Progress()):  # noqa: B008 (Gradio injects it)
            ex = explorer.explain(text, files, question, r, None, progress)
            return ex, token_map_html(ex, r)

        go.click(run, [*inputs, ratio], [state, view])
        ratio.change(lambda ex, r: token_map_html(ex, r) if ex is not None else "", [state, ratio], view)


def _attention_tab(gr, explorer: Explorer, inputs: list) -> None:
    with gr.Tab("Attention"):
        layers = explorer.engine.decoder.shape.num_layers if explorer.engine is not None else 1
        layer = gr.Slider(0, layers - 1, value=min(layers - 1, layers // 2), step=1, label="Layer")
        go = gr.Button("Draw attention", elem_id="attention")
        plot = gr.Plot(elem_id="attention-plot")

        def run(text, files, question, r, lay, progress=gr.Progress()):  # noqa: B008 (Gradio injects it)
            return attention_figure(explorer.explain(text, files, question, r, int(lay), progress).attention)

        go.click(run, [*inputs, layer], plot)


def _speed_tab(gr, explorer: Explorer, inputs: list) -> None:
    with gr.Tab("Speed"):
        source = gr.Radio(["measure now", "bench JSON"], value="bench JSON" if explorer.bench_json else "measure now",
                          label="Figures from")
        go = gr.Button("Show TTFT against chunks", elem_id="speed")
        plot = gr.Plot(elem_id="speed-plot")
        table = gr.JSON(label="records")

        def run(text, files, question, r, src, progress=gr.Progress()):  # noqa: B008 (Gradio injects it)
            return explorer.speed(text, files, question, r, src, progress)

        go.click(run, [*inputs, source], [plot, table])


def launch(explorer: Explorer, host: str = "127.0.0.1", port: int = 7860, open_browser: bool = False) -> None:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    build(explorer).queue().launch(server_name=host, server_port=port, inbrowser=open_browser,
                                   show_error=True, share=False)
