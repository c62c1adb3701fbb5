"""The benchmark's tasks: the paper's five data sets as chunked prompts with gold outputs.

QA sets (musique, wikimqa, hotpotqa) use the official CacheBlend prompt and SQuAD F1;
summarisation sets use LongBench's prompts and Rouge-L: multi_news (one chunk per news
article) and samsum few-shot (one chunk per worked example from the train/validation
pool, the dialogue to summarise in the question).  Splits follow the data's README.  The
files are read from the data directory (``data=``, else ``$CACHEBLEND_DATA``; see
:func:`cacheblend.datasets.data_dir`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from ..datasets import QA_PREAMBLE, QA_QUERY, SPLITS, data_file, load_qa


@dataclass(frozen=True)
class Example:
    query: str
    passages: list[str]
    answers: list[str]


@dataclass(frozen=True)
class Task:
    name: str
    metric: str  # "f1" or "rougeL"
    preamble: str
    max_new_tokens: int
    stop: tuple[str, ...] = ()


def _qa_task(name: str) -> Task:
    return Task(name, metric="f1", preamble=QA_PREAMBLE, max_new_tokens=24, stop=("\n",))


MULTI_NEWS_PREAMBLE = "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n"
MULTI_NEWS_QUERY = "\n\nNow, write a one-page summary of all the news.\n\nSummary:"
SAMSUM_PREAMBLE = "Summarize the dialogue into a few short sentences. The following are some examples.\n\n"
SAMSUM_QUERY = "Dialogue: {dialogue}\nSummary:"

TASKS = {
    "musique": _qa_task("musique"),
    "wikimqa": _qa_task("wikimqa"),
    "hotpotqa": _qa_task("hotpotqa"),
    "multi_news": Task("multi_news", "rougeL", MULTI_NEWS_PREAMBLE, max_new_tokens=64),
    "samsum": Task("samsum", "rougeL", SAMSUM_PREAMBLE, max_new_tokens=40, stop=("\n",)),
}
TASK_FILES = {  # the file of each data set in the data directory
    "musique": SPLITS["musique"][0],
    "wikimqa": SPLITS["wikimqa"][0],
    "hotpotqa": "hotpotqa_dev_distractor_100.json",
    "multi_news": "multi_news_longbench.jsonl",
    "samsum": "samsum.jsonl",
}
_RANGES = {"hotpotqa": (range(0, 69), range(69, 103)), "multi_news": (range(0, 134), range(134, 200))}


def load_task(name: str, split: str, limit: int | None, chunks: int,
              data: str | os.PathLike[str] | None = None) -> tuple[Task, list[Example]]:
    """``limit`` examples of ``split`` with (at most) ``chunks`` chunks each, from the data
    directory ``data`` (default: ``$CACHEBLEND_DATA``)."""
    if name not in TASKS:
        raise ValueError(f"unknown data set {name!r}; known: {sorted(TASKS)}")
    if split not in ("dev", "test"):
        raise ValueError("split must be 'dev' or 'test'")
    if chunks < 1:
        raise ValueError("chunks must be at least 1")
    loader = {"hotpotqa": _hotpotqa, "multi_news": _multi_news, "samsum": _samsum}.get(name)
    if loader is None:
        examples = [Example(ex.query, ex.passages, ex.answers) for ex in load_qa(name, split, limit, chunks, data)]
    else:
        examples = loader(split, limit, chunks, data)
    return TASKS[name], examples


def _indices(name: str, split: str, limit: int | None) -> range:
    r = _RANGES[name][0 if split == "dev" else 1]
    return r[:limit] if limit else r


def _hotpotqa(split: str, limit: int | None, chunks: int, data: str | os.PathLike[str] | None) -> list[Example]:
    rows = json.loads(data_file(TASK_FILES["hotpotqa"], data).read_text())
    out = []
    for i in _indices("hotpotqa", split, limit):
        row = rows[i]
        passages = [f"{title}\n\n{''.join(sents).strip()}" for title, sents in row["context"][:chunks]]
        out.append(Example(QA_QUERY.format(question=row["question"]), passages, [row["answer"]]))
    return out


def _multi_news(split: str, limit: int | None, chunks: int, data: str | os.PathLike[str] | None) -> list[Example]:
    lines = data_file(TASK_FILES["multi_news"], data).read_text().splitlines()
    out = []
    for i in _indices("multi_news", split, limit):
        row = json.loads(lines[i])
        articles = [a.replace("NEWLINE_CHAR", "\n").strip() for a in re.split(r"Passage \d+:\n", row["context"])]
        passages = [a for a in articles if a][:chunks]
        out.append(Example(MULTI_NEWS_QUERY, passages, list(row["answers"])))
    return out


def _samsum(split: str, limit: int | None, chunks: int, data: str | os.PathLike[str] | None) -> list[Example]:
    rows = [json.loads(line) for line in data_file(TASK_FILES["samsum"], data).read_text().splitlines()]
    pool = [r for r in rows if r["split"] in ("train", "validation")]  # the few-shot examples
    targets = [r for r in rows if r["split"] == ("validation" if split == "dev" else "test")]
    if split == "dev":  # dev questions come from the pool, never shown as their own example
        pool = [r for r in rows if r["split"] == "train"]
    out = []
    for i, row in enumerate(targets[:limit] if limit else targets):
        shots = [pool[(i * chunks + j) % len(pool)] for j in range(chunks)]  # a fixed rotation: shots recur
        passages = [f"Dialogue: {_clean(s['question'])}\nSummary: {s['answer'].strip()}" for s in shots]
        out.append(Example(SAMSUM_QUERY.format(dialogue=_clean(row["question"])), passages, [row["answer"].strip()]))
    return out


def _clean(dialogue: str) -> str:
    return dialogue.replace("\r\n", "\n").strip()
