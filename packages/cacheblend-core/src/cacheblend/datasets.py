"""The paper's QA data sets and prompt format, read from a data directory.

The directory (the folder holding ``musique_s.json`` and the other files in
:data:`DATA_FILES`) is given explicitly (``data=`` here, ``--data DIR`` on the command
line) or by the environment variable ``CACHEBLEND_DATA``; nothing is guessed from where
the package or the working directory happens to be.  Splits (the data's README): tune on
dev, report on test.
"""

from __future__ import annotations

import json
import os
import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .errors import CacheBlendError

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


DATA_ENV = "CACHEBLEND_DATA"
DATA_FILES = ("musique_s.json", "wikimqa_s_clean.json", "hotpotqa_dev_distractor_100.json",
              "multi_news_longbench.jsonl", "samsum.jsonl")


class DataNotFoundError(CacheBlendError, FileNotFoundError):
    """No data directory was given, or it lacks a data set's file; the message says how to fix it."""


def data_dir(data: str | os.PathLike[str] | None = None) -> Path:
    """The data directory: ``data`` if given, else ``$CACHEBLEND_DATA``; never guessed."""
    origin = "given as --data"
    if data is None or str(data) == "":
        data, origin = os.environ.get(DATA_ENV) or None, f"from ${DATA_ENV}"
    if data is None:
        raise DataNotFoundError(
            f"no data directory: pass --data DIR or set {DATA_ENV} "
            f"(the folder holding {', '.join(DATA_FILES[:2])} ...)")
    path = Path(data).expanduser()
    if not path.is_dir():
        raise DataNotFoundError(f"data directory {path} ({origin}) is not a directory")
    return path


def data_file(name: str, data: str | os.PathLike[str] | None = None) -> Path:
    """One file of the data directory, with an error naming its full path if it is missing."""
    folder = data_dir(data)
    path = folder / name
    if not path.is_file():
        raise DataNotFoundError(f"no such data file: {path} (the data directory {folder} lacks {name})")
    return path


def load_qa(name: str, split: str = "dev", limit: int | None = None, passages: int | None = None,
            data: str | os.PathLike[str] | None = None) -> list[QAExample]:
    """``limit`` examples of ``split``, each with (at most) ``passages`` passages; ``data``
    is the data directory (default: ``$CACHEBLEND_DATA``)."""
    if name not in SPLITS:
        raise ValueError(f"unknown QA data set {name!r}; known: {sorted(SPLITS)}")
    if split not in ("dev", "test"):
        raise ValueError("split must be 'dev' or 'test'")
    file, dev, test = SPLITS[name]
    rows = json.loads(data_file(file, data).read_text())
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
