"""The `cacheblend bench` commands the docs show, and benchmarks/docs_runs.sh that produces
docs/benchmarks.md, must still parse: a renamed flag or variant syntax would otherwise leave
every published command broken without a failing test."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from cacheblend.bench.fidelity import parse_spec
from cacheblend.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _commands(text: str) -> list[str]:
    """Every line of the text's code blocks, continuation lines joined."""
    out, block = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if block is not None:
                out += [c.split(" #", 1)[0].strip() for c in "\n".join(block).replace("\\\n", " ").splitlines()]
            block = [] if block is None else None
        elif block is not None:
            block.append(line)
    return [c for c in out if c]


def _bench_args(command: str) -> list[str] | None:
    """The arguments after `cacheblend bench` (shell variables given a valid value), or None."""
    if not re.search(r"cacheblend bench\b", command):
        return None
    words = shlex.split(command.replace("$d", "musique").replace("${d}", "musique"))
    for i, word in enumerate(words):
        if word.endswith("cacheblend") and i + 1 < len(words) and words[i + 1] == "bench":
            return words[i + 2 :]
    return None


def _check(args: list[str], where: str) -> None:
    try:
        ns = build_parser().parse_args(["bench", *args])
    except SystemExit:
        pytest.fail(f"{where}: `cacheblend bench {' '.join(args)}` no longer parses")
    for spec in [*(ns.variants.split(";") if ns.variants else []), *([ns.baseline] if ns.baseline else [])]:
        parse_spec(spec)  # raises on a variant the bench would refuse


DOC_COMMANDS = [(doc.name, args) for doc in DOCS for c in _commands(doc.read_text())
                if (args := _bench_args(c)) is not None]


def test_the_docs_show_bench_commands():
    assert len(DOC_COMMANDS) >= 10, DOC_COMMANDS


@pytest.mark.parametrize(("doc", "args"), DOC_COMMANDS, ids=[f"{d}-{i}" for i, (d, _) in enumerate(DOC_COMMANDS)])
def test_bench_command_in_docs_parses(doc, args):
    _check(args, doc)


def test_docs_runs_script_parses():
    script = ROOT / "benchmarks" / "docs_runs.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    runs = [shlex.split(line)[2:] for line in script.read_text().replace("\\\n", " ").splitlines()
            if line.strip().startswith("bench ")]
    assert len(runs) >= 6  # e2e, main, chunks, musique10, qwen, the kv-dtype pair
    for args in runs:
        _check([a.replace("$kv", "bfloat16") for a in args], "docs_runs.sh")
