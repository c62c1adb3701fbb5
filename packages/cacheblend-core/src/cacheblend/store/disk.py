"""Disk tier: one safetensors file per chunk, written atomically, verified on read.

Layout: ``ROOT/<key[:2]>/<key>.safetensors`` holding ``k.<layer>`` and ``v.<layer>``
tensors (``[kv_heads, tokens, head_dim]``), so one layer can be read without the rest
(pipelined loading).  The header metadata carries the format version, the key, the
shape, who made it (model fingerprint, precompute policy, token-ids hash), a digest per
layer (:data:`~.entry.DIGEST`; older entries SHA-256) and, with a store secret, a
signature.  An entry that is truncated, corrupted, unsigned or not what its name says
is counted, deleted and reported as a miss, so the engine recomputes it — never serves it.

``ROOT/index.sqlite3`` (:mod:`.disk_index`) drives LRU eviction within the byte budget
and heals itself from the entries' headers; :mod:`.disk_layout` finds the files, never
following a symlink, and refuses a directory that is not a store.
No pickle anywhere: safetensors and SQLite only.
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import sqlite3
import tempfile
import threading
import time
from pathlib import Path

from safetensors.torch import save as st_save

from ..cache.keys import is_entry_key
from .disk_index import DiskIndex, IndexUnwritable, Row
from .disk_layout import FORMAT, NAMESPACES, TMP_PREFIX, VERSION, NotAStore, claim, header_rows, in_flight, scan
from .disk_layout import reclaim as reclaim_temp
from .disk_source import DiskSource
from .entry import DIGEST, DIGESTS_FIELD, ChunkKV, CorruptEntry, layer_digest, read_entry, verify_entries
from .signing import SIGNATURE, Signer
from .spec import check_namespace

log = logging.getLogger("cacheblend.store")
__all__ = ["FORMAT", "VERSION", "DiskSource", "DiskStore", "NotAStore"]


class DiskStore:
    """Chunk caches as files under ``root``, at most ``capacity_bytes`` in all (LRU).

    ``namespace``: a tenant's entries live in ``root/namespaces/NAME``.  ``signer``: sign
    entries and reject unsigned ones.  ``create=False``: refuse a path that is not a
    store yet (the maintenance commands)."""

    def __init__(self, root: str | os.PathLike, capacity_bytes: int | None = None, *,
                 namespace: str | None = None, signer: Signer | None = None, create: bool = True) -> None:
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError("disk capacity must be positive")
        self.root = Path(root).expanduser()
        if namespace is not None:
            self.root = self.root / NAMESPACES / check_namespace(namespace)
        self.capacity_bytes, self.signer, self.namespace = capacity_bytes, signer, namespace
        self.corrupt = self.unsigned = self.write_errors = self.evictions = self.skipped_writes = 0
        self.reclaimed_bytes = 0
        self.condemning = True  # entries that fail verification are deleted
        self.last_error: str | None = None
        self._lock = threading.Lock()
        writable = claim(self.root, create)
        self.index = DiskIndex(self.root, self._rows, writable)
        if not self.index.read_only:  # what killed writers left: temp files and their reservations
            self.reclaim()
            self._drop_stale(2.0)

    # -- files -------------------------------------------------------------------------
    def path(self, key: str) -> Path:
        if not is_entry_key(key):
            raise ValueError(f"not a chunk key: {key!r}")
        return self.root / key[:2] / f"{key}.safetensors"

    def _file(self, key: str) -> Path | None:
        """The entry's path if it is a real file inside the store (no symlink on the way);
        None too where it cannot be looked at (a folder another user made without access
        for this one: a miss, not an exception on the request path)."""
        try:
            return self._real_file(key)
        except OSError as e:
            self.last_error = f"{type(e).__name__}: {e}"
            return None

    def _real_file(self, key: str) -> Path | None:
        """:meth:`_file`, raising ``OSError`` where it cannot tell."""
        path = self.path(key)
        if path.parent.is_symlink() or path.is_symlink() or not path.is_file():
            return None
        return path

    def files(self) -> tuple[list[tuple[str, Path]], list[Path]]:
        """Entry files as ``(key, path)`` and stray files (see :func:`.disk_layout.scan`)."""
        return scan(self.root)

    def _rows(self) -> list[Row]:
        return header_rows(scan(self.root)[0])

    # -- index -----------------------------------------------------------------------
    def reindex(self) -> int:
        """Rebuild the index from the entry files (after a crash, a copy or a loss)."""
        return self.index.rebuild()

    @property
    def read_only(self) -> bool:
        return self.index.read_only

    @property
    def nbytes(self) -> int:
        return int(self.index.sql("SELECT COALESCE(SUM(bytes), 0) FROM entries")[0][0])

    def __contains__(self, key: str) -> bool:
        return self._file(key) is not None

    def __len__(self) -> int:
        return int(self.index.sql("SELECT COUNT(*) FROM entries")[0][0])

    def keys(self) -> list[str]:
        return [r[0] for r in self.index.sql("SELECT key FROM entries ORDER BY used")]

    # -- reads ---------------------------------------------------------------------
    def open(self, key: str) -> DiskSource | None:
        """A layer-wise reader for ``key``, or None (absent or untrustworthy)."""
        path = self._file(key)
        if path is None:
            return None
        try:
            source = DiskSource(self, key, path)
        except FileNotFoundError:
            return None
        except CorruptEntry as e:
            self.last_error = str(e)
            self.condemn(key)
            return None
        self.index.write("UPDATE entries SET used = ? WHERE key = ?", (time.time(), key))
        return source

    def get(self, key: str) -> ChunkKV | None:
        return read_entry(self.open(key))

    def condemn(self, key: str) -> None:
        """Count and remove an entry that failed verification (unless ``condemning`` is
        off: ``cacheblend store verify``'s look at a sample before it drops anything)."""
        if not self.condemning:
            return
        with self._lock:
            self.corrupt += 1
        self.delete(key)

    # -- writes --------------------------------------------------------------------
    def put(self, key: str, kv: ChunkKV) -> bool:
        """Store ``kv``; False when it is skipped (too big, read-only, disk full): a write
        the tier cannot make never fails the request that asked for it."""
        path = self.path(key)
        if not self.index.writable() or path.parent.is_symlink():
            self.skipped_writes += 1
            return False
        blob = st_save(*self._encode(key, kv))
        try:
            if not self._reserve(key, len(blob), kv.meta.get("origin") == "learned", kv.num_tokens):
                self.skipped_writes += 1
                return False
            path.parent.mkdir(exist_ok=True)
            if not self._write(key, blob, path):
                # another process evicted this reservation while we wrote: its row is gone
                # already, and deleting "our" row now could delete a newer writer's (whose
                # file would then sit outside the index, over the capacity)
                self.skipped_writes += 1
                return False
        except (OSError, sqlite3.Error, IndexUnwritable) as e:  # full, read-only, gone
            self._unreserve(key)
            self._write_failed(e)
            return False
        return True

    def _unreserve(self, key: str) -> None:
        """Undo a failed write's reservation.  A rewrite (the hint backfill on a full disk)
        leaves the entry it meant to replace in place: that file keeps a row with its own
        size, so it stays counted and evictable instead of being served from outside the index."""
        path = self._file(key)
        try:
            size = path.stat().st_size if path is not None else None
        except OSError:
            size = None
        if size is None:
            self.index.write("DELETE FROM entries WHERE key = ?", (key,))
        else:
            self.index.write("INSERT INTO entries (key, bytes, used) VALUES (?, ?, ?) "
                             "ON CONFLICT(key) DO UPDATE SET bytes = excluded.bytes", (key, size, time.time()))

    def _encode(self, key: str, kv: ChunkKV) -> tuple[dict, dict[str, str]]:
        tensors = {}
        for i in range(kv.num_layers):
            tensors[f"k.{i}"] = kv.k[i].contiguous()
            tensors[f"v.{i}"] = kv.v[i].contiguous()
        digests = [layer_digest(*kv.layer(i)) for i in range(kv.num_layers)]
        meta = {str(k): str(v) for k, v in kv.meta.items() if k != SIGNATURE}
        meta |= {"format": FORMAT, "version": VERSION, "key": key, "layers": str(kv.num_layers),
                 "tokens": str(kv.num_tokens), "dtype": str(kv.k.dtype), "digest": DIGEST}
        if self.signer is not None:
            meta[SIGNATURE] = self.signer.sign(key, meta, digests)
        return tensors, meta | {DIGESTS_FIELD: json.dumps(digests)}

    def _write(self, key: str, blob: bytes, path: Path) -> bool:
        """Write to a temp file we hold a lock on, then move it into place; False when the
        reservation was evicted meanwhile (the file is dropped)."""
        fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{key}-", dir=path.parent)
        published = False
        try:
            with os.fdopen(fd, "wb") as f:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # "a live writer": reclaim leaves it alone
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
                published = self._publish(key, tmp, path)
        finally:
            if not published:
                Path(tmp).unlink(missing_ok=True)
        return published

    def _write_failed(self, e: BaseException) -> None:
        with self._lock:
            self.write_errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
        if self.write_errors == 1:  # say so once; the stats keep counting
            log.warning("disk tier %s cannot be written (%s); carrying on with the other tiers",
                        self.root, self.last_error)

    def _reserve(self, key: str, size: int, learned: bool = False, tokens: int = 0) -> bool:
        """Record ``key`` in the index, evicting entries so the total stays within the
        capacity (one transaction, so concurrent writers agree): learned chunks (found in
        prompts) least recently used first, then ingested ones least recently used first."""
        cap = self.capacity_bytes
        if cap is not None and size > cap:
            return False

        def reserve(db: sqlite3.Connection) -> list[str] | None:
            evicted: list[str] = []
            db.execute("DELETE FROM entries WHERE key = ?", (key,))
            if cap is not None:
                total = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM entries").fetchone()[0]
                for old, nbytes in db.execute("SELECT key, bytes FROM entries ORDER BY learned DESC, used").fetchall():
                    if total + size <= cap:
                        break
                    # files go inside the transaction: no overshoot on disk; one this process
                    # cannot delete (another user's folder) stays, indexed and counted
                    if self._unlink(old) is None:
                        continue
                    db.execute("DELETE FROM entries WHERE key = ?", (old,))
                    evicted.append(old)
                    total -= nbytes
                if total + size > cap:
                    return None  # no room that this process can make: the write is skipped
            db.execute("INSERT INTO entries (key, bytes, used, learned, tokens) VALUES (?, ?, ?, ?, ?)",
                       (key, size, time.time(), int(learned), tokens))
            return evicted

        evicted = self.index.transaction(reserve)
        if evicted is None:
            return False
        self.evictions += len(evicted)  # type: ignore[arg-type]
        return True

    def _publish(self, key: str, tmp: str, path: Path) -> bool:
        """Move the written file into place if its reservation still stands.  Another
        process may have evicted it while we wrote; its eviction (index row and file) and
        this move are each one write transaction, so they cannot interleave and no file
        outside the index, hence over the capacity, is left behind."""
        def publish(db: sqlite3.Connection) -> bool:
            kept = db.execute("SELECT 1 FROM entries WHERE key = ?", (key,)).fetchone() is not None
            if kept:
                os.replace(tmp, path)  # readers see no entry, the old one or the whole new one
            return kept

        return bool(self.index.transaction(publish))

    def _unlink(self, key: str) -> bool | None:
        """Remove ``key``'s file: True if removed, False if there was none (or it sits behind
        a symlinked folder, never followed), None if it cannot be removed (a folder of
        another user's): the caller then keeps its index row, and nothing is raised."""
        path = self.path(key)
        if path.parent.is_symlink():
            return False
        try:
            path.unlink()  # a symlinked entry: the link goes, never its target
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            self.last_error = f"cannot delete {path.name}: {e}"
            log.warning("disk tier: %s", self.last_error)
            return None

    def delete(self, key: str) -> bool:
        """Remove the entry's file and its row in one write transaction (a writer's
        ``_publish`` is one too, so no file is left outside the index); an entry this process
        cannot delete keeps its row.  False when nothing was removed."""
        if self.index.read_only:
            return False

        def drop(db: sqlite3.Connection) -> bool:
            removed = self._unlink(key)
            if removed is not None:
                db.execute("DELETE FROM entries WHERE key = ?", (key,))
            return bool(removed)

        try:
            return bool(self.index.transaction(drop))
        except IndexUnwritable:
            return False

    def clear(self) -> None:
        """Delete every entry file of this store (and nothing else) and its index rows, in
        one write transaction: a write landing meanwhile would keep a file without a row."""
        if self.index.read_only:
            raise PermissionError(f"disk store {self.root} is read-only: {self.index.problem}")

        def wipe(db: sqlite3.Connection) -> None:
            for _, path in self.files()[0]:
                path.unlink(missing_ok=True)
            db.execute("DELETE FROM entries")

        self.index.transaction(wipe)

    # -- maintenance ---------------------------------------------------------------
    def reclaim(self, min_age_s: float = 2.0) -> int:
        """Delete temp files no live writer holds (left by a killed one); the bytes they
        took count in ``reclaimed_bytes``.  Returns how many went."""
        removed, nbytes = reclaim_temp(self.root, min_age_s)
        self.reclaimed_bytes += nbytes
        return removed

    def verify(self, progress=None) -> dict[str, int]:
        """Read every entry fully and drop the ones that fail; drop index rows whose file
        is gone; report stray files (left alone)."""
        counts = verify_entries(self, progress)
        return counts | self.gc()

    def gc(self, older_than_s: float = 2.0) -> dict[str, int]:
        """Reclaim temp files of killed writers and drop index rows without a file (but
        not those of writes in flight); stray files are counted, never deleted."""
        if self.index.read_only:
            raise PermissionError(f"disk store {self.root} is read-only: {self.index.problem}")
        removed = self.reclaim(older_than_s)
        stale = self._drop_stale(0.0)
        return {"temp_files_removed": removed, "stale_index_rows": stale, "stray_files": len(self.files()[1])}

    def _gone(self, key: str) -> bool:
        """No entry file for ``key``; False where it cannot tell (no access: another user's
        entry stays indexed)."""
        try:
            return self._real_file(key) is None
        except OSError:
            return False

    def _drop_stale(self, min_age_s: float) -> int:
        """Drop index rows whose file is gone: a killed writer's reservation, a file
        deleted by hand.  Rows younger than ``min_age_s`` or with a temp file may be a
        write in flight in another process and stay."""
        busy, now = in_flight(self.root), time.time()
        rows = self.index.sql("SELECT key, used FROM entries")
        stale = [k for k, used in rows if now - used >= min_age_s and k not in busy and self._gone(k)]

        def drop_if_gone(db: sqlite3.Connection, key: str) -> bool:
            # checked again inside the write transaction: a writer that published the file
            # since (``_publish`` is a write transaction too) keeps its row
            if not self._gone(key):
                return False
            db.execute("DELETE FROM entries WHERE key = ?", (key,))
            return True

        return sum(bool(self.index.transaction(functools.partial(drop_if_gone, key=k))) for k in stale)

    def stats(self) -> dict:
        learned, tokens, counted = self.index.sql(
            "SELECT COALESCE(SUM(learned), 0), COALESCE(SUM(tokens), 0), COALESCE(SUM(bytes), 0) FROM entries "
            "WHERE tokens > 0")[0]
        return {"tier": "disk", "path": str(self.root), "namespace": self.namespace, "signed": self.signer is not None,
                "entries": len(self), "learned_entries": int(learned), "bytes": self.nbytes,
                "bytes_per_token": round(counted / tokens) if tokens else None,
                "capacity_bytes": self.capacity_bytes, "corrupt": self.corrupt, "unsigned": self.unsigned,
                "evictions": self.evictions, "write_errors": self.write_errors,
                "skipped_writes": self.skipped_writes, "reclaimed_bytes": self.reclaimed_bytes,
                "read_only": self.index.read_only, "index_rebuilds": self.index.rebuilds,
                "last_error": self.last_error or self.index.problem}
