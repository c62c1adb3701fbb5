"""The passage registry and token-level chunk matching of the vLLM connector.

No vLLM import here: the application process that ingests chunks (which need not have
vLLM installed) registers their texts with :func:`register_passages`, and the
connector's scheduler side, inside vLLM, reads them back (:class:`ChunkMatcher`)."""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

RETRY_AFTER_S = 5.0  # a registry that could not be read is asked again after this long
_ANCHOR = 4  # chunks are indexed by their first ids; shorter chunks are not worth matching
_LOCK = threading.Lock()

REDIS_PASSAGES_KEY = "cacheblend:passages"  # the default namespace's set
_VERSION = ":version"  # after the set's key: a counter of register_passages calls
REDIS_TIMEOUT_S = 2.0
log = logging.getLogger("vllm.cacheblend")


def passages_key(namespace: str | None = None) -> str:
    """The Redis set of a namespace's passages (``namespace=`` of the store spec): tenants
    sharing one Redis server never see each other's registry."""
    from ..store.spec import namespaced_prefix

    return f"{namespaced_prefix(namespace)}:passages"


def _is_redis(path: str | os.PathLike) -> bool:
    return str(path).startswith(("redis://", "rediss://", "unix://"))


@functools.lru_cache(maxsize=16)
def _redis(url: str):
    """One client per URL, with timeouts: the scheduler reads the registry inside vLLM's
    step, which a Redis that stopped answering must not hold for ever."""
    import redis

    return redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)


def _safe_path(path: str | os.PathLike) -> str:
    """A registry path fit for a log line: a Redis URL without its password."""
    from ..store.redis_tier import redact

    return redact(str(path)) if _is_redis(path) else str(path)


def register_passages(path: str | os.PathLike, texts: Iterable[str], namespace: str | None = None) -> int:
    """Add passage ``texts`` not yet in the registry at ``path`` and return how many were new.

    ``path`` is a JSON-lines file (one JSON string a line) on a filesystem every process
    sees, or a ``redis://`` URL: then the texts go into the Redis set
    ``cacheblend:passages`` (``cacheblend.NAMESPACE:passages`` for a namespace), which is
    how servers on several hosts that share a Redis store tier also share what to look
    for.  Call it where the chunks are ingested."""
    new = [t for t in dict.fromkeys(texts) if isinstance(t, str) and t.strip()]
    if _is_redis(path):
        if not new:
            return 0
        key = passages_key(namespace)
        with _redis(str(path)).pipeline() as pipe:  # one transaction: the set and its version
            added, _ = pipe.sadd(key, *new).incr(key + _VERSION).execute()
        return int(added)
    p = Path(path)
    known = set(read_passages(p))
    new = [t for t in new if t not in known]
    if new:
        p.parent.mkdir(parents=True, exist_ok=True)
        with _LOCK, p.open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps(t) + "\n" for t in new))  # one write: whole lines
    return len(new)


def read_passages(path: str | os.PathLike, namespace: str | None = None) -> list[str]:
    """The registry's texts; a missing file is empty, a torn last line skipped."""
    if _is_redis(path):
        return sorted(m.decode("utf-8") for m in _redis(str(path)).smembers(passages_key(namespace)))
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            text = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(text, str):
            out.append(text)
    return out


def _registry_version(path: str | os.PathLike, namespace: str | None) -> object:
    """What changes when passages are added: a file's mtime; a Redis set's size with the
    counter :func:`register_passages` increments (the size alone missed an add that
    followed a removal; the counter alone, texts added by other means)."""
    if _is_redis(path):
        key = passages_key(namespace)
        with _redis(str(path)).pipeline(transaction=False) as pipe:
            return tuple(pipe.scard(key).get(key + _VERSION).execute())
    try:
        return Path(path).stat().st_mtime
    except FileNotFoundError:
        return None


class ChunkMatcher:
    """Finds known chunks in a prompt's token ids, exactly as the core would tokenize them.

    Each passage gives two id runs: the chunk as ingested (``text`` + separator) and the
    bare text (a template may follow it with anything); the longest run that matches wins."""

    def __init__(self, encode, separator: str = "\n\n", path: str | os.PathLike | None = None,
                 namespace: str | None = None) -> None:
        self.encode, self.separator = encode, separator
        self.path, self.namespace = path or None, namespace
        self._mtime: object = None  # the registry's version when last read
        self._failed_at: float | None = None  # when the registry last could not be read
        self._texts: set[str] = set()
        self._by_anchor: dict[tuple[int, ...], list[tuple[int, ...]]] = {}

    def add(self, texts: Iterable[str]) -> None:
        for text in texts:
            if text in self._texts or not text.strip():
                continue
            self._texts.add(text)
            for ids in {tuple(self.encode(text + self.separator)), tuple(self.encode(text))}:
                if len(ids) >= _ANCHOR:
                    bucket = self._by_anchor.setdefault(ids[:_ANCHOR], [])
                    bucket.append(ids)
                    bucket.sort(key=len, reverse=True)

    def refresh(self) -> None:
        """Re-read the registry if it changed since the last read.  A registry that cannot
        be read (Redis restarting, a file being replaced) keeps the passages read before,
        with the reason logged: a scheduler that raised here took the vLLM server down.
        After a failure it is not asked again for :data:`RETRY_AFTER_S`: this runs on vLLM's
        scheduler thread for every new request, and a Redis that stopped answering cost each
        of them the connection timeout while every running request waited."""
        if self.path is None:
            return
        if self._failed_at is not None and time.monotonic() - self._failed_at < RETRY_AFTER_S:
            return
        try:
            version = _registry_version(self.path, self.namespace)
            if version is not None and version != self._mtime:
                texts = read_passages(self.path, self.namespace)
                self._mtime = version
                self.add(texts)
            self._failed_at = None
        except Exception as e:  # noqa: BLE001 - Redis or file errors of any kind: served from what is known
            self._failed_at = time.monotonic()
            log.warning("CacheBlend: the passage registry %s cannot be read (%s: %s); matching the %d passages "
                        "read before, asking again in %.0f s", _safe_path(self.path), type(e).__name__, e,
                        len(self._texts), RETRY_AFTER_S)

    def find(self, ids: Sequence[int], end_limit: int | None = None) -> list[tuple[int, int]]:
        """Non-overlapping ``(start, end)`` spans of known chunks in ``ids``, left to right,
        each ending at or before ``end_limit`` (default: all of ``ids``)."""
        limit = len(ids) if end_limit is None else end_limit
        spans: list[tuple[int, int]] = []
        i = 0
        while i + _ANCHOR <= limit:
            hit = None
            for cand in self._by_anchor.get(tuple(ids[i : i + _ANCHOR]), ()):
                if i + len(cand) <= limit and tuple(ids[i : i + len(cand)]) == cand:
                    hit = (i, i + len(cand))
                    break
            if hit:
                spans.append(hit)
                i = hit[1]
            else:
                i += 1
        return spans
