"""Disk tier: one safetensors file per chunk, written atomically, verified on read.

Layout: ``ROOT/<key[:2]>/<key>.safetensors`` holding ``k.<layer>`` and ``v.<layer>``
tensors (``[kv_heads, tokens, head_dim]``), so one layer can be read without the rest
(pipelined loading).  The header metadata carries the format version, the key, the
shape, who made it (model fingerprint, precompute policy, token-ids hash) and a sha256
per layer.  An entry that is truncated, corrupted or not what its name says is counted,
deleted and reported as a miss, so the engine recomputes it — never serves it.

``ROOT/index.sqlite3`` records size and last access of every entry: it survives
restarts, is shared safely by several processes (SQLite locking), and drives LRU
eviction within the byte budget.  No pickle anywhere: safetensors and SQLite only.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import tempfile
import threading
import time
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save as st_save

from .entry import ChunkKV, CorruptEntry, layer_digest, read_entry, verify_entries

log = logging.getLogger("cacheblend.store")
FORMAT = "cacheblend-kv"
VERSION = "2"
_TMP_PREFIX = ".tmp-"


class DiskSource:
    """One verified entry, read a layer at a time (each layer checked against its digest)."""

    tier = "disk"

    def __init__(self, store: DiskStore, key: str, path: Path) -> None:
        self._store, self.key = store, key
        try:
            self._file = safe_open(str(path), framework="pt")
        except Exception as e:
            # Evicted by another process since it was looked up: a miss, not corruption.
            # safetensors reports a vanished file as a RuntimeError, not FileNotFoundError.
            if isinstance(e, FileNotFoundError) or not path.exists():
                raise FileNotFoundError(str(path)) from e
            raise CorruptEntry(f"{path}: {e}") from e
        try:
            meta = self._file.metadata() or {}
            ok = meta.get("format") == FORMAT and meta.get("version") == VERSION and meta.get("key") == key
            self.num_layers = int(meta["layers"])
            self.num_tokens = int(meta["tokens"])
            self._digests = json.loads(meta["layer_sha256"])
            ok = ok and len(self._digests) == self.num_layers
        except Exception as e:  # unreadable header: truncated, overwritten, foreign
            raise CorruptEntry(f"{path}: {e}") from e
        if not ok:
            raise CorruptEntry(f"{path}: header does not describe key {key}")
        self.meta = {k: v for k, v in meta.items() if k != "layer_sha256"}

    def layer(self, index: int):
        try:
            k = self._file.get_tensor(f"k.{index}")
            v = self._file.get_tensor(f"v.{index}")
        except Exception as e:
            self._store.condemn(self.key)
            raise CorruptEntry(f"{self.key}: layer {index} unreadable: {e}") from e
        if k.shape[1] != self.num_tokens or layer_digest(k, v) != self._digests[index]:
            self._store.condemn(self.key)
            raise CorruptEntry(f"{self.key}: layer {index} fails its checksum")
        return k, v


def _use_wal(db: sqlite3.Connection, seconds: float = 60.0) -> None:
    """Put the index in WAL mode (readers never block the writer).  Switching takes an
    exclusive lock that SQLite does not wait for (no busy handler), so processes opening
    a new store at the same moment get "database is locked": retry until it is done."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class DiskStore:
    """Chunk caches as files under ``root``, at most ``capacity_bytes`` in all (LRU)."""

    def __init__(self, root: str | os.PathLike, capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError("disk capacity must be positive")
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.corrupt = 0
        self.write_errors = 0
        self.evictions = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.root / "index.sqlite3", timeout=60, check_same_thread=False,
                                   isolation_level=None)
        _use_wal(self._db)
        self._db.execute("CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, bytes INTEGER, used REAL, "
                         "learned INTEGER NOT NULL DEFAULT 0, tokens INTEGER NOT NULL DEFAULT 0)")
        self._add_columns()
        if self._sql("SELECT COUNT(*) FROM entries")[0][0] == 0:
            self.reindex()

    # -- index ---------------------------------------------------------------------
    def _add_columns(self) -> None:
        """Indexes made before entries were marked learned or counted in tokens get the
        columns (another process may add them at the same moment)."""
        for column in ("learned", "tokens"):
            have = {row[1] for row in self._sql("PRAGMA table_info(entries)")}
            if column not in have:
                try:
                    self._sql(f"ALTER TABLE entries ADD COLUMN {column} INTEGER NOT NULL DEFAULT 0")
                except sqlite3.OperationalError as e:
                    if "duplicate column" not in str(e):
                        raise

    def _sql(self, query: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(query, args).fetchall()

    def reindex(self) -> int:
        """Rebuild the index from the files present (after a crash or a copy)."""
        rows = [(p.stem, p.stat().st_size, p.stat().st_mtime) for p in self.root.glob("??/*.safetensors")]
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("DELETE FROM entries")
            self._db.executemany("INSERT OR REPLACE INTO entries (key, bytes, used) VALUES (?, ?, ?)", rows)
            self._db.execute("COMMIT")
        return len(rows)

    @property
    def nbytes(self) -> int:
        return int(self._sql("SELECT COALESCE(SUM(bytes), 0) FROM entries")[0][0])

    def path(self, key: str) -> Path:
        if len(key) < 3 or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"not a chunk key: {key!r}")
        return self.root / key[:2] / f"{key}.safetensors"

    def __contains__(self, key: str) -> bool:
        return self.path(key).is_file()

    def __len__(self) -> int:
        return int(self._sql("SELECT COUNT(*) FROM entries")[0][0])

    def keys(self) -> list[str]:
        return [r[0] for r in self._sql("SELECT key FROM entries ORDER BY used")]

    # -- reads ---------------------------------------------------------------------
    def open(self, key: str) -> DiskSource | None:
        """A layer-wise reader for ``key``, or None (absent or untrustworthy)."""
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            source = DiskSource(self, key, path)
        except FileNotFoundError:
            return None
        except CorruptEntry:
            self.condemn(key)
            return None
        self._sql("UPDATE entries SET used = ? WHERE key = ?", (time.time(), key))
        return source

    def get(self, key: str) -> ChunkKV | None:
        return read_entry(self.open(key))

    def condemn(self, key: str) -> None:
        """Count and remove an entry that failed verification."""
        with self._lock:
            self.corrupt += 1
        self.delete(key)

    # -- writes --------------------------------------------------------------------
    def put(self, key: str, kv: ChunkKV) -> bool:
        path = self.path(key)
        tensors = {}
        for i in range(kv.num_layers):
            tensors[f"k.{i}"] = kv.k[i].contiguous()
            tensors[f"v.{i}"] = kv.v[i].contiguous()
        meta = {str(k): str(v) for k, v in kv.meta.items()}
        meta |= {
            "format": FORMAT, "version": VERSION, "key": key, "layers": str(kv.num_layers),
            "tokens": str(kv.num_tokens), "dtype": str(kv.k.dtype),
            "layer_sha256": json.dumps([layer_digest(*kv.layer(i)) for i in range(kv.num_layers)]),
        }
        blob = st_save(tensors, meta)
        if not self._reserve(key, len(blob), kv.meta.get("origin") == "learned", kv.num_tokens):
            return False
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                    f.flush()
                    os.fsync(f.fileno())
                if not self._publish(key, tmp, path):
                    Path(tmp).unlink(missing_ok=True)
                    return False
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as e:  # disk full, read-only, gone: the caller carries on without us
            self._sql("DELETE FROM entries WHERE key = ?", (key,))
            with self._lock:
                self.write_errors += 1
                self.last_error = f"{type(e).__name__}: {e}"
            if self.write_errors == 1:  # say so once; the stats keep counting
                log.warning("disk tier %s cannot be written (%s); carrying on with the other tiers",
                            self.root, self.last_error)
            return False
        return True

    def _reserve(self, key: str, size: int, learned: bool = False, tokens: int = 0) -> bool:
        """Record ``key`` in the index, evicting entries so the total stays within the
        capacity (one transaction, so concurrent writers agree): learned chunks (found in
        prompts) least recently used first, then ingested ones least recently used first."""
        cap = self.capacity_bytes
        if cap is not None and size > cap:
            return False
        evicted: list[str] = []
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("DELETE FROM entries WHERE key = ?", (key,))
                if cap is not None:
                    total = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM entries").fetchone()[0]
                    victims = db.execute("SELECT key, bytes FROM entries ORDER BY learned DESC, used").fetchall()
                    for old, nbytes in victims:
                        if total + size <= cap:
                            break
                        db.execute("DELETE FROM entries WHERE key = ?", (old,))
                        evicted.append(old)
                        total -= nbytes
                db.execute("INSERT INTO entries (key, bytes, used, learned, tokens) VALUES (?, ?, ?, ?, ?)",
                           (key, size, time.time(), int(learned), tokens))
                for old in evicted:  # files go inside the transaction: no overshoot on disk
                    self.path(old).unlink(missing_ok=True)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            self.evictions += len(evicted)
        return True

    def _publish(self, key: str, tmp: str, path: Path) -> bool:
        """Move the written file into place if its reservation still stands.  Another
        process may have evicted it while we wrote; its eviction (index row and file) and
        this move are each one write transaction, so they cannot interleave and no file
        outside the index, hence over the capacity, is left behind."""
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                kept = db.execute("SELECT 1 FROM entries WHERE key = ?", (key,)).fetchone() is not None
                if kept:
                    os.replace(tmp, path)  # readers see no entry, the old one or the whole new one
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return kept

    def delete(self, key: str) -> bool:
        self._sql("DELETE FROM entries WHERE key = ?", (key,))
        try:
            self.path(key).unlink()
            return True
        except FileNotFoundError:
            return False

    def clear(self) -> None:
        for p in self.root.glob("??/*.safetensors"):
            p.unlink(missing_ok=True)
        self._sql("DELETE FROM entries")

    # -- maintenance ---------------------------------------------------------------
    def verify(self, progress=None) -> dict[str, int]:
        """Read every entry fully; drop the ones that fail. Returns counts."""
        return verify_entries(self, progress)

    def gc(self, older_than_s: float = 3600.0) -> dict[str, int]:
        """Remove temp files left by killed writers and index rows whose file is gone."""
        now, tmp_removed = time.time(), 0
        for p in self.root.glob(f"??/{_TMP_PREFIX}*"):
            if now - p.stat().st_mtime > older_than_s:
                p.unlink(missing_ok=True)
                tmp_removed += 1
        stale = [k for k in self.keys() if not self.path(k).is_file()]
        for k in stale:
            self._sql("DELETE FROM entries WHERE key = ?", (k,))
        return {"temp_files_removed": tmp_removed, "stale_index_rows": len(stale)}

    def stats(self) -> dict:
        learned, tokens, counted = self._sql(
            "SELECT COALESCE(SUM(learned), 0), COALESCE(SUM(tokens), 0), COALESCE(SUM(bytes), 0) FROM entries "
            "WHERE tokens > 0")[0]
        return {"tier": "disk", "path": str(self.root), "entries": len(self), "learned_entries": int(learned),
                "bytes": self.nbytes, "bytes_per_token": round(counted / tokens) if tokens else None,
                "capacity_bytes": self.capacity_bytes, "corrupt": self.corrupt, "evictions": self.evictions,
                "write_errors": self.write_errors, "last_error": self.last_error}
