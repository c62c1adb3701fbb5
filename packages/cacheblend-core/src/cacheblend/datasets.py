"""The paper's QA data sets and prompt format, read from ``../shared/data``.

Splits (``shared/data/README.md``): tune on dev, report on test.
"""

from __future__ import annotations

import json
import os
import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# The official CacheBlend example's prompt pieces for the QA sets.
QA_PREAMBLE = (
    "You will be asked a question after reading several passages. Please directly answer the "
    "question based on the given passages. Do NOT repeat the question. The answer should be within "
    "5 words.\nPassages:\n"
)
QA_QUERY = (
    "\n\nAnswer the question directly based on the given passages. Do NOT repeat the question. "
    "The answer should be within 5 words. \nQuestion:{question}\nAnswer:"
)

SPLITS = {  # file -> (dev range, test range) as example indices
    "musique": ("musique_s.json", range(0, 100), range(100, 150)),
    "wikimqa": ("wikimqa_s_clean.json", range(0, 68), range(68, 102)),
}


@dataclass(frozen=True)
class QAExample:
    question: str
    answers: list[str]
    passages: list[str]  # each f"{title}\n\n{text}"; the engine appends the chunk separator

    @property
    def query(self) -> str:
        return QA_QUERY.format(question=self.question)


def data_dir() -> Path:
    env = os.environ.get("CACHEBLEND_DATA")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for base in (Path.cwd(), *Path.cwd().parents, *here.parents):
        if (base / "shared" / "data").is_dir():
            return base / "shared" / "data"
    raise FileNotFoundError("cannot find ../shared/data; set CACHEBLEND_DATA to its path")


def load_qa(name: str, split: str = "dev", limit: int | None = None, passages: int | None = None) -> list[QAExample]:
    if name not in SPLITS:
        raise ValueError(f"unknown QA data set {name!r}; known: {sorted(SPLITS)}")
    if split not in ("dev", "test"):
        raise ValueError("split must be 'dev' or 'test'")
    file, dev, test = SPLITS[name]
    rows = json.loads((data_dir() / file).read_text())
    out = []
    for i in dev if split == "dev" else test:
        row = rows[i]
        answers = row["answers"]
        flat = [a for group in answers for a in (group if isinstance(group, list) else [group])]
        ctxs = row["ctxs"][:passages] if passages else row["ctxs"]
        out.append(QAExample(row["question"], flat, [f"{c['title']}\n\n{c['text']}" for c in ctxs]))
        if limit and len(out) >= limit:
            break
    return out


def _normalize(text: str) -> list[str]:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return text.split()


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD token F1 after lower-casing and stripping punctuation and articles."""
    p, g = _normalize(prediction), _normalize(gold)
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, answers: list[str]) -> float:
    return max((token_f1(prediction, a) for a in answers), default=0.0)
