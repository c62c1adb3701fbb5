"""The folder where a vLLM server keeps streamed answers' receipts (vllm_receipts.py): it
never raises into vLLM's engine, forgets what nobody fetched, and, being in the shared
temp folder, is never steered elsewhere by another user's links or folders."""

from __future__ import annotations

import os
import time

import pytest

from cacheblend.integrations.vllm_receipts import ReceiptBox, receipt_dir


def test_the_receipt_box_never_raises_and_forgets_what_nobody_fetched(tmp_path, caplog):
    box = ReceiptBox(tmp_path / "box", ttl_s=60)
    box.put("x" * 16, {"cacheblend": {}})
    box.put("y" * 16, {"cacheblend": {}})
    old = time.time() - 120
    os.utime(tmp_path / "box" / f"{'x' * 16}.json", (old, old))
    assert box.prune() == 1 and box.take("x" * 16) is None and box.take("y" * 16) == {"cacheblend": {}}
    assert box.take("y" * 16) is None  # once
    box.put("../../escape-here", {})  # not a tag: never a file name
    box.put("z" * 16, {"not json": object()})  # cannot be written: logged, not raised
    assert "could not keep the receipt" in caplog.text
    (tmp_path / "file").write_text("")
    blocked = ReceiptBox(tmp_path / "file" / "box")  # a folder that cannot be made
    blocked.put("w" * 16, {})
    assert not blocked.usable and blocked.take("w" * 16) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["box", "file"]
    assert list((tmp_path / "box").iterdir()) == []


def test_a_closed_box_is_not_made_again(tmp_path):
    """The API server removes the folder at shutdown; an engine core still finishing a request
    must not bring it back (nobody would remove it)."""
    writer, reader = ReceiptBox(tmp_path / "box"), ReceiptBox(tmp_path / "box")
    reader.close()
    writer.put("a" * 16, {"cacheblend": {}})
    assert not (tmp_path / "box").exists()


@pytest.mark.skipif(not hasattr(os, "symlink") or not hasattr(os, "getuid"), reason="POSIX links and owners")
def test_a_folder_that_is_not_private_to_this_user_is_not_used(tmp_path, caplog):
    """Another user can make the folder's name in the shared temp folder first: a link to
    somewhere else, or a folder others can write.  Nothing is written, pruned or removed
    through it."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    victim = target / ("v" * 16 + ".json")
    victim.write_text("{}")
    old = time.time() - 10_000
    os.utime(victim, (old, old))
    (tmp_path / "link").symlink_to(target)
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    for folder in (tmp_path / "link", open_to_all):
        box = ReceiptBox(folder, ttl_s=1)
        box.put("a" * 16, {"cacheblend": {}})
        assert not box.usable and box.prune() == 0 and box.take("v" * 16) is None
        box.close()
    assert victim.exists() and sorted(p.name for p in target.iterdir()) == [victim.name]
    assert list(open_to_all.iterdir()) == [] and "not a private folder" in caplog.text


def test_prune_touches_only_receipts(tmp_path):
    box = ReceiptBox(tmp_path / "box", ttl_s=1)
    box.put("r" * 16, {"cacheblend": {}})
    other = tmp_path / "box" / "notes.txt"
    other.write_text("not a receipt")
    old = time.time() - 100
    for path in (tmp_path / "box").iterdir():
        os.utime(path, (old, old))
    assert box.prune() == 1 and [p.name for p in (tmp_path / "box").iterdir()] == ["notes.txt"]


def test_every_engine_core_of_a_server_shares_its_folder_and_servers_never_do():
    """vLLM appends ``_dp<rank>`` to the engine id in each data-parallel engine core; the API
    server keeps the bare id.  Ids that differ only in characters a file name cannot hold
    get folders of their own."""
    assert receipt_dir("abc123_dp1") == receipt_dir("abc123") == receipt_dir("abc123_dp0")
    assert receipt_dir("a/b") != receipt_dir("a_b") and receipt_dir("x" * 70) != receipt_dir("x" * 71)
    assert receipt_dir("a/b").parent == receipt_dir("abc").parent
