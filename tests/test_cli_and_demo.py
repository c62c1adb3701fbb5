"""The command line and the README's demo, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PASSAGES, make_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "cacheblend.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, timeout=600)


def test_ingest_then_ask_reuses_stored_chunks(tmp_path, default_model_dir):
    model = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    files = []
    for i, text in enumerate(PASSAGES):
        files.append(tmp_path / f"p{i}.txt")
        files[-1].write_text(text)
    store = f"memory,disk:{tmp_path / 'kv'}"
    out = _cli("ingest", *map(str, files), "--model", str(model), "--store", store)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(lines) == len(PASSAGES) and all(line["tokens"] > 0 for line in lines)

    ask = _cli("ask", "Where did Ida Haendel live?", "--chunks", *map(str, files), "--model", str(model),
               "--store", store, "--max-new-tokens", "5", "--method", "blend")
    assert ask.returncode == 0, ask.stderr
    stats = json.loads(ask.stderr.strip().splitlines()[-1])
    assert stats["store_misses"] == 1  # only the system prefix: every chunk came from disk
    assert stats["store_hits"] == len(PASSAGES)


def test_ask_rejects_bad_ratio(tmp_path, default_model_dir):
    model = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    out = _cli("ask", "q?", "--model", str(model), "--store", "memory", "--ratio", "1.5")
    assert out.returncode != 0
    assert "recompute_ratio must be within [0, 1]" in out.stderr


@pytest.mark.slow
def test_demo_prints_answers_and_ttft(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py")], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[ full] TTFT" in out.stdout and "[blend] TTFT" in out.stdout
    assert out.stdout.count("answer:") == 2
    assert "lower than full prefill" in out.stdout


def test_store_commands(tmp_path):
    import torch

    from cacheblend.store import ChunkKV, DiskStore

    disk = DiskStore(tmp_path / "kv")
    for i in range(3):
        disk.put(f"{i:064x}", ChunkKV(torch.randn(2, 1, 4, 8), torch.randn(2, 1, 4, 8)))
    bad = disk.path(f"{1:064x}")
    data = bytearray(bad.read_bytes())
    data[-2] ^= 0xFF
    bad.write_bytes(bytes(data))
    orphan = bad.parent / ".tmp-left-by-a-killed-writer"
    orphan.write_bytes(b"partial")
    os.utime(orphan, (0, 0))  # old, and no writer holds its lock: reclaimed at the next open
    spec = f"disk:{tmp_path / 'kv'}"

    stats = json.loads(_cli("store", "stats", "--store", spec).stdout)
    assert stats[0]["entries"] == 3 and stats[0]["reclaimed_bytes"] == len(b"partial") and not orphan.exists()
    verify = _cli("store", "verify", "--store", spec)
    assert json.loads(verify.stdout)[0] == {"tier": "disk", "checked": 3, "dropped": 1, "temp_files_removed": 0,
                                            "stale_index_rows": 0, "stray_files": 0}
    assert "verify disk" in verify.stderr  # the progress bar
    assert json.loads(_cli("store", "gc", "--store", spec).stdout)[0]["temp_files_removed"] == 0
    refused = _cli("store", "clear", "--store", spec)  # no terminal to ask: nothing is deleted
    assert refused.returncode == 1 and "--yes" in refused.stderr
    assert json.loads(_cli("store", "stats", "--store", spec).stdout)[0]["entries"] == 2
    _cli("store", "clear", "--store", spec, "--yes")
    assert json.loads(_cli("store", "stats", "--store", spec).stdout)[0]["entries"] == 0


@pytest.mark.parametrize("args, says", [
    (["ask", "q?", "--model", "/no/such/model"], "model '/no/such/model' not found"),
    (["ask", "q?", "--store", "bogus:1"], "unknown store tier 'bogus:1'"),
    (["ingest", "/no/such/file.txt", "--store", "memory"], "no such file"),
    (["ask", "q?", "--ratio", "most"], "must be a number within [0, 1], 'auto' or 'guard'"),
])
def test_bad_arguments_are_one_line_errors(args, says):
    out = _cli(*args)
    assert out.returncode == 2 and says in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) <= 3  # argparse: usage + error


def test_version_and_debug():
    from cacheblend import __version__

    assert _cli("--version").stdout.strip() == f"cacheblend {__version__}"
    out = _cli("--debug", "ask", "q?", "--model", "/no/such/model")
    assert out.returncode != 0 and "Traceback" in out.stderr


@pytest.mark.parametrize("action", ["clear", "verify", "gc"])
def test_store_commands_on_an_unreachable_redis_fail_instead_of_reporting_success(action):
    """The Redis tier turns a connection error into a miss, right for a request; the
    maintenance commands took that for success ('"cleared": true', exit 0)."""
    from cacheblend.integrations.vllm_server import free_port

    port = free_port()  # nothing listens there
    out = subprocess.run([sys.executable, "-m", "cacheblend.cli", "store", action, "--yes", "--store",
                          f"redis://127.0.0.1:{port}/0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "could not be reached" in out.stderr, (out.stdout, out.stderr)


def test_ask_options_and_ingest_says_what_it_stored(tmp_path, default_model_dir):
    model = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    chunk = tmp_path / "c.txt"
    chunk.write_text(PASSAGES[0])
    store = f"disk:{tmp_path / 'kv'}"
    first = _cli("ingest", str(chunk), "--model", str(model), "--store", store)
    again = _cli("ingest", str(chunk), "--model", str(model), "--store", store)
    assert json.loads(first.stdout)["stored"] is True and json.loads(again.stdout)["stored"] is False
    assert "Loading weights" not in first.stderr  # transformers' load bar is silenced
    ask = _cli("ask", "Where?", "--chunks", str(chunk), "--model", str(model), "--store", store, "--ratio", "auto",
               "--seed", "3", "--temperature", "0.7", "--stop", "zzz", "--preamble", "Read this.",
               "--max-new-tokens", "3")
    assert ask.returncode == 0, ask.stderr
    stats = json.loads(ask.stderr.strip().splitlines()[-1])
    assert stats["controller"] is not None and stats["store_hits"] == 1


def test_split_keeps_non_ascii_separators_and_reads_escapes(tmp_path):
    from cacheblend.cli import _read_chunks, _split

    assert (_split("—"), _split("§"), _split("\\n\\n"), _split("\\u2014")) == ("—", "§", "\n\n", "—")
    assert _split(None) is None
    doc = tmp_path / "doc.txt"
    doc.write_text("alpha — beta\n\ngamma", encoding="utf-8")
    assert _read_chunks([doc], _split("—")) == ["alpha", "beta\n\ngamma"]
    assert _read_chunks([doc], _split("\\n\\n")) == ["alpha — beta", "gamma"]
    with pytest.raises(ValueError, match="--split .* bad backslash escape"):
        _split("\\x")


def test_clearing_several_tiers_asks_once_before_touching_any(tmp_path, monkeypatch, capsys):
    """``store clear`` asked per tier and deleted as it went: "y" then "n" wiped the first
    tier and reported "nothing deleted"; the question went to stdout, the JSON's channel."""
    import torch

    from cacheblend.cli import app
    from cacheblend.store import ChunkKV, DiskStore

    for name in ("a", "b"):
        DiskStore(tmp_path / name).put("ab" + "1" * 62, ChunkKV(torch.randn(2, 1, 4, 8), torch.randn(2, 1, 4, 8)))
    answers = iter(["y", "n"])
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda *a: next(answers))
    assert app(["store", "clear", "--store", f"disk:{tmp_path / 'a'},disk:{tmp_path / 'b'}"]) == 0
    out = capsys.readouterr()
    assert [r["cleared"] for r in json.loads(out.out)] == [True, True]  # stdout: the JSON alone
    assert str(tmp_path / "a") in out.err and str(tmp_path / "b") in out.err  # one question naming both
    assert len(DiskStore(tmp_path / "a")) == len(DiskStore(tmp_path / "b")) == 0
