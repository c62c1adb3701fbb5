"""What lies in a disk store's directory, found without following a symlink.

``ROOT/.cacheblend-store`` marks a directory as a store: a directory holding other files
is refused, so maintenance never deletes what is not ours.  Entries are
``ROOT/<key[:2]>/<key>.safetensors``; anything else in those folders (stray names,
symlinks, dangling links) is reported and left alone.  A writer holds a lock on its temp
file ``.tmp-<key>-*``, so one left by a killed writer is recognised and reclaimed.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from pathlib import Path

from safetensors import safe_open

from ..cache.keys import is_entry_key
from .disk_index import Row

log = logging.getLogger("cacheblend.store")
FORMAT = "cacheblend-kv"
VERSION = "2"
MARKER = ".cacheblend-store"
TMP_PREFIX = ".tmp-"
NAMESPACES = "namespaces"


class NotAStore(ValueError):
    """A directory that is not a CacheBlend store was given as one."""


def entry_dirs(root: Path) -> list[Path]:
    """The two-character subdirectories that are real directories (never a symlink)."""
    try:
        return [d for d in sorted(root.iterdir()) if len(d.name) == 2 and not d.is_symlink() and d.is_dir()]
    except OSError:
        return []


def scan(root: Path) -> tuple[list[tuple[str, Path]], list[Path]]:
    """Every entry file as ``(key, path)``, and what else lies in the entry folders
    (stray names, symlinks, dangling links): skipped, never followed, never deleted."""
    entries, stray = [], []
    try:
        stray += [d for d in root.iterdir() if len(d.name) == 2 and d.is_symlink()]
    except OSError:
        pass
    for d in entry_dirs(root):
        try:
            names = list(d.iterdir())
        except OSError:  # a folder another user made without access for this one: left alone
            continue
        for p in names:
            if p.name.startswith(TMP_PREFIX) and not p.is_symlink():
                continue
            key = p.name.removesuffix(".safetensors")
            good = p.name.endswith(".safetensors") and is_entry_key(key) and key[:2] == d.name
            if good and not p.is_symlink() and p.is_file():
                entries.append((key, p))
            else:
                stray.append(p)
    return entries, stray


def header_rows(entries: list[tuple[str, Path]]) -> list[Row]:
    """Index rows from the entry files' own headers (a damaged one is left out: reading
    it condemns it)."""
    rows = []
    for key, path in entries:
        try:
            stat = path.stat()
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            rows.append((key, stat.st_size, stat.st_mtime, int(meta.get("origin") == "learned"),
                         int(meta.get("tokens") or 0)))
        except Exception:
            continue
    return rows


def held(path: Path) -> bool:
    """Whether a live writer holds ``path``'s lock."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def reclaim(root: Path, min_age_s: float) -> tuple[int, int]:
    """Delete temp files no live writer holds; returns (files, bytes)."""
    removed = nbytes = 0
    now = time.time()
    for d in entry_dirs(root):
        for p in d.glob(f"{TMP_PREFIX}*"):
            try:
                if p.is_symlink() or now - p.stat().st_mtime < min_age_s or held(p):
                    continue
                size = p.stat().st_size
                p.unlink()
            except OSError:
                continue
            removed, nbytes = removed + 1, nbytes + size
    return removed, nbytes


def in_flight(root: Path) -> set[str]:
    """Keys with a temp file present (being written, or not yet reclaimed)."""
    return {p.name[len(TMP_PREFIX):][:64] for d in entry_dirs(root) for p in d.glob(f"{TMP_PREFIX}*")}


def _has_files(root: Path) -> bool:
    """Anything but what a store being made by another process at this moment holds:
    the marker, the index and the namespaces folder (a store's tenants live under it)."""
    return any(p.name not in (NAMESPACES, MARKER) and not p.name.startswith("index.sqlite3")
               for p in root.iterdir())


def claim(root: Path, create: bool) -> bool:
    """Make sure ``root`` is a store (or an empty or new directory to make one in);
    returns whether it can be written."""
    marker = root / MARKER
    if marker.is_file():
        return os.access(root, os.W_OK)
    if not root.exists():
        if not create:
            raise NotAStore(f"no CacheBlend store at {root}")
        try:
            root.mkdir(parents=True)
        except OSError as e:
            log.warning("disk tier %s cannot be created (%s); serving without it", root, e)
            return False
    elif not root.is_dir():
        raise NotAStore(f"{root} is not a directory")
    elif not (root / "index.sqlite3").exists() and (not create or _has_files(root)) and not marker.is_file():
        raise NotAStore(f"{root} is not a CacheBlend store (no {MARKER} marker file) and is not empty: "
                        "give a new or empty directory")
    try:  # a new store, or one made before stores were marked
        marker.write_text(json.dumps({"format": FORMAT, "version": VERSION}) + "\n")
        return True
    except OSError as e:
        log.warning("disk tier %s cannot be written (%s); serving read-only", root, e)
        return False
