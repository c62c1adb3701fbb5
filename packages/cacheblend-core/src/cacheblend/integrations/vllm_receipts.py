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

import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["RECEIPT_ROUTE", "TTL_S", "ReceiptBox", "receipt_dir", "valid_tag"]

RECEIPT_ROUTE = "/v1/cacheblend/receipts/"  # + TAG; the guard serves it
TTL_S = 600.0  # a receipt not fetched within this many seconds is deleted
_PRUNE_EVERY = 64  # writes between two sweeps of the folder for stale receipts
_TAG = re.compile(r"[0-9A-Za-z_-]{16,64}")

log = logging.getLogger("vllm.cacheblend")


def valid_tag(tag: Any) -> bool:
    """Whether ``tag`` can name a receipt (it becomes a file name: no path characters)."""
    return isinstance(tag, str) and _TAG.fullmatch(tag) is not None


def receipt_dir(engine_id: str) -> Path:
    """The folder the two processes of one vLLM server share receipts through."""
    return Path(tempfile.gettempdir()) / f"cacheblend-receipts-{re.sub(r'[^0-9A-Za-z_-]', '_', engine_id)[:64]}"


class ReceiptBox:
    """Receipts by tag, one JSON file each.  Writing never raises (the scheduler side must
    not: an exception there stops vLLM's engine); a receipt that cannot be written is
    logged and the client keeps the receipt of what it asked for."""

    def __init__(self, folder: Path, ttl_s: float = TTL_S) -> None:
        self.folder = Path(folder)
        self.ttl_s = ttl_s
        self._writes = 0

    def put(self, tag: str, marker: dict[str, Any]) -> None:
        if not valid_tag(tag):
            return
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = self.folder / f".{tag}.tmp"
            tmp.write_text(json.dumps(marker))
            os.replace(tmp, self.folder / f"{tag}.json")  # a reader never sees half a receipt
        except (OSError, TypeError, ValueError) as e:
            log.warning("CacheBlend: could not keep the receipt of a streamed request (%s: %s)", type(e).__name__, e)
            return
        self._writes += 1
        if self._writes % _PRUNE_EVERY == 0:
            self.prune()

    def take(self, tag: str) -> dict[str, Any] | None:
        """The receipt tagged ``tag``, removed from the box; None if there is none."""
        if not valid_tag(tag):
            return None
        path = self.folder / f"{tag}.json"
        try:
            text = path.read_text()
            path.unlink(missing_ok=True)
            marker = json.loads(text)
        except (OSError, ValueError):
            return None
        return marker if isinstance(marker, dict) else None

    def prune(self, now: float | None = None) -> int:
        """Delete receipts older than the TTL; how many went."""
        cutoff = (time.time() if now is None else now) - self.ttl_s
        gone = 0
        try:
            for path in self.folder.iterdir():
                try:
                    if path.stat().st_mtime < cutoff:
                        path.unlink(missing_ok=True)
                        gone += 1
                except OSError:
                    continue
        except OSError:
            pass
        return gone

    def close(self) -> None:
        """Remove the folder (the server is stopping: nobody can fetch its receipts)."""
        shutil.rmtree(self.folder, ignore_errors=True)
