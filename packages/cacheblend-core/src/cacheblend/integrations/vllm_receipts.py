"""Fidelity receipts of streamed answers, kept until the client fetches them.

vLLM 0.32's OpenAI server returns a request's ``kv_transfer_params`` (where the connector's
marker and the worker's fidelity receipt travel back) in non-streamed responses only.  A
client that streams tags its request instead (``"receipt": TAG`` in ``kv_transfer_params``,
TAG a random token of 16 to 64 letters, digits, ``-`` or ``_``); when the request finishes,
the connector's scheduler side (vLLM's EngineCore process) writes the marker it returns in
a non-streamed response to a small file, and the HTTP guard (:mod:`.vllm_http`, in the API
server's process) answers ``GET /v1/cacheblend/receipts/TAG`` with it, once.

Both processes find the folder from vLLM's ``kv_transfer_config.engine_id``, which the API
server draws at start-up and hands to the engine core: ``<tmp>/cacheblend-receipts-<id>``,
private to the server's user.  A file is written before vLLM sends the request's last
output, so it is there when the client's stream ends; receipts nobody fetches are deleted
after :data:`TTL_S`.  This module imports neither vLLM nor torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["RECEIPT_HEADER", "RECEIPT_ROUTE", "RECEIPT_WAIT_S", "TTL_S", "ReceiptBox", "receipt_dir", "valid_tag"]

RECEIPT_ROUTE = "/v1/cacheblend/receipts/"  # + TAG; the guard serves it
# on the guard's own answers on that route: a 404 with it means "not (yet) there", one
# without it a server that has no guard (the client then stops tagging)
RECEIPT_HEADER = "x-cacheblend-receipts"
# how long the guard waits for the receipt of a request that went through it: one written a
# step after its stream ended (a stop string, found in the API server) comes that late
RECEIPT_WAIT_S = 10.0
TTL_S = 600.0  # a receipt not fetched within this many seconds is deleted
_PRUNE_EVERY_S = 60.0  # at most one sweep for stale receipts a minute (it lists the folder)
_TAG = re.compile(r"[0-9A-Za-z_-]{16,64}")
_FILE = re.compile(r"\.?[0-9A-Za-z_-]{16,64}(\.json|\.[0-9]+\.[0-9]+\.(tmp|taking))")  # what a box writes
_SAFE_ID = re.compile(r"[0-9A-Za-z_-]{1,48}")

log = logging.getLogger("vllm.cacheblend")


def valid_tag(tag: Any) -> bool:
    """Whether ``tag`` can name a receipt (it becomes a file name: no path characters)."""
    return isinstance(tag, str) and _TAG.fullmatch(tag) is not None


def receipt_dir(engine_id: str) -> Path:
    """The folder the processes of one vLLM server share receipts through.  An id that is
    not a short plain name is hashed, so two ids never share a folder."""
    engine_id = re.sub(r"_dp[0-9]+$", "", engine_id)  # a data-parallel engine core's id
    name = engine_id if _SAFE_ID.fullmatch(engine_id) else hashlib.sha256(engine_id.encode()).hexdigest()[:32]
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"cacheblend-receipts-{uid}-{name}"


def _private_folder(folder: Path) -> bool:
    """Make ``folder`` (mode 0700) or accept it if it is already a real folder of this user
    that nobody else can open; False (logged) otherwise."""
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        log.warning("CacheBlend: no receipts for streamed answers: cannot make %s (%s)", folder, e)
        return False
    try:
        st = os.lstat(folder)
    except OSError as e:
        log.warning("CacheBlend: no receipts for streamed answers: %s (%s)", folder, e)
        return False
    mine = not hasattr(os, "getuid") or st.st_uid == os.getuid()
    if not stat.S_ISDIR(st.st_mode) or not mine or st.st_mode & 0o077:
        log.warning("CacheBlend: no receipts for streamed answers: %s is not a private folder of this user "
                    "(a link, another owner, or open to others)", folder)
        return False
    return True


class ReceiptBox:
    """Receipts by tag, one JSON file each.  Nothing here raises (the scheduler side must
    not: an exception there stops vLLM's engine); a receipt that cannot be written is
    logged and the client keeps the receipt of what it asked for."""

    def __init__(self, folder: Path, ttl_s: float = TTL_S) -> None:
        self.folder = Path(folder)
        self.ttl_s = ttl_s
        self.usable = _private_folder(self.folder)  # made here, once: a removed one is not made again
        self._pruned = time.monotonic()
        self._count = 0  # makes each temporary name of this process unique

    def _name(self, tag: str, kind: str) -> Path:
        self._count += 1
        return self.folder / f".{tag}.{os.getpid()}.{self._count}.{kind}"

    def put(self, tag: str, marker: dict[str, Any]) -> None:
        if not self.usable or not valid_tag(tag):
            return
        tmp = self._name(tag, "tmp")
        try:
            data = json.dumps(marker).encode()
            # a fresh file of this user's (never one a link points to), renamed into place
            # whole: a reader never sees half a receipt
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.folder / f"{tag}.json")
        except FileNotFoundError:
            log.debug("CacheBlend: the receipt folder %s is gone (the server is stopping)", self.folder)
            return
        except (OSError, TypeError, ValueError) as e:
            log.warning("CacheBlend: could not keep the receipt of a streamed request (%s: %s)", type(e).__name__, e)
            tmp.unlink(missing_ok=True)
            return
        if time.monotonic() - self._pruned >= _PRUNE_EVERY_S:
            self.prune()

    def take(self, tag: str) -> dict[str, Any] | None:
        """The receipt tagged ``tag``, removed from the box; None if there is none.  The file
        is claimed by renaming it first, so two servers' guards never both serve it."""
        if not self.usable or not valid_tag(tag):
            return None
        claimed = self._name(tag, "taking")
        try:
            os.rename(self.folder / f"{tag}.json", claimed)
        except OSError:
            return None
        try:
            marker = json.loads(claimed.read_bytes())
        except (OSError, ValueError):
            return None
        finally:
            claimed.unlink(missing_ok=True)
        return marker if isinstance(marker, dict) else None

    def prune(self, now: float | None = None) -> int:
        """Delete receipts (and leftovers of writes and takes) older than the TTL; how many went.
        Only files named as this module names them are touched."""
        self._pruned = time.monotonic()
        if not self.usable:
            return 0
        cutoff = (time.time() if now is None else now) - self.ttl_s
        gone = 0
        try:
            with os.scandir(self.folder) as entries:
                for entry in entries:
                    try:
                        if (_FILE.fullmatch(entry.name) and entry.is_file(follow_symlinks=False)
                                and entry.stat(follow_symlinks=False).st_mtime < cutoff):
                            os.unlink(entry.path)
                            gone += 1
                    except OSError:
                        continue
        except OSError:
            pass
        return gone

    def close(self) -> None:
        """Remove the folder (the server is stopping: nobody can fetch its receipts)."""
        if self.usable:
            self.usable = False
            shutil.rmtree(self.folder, ignore_errors=True)
