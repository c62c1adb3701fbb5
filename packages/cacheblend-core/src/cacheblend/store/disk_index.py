"""The disk tier's index: size, last use, origin and length of every entry, in SQLite.

The index is derived data: every entry file's own header says what the index records.
So it heals instead of failing a request: an index that is damaged (``database disk image
is malformed``, ``file is not a database``) is moved aside to ``index.sqlite3.damaged``
and rebuilt from the headers; one that cannot be written (a read-only file or
directory, a full disk, an I/O error) turns the tier read-only, with one warning naming
the path, and tries writes again every minute; one that cannot be opened at all is
rebuilt in memory (and the file opened again once it can be).  SQLite's locking lets
several processes share it, and eviction and publication are single write transactions.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger("cacheblend.store")
INDEX = "index.sqlite3"
Row = tuple[str, int, float, int, int]  # key, bytes, used, learned, tokens
# A read-only index tries writes again this often: a disk was freed, a permission fixed, a
# mount remounted read-write; a long-running server would else write nothing until restarted.
RETRY_WRITES_S = 60.0
_SCHEMA = ("CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, bytes INTEGER, used REAL, "
           "learned INTEGER NOT NULL DEFAULT 0, tokens INTEGER NOT NULL DEFAULT 0)")


class IndexUnwritable(Exception):
    """The index cannot take writes (read-only, or the disk is full)."""


def _read_only_error(e: sqlite3.Error) -> bool:
    text = str(e).lower()
    return any(s in text for s in ("readonly", "read-only", "unable to open", "attempt to write"))


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


class DiskIndex:
    """``scan()`` lists the rows the entry files describe (used to rebuild)."""

    def __init__(self, root: Path, scan: Callable[[], Iterable[Row]], writable: bool = True) -> None:
        self.path = root / INDEX
        self._scan = scan
        self._lock = threading.RLock()
        self.read_only = False
        self.rebuilds = 0
        self.problem: str | None = None  # why the index was rebuilt or went read-only
        self._memory = False  # the index is the in-memory one: the file could not be opened for writing
        self._read_only_at = 0.0  # when it went (or last stayed) read-only
        self._inode: int | None = None  # of the file we have open: another process may replace it
        self._db = self._open() if writable else self._in_memory(f"{root} cannot be written; serving read-only")

    # -- opening and healing -----------------------------------------------------------
    def _open(self) -> sqlite3.Connection:
        try:
            db = self._connect()
        except sqlite3.OperationalError as e:  # read-only, full, an I/O error, locked for a minute
            return self._in_memory(f"cannot open {self.path} for writing ({e}); serving read-only")
        except sqlite3.DatabaseError as e:
            return self._heal_at_open(e)
        try:
            if db.execute("SELECT COUNT(*) FROM entries").fetchone()[0] == 0:
                self._fill(db, self._scan())
        except sqlite3.OperationalError as e:
            db.close()
            return self._in_memory(f"cannot write {self.path} ({e}); serving read-only")
        return db

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=60, check_same_thread=False, isolation_level=None)
        self._inode = _inode(self.path)
        try:
            _use_wal(db)
            check = db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {check}")
            db.execute(_SCHEMA)
            _add_columns(db)
        except BaseException:
            db.close()
            raise
        return db

    def _heal_at_open(self, error: sqlite3.Error) -> sqlite3.Connection:
        try:
            self._move_aside()
            db = self._connect()
        except (OSError, sqlite3.Error) as e:
            return self._in_memory(f"index {self.path} is damaged ({error}) and cannot be replaced ({e})")
        try:
            self._rebuilt(db, error)
        except sqlite3.Error as e:  # the new file opened, but the disk fails as it fills (full, I/O)
            db.close()
            return self._in_memory(f"index {self.path} is damaged ({error}) and cannot be rebuilt ({e}); "
                                   "serving read-only")
        return db

    def _move_aside(self) -> None:
        for suffix in ("", "-wal", "-shm"):
            p = Path(f"{self.path}{suffix}")
            if p.exists():
                p.replace(f"{self.path}.damaged{suffix}")

    def _rebuilt(self, db: sqlite3.Connection, error: sqlite3.Error) -> None:
        n = self._fill(db, self._scan())
        self.rebuilds += 1
        self.problem = f"rebuilt from {n} entry headers after: {error}"
        log.warning("disk index %s was damaged (%s); moved aside to %s.damaged and rebuilt from %d entries",
                    self.path, error, self.path.name, n)

    def _in_memory(self, why: str) -> sqlite3.Connection:
        """An index in memory, from the headers: the tier serves what it has, writes nothing."""
        self.read_only, self.problem = True, why
        self._memory, self._read_only_at = True, time.monotonic()
        log.warning("disk tier: %s", why)
        db = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
        db.execute(_SCHEMA)
        self._fill(db, self._scan())
        return db

    @staticmethod
    def _fill(db: sqlite3.Connection, rows: Iterable[Row]) -> int:
        """Add the rows read from the entry files' headers.  Rows already there stay as they
        are: the headers were read before this transaction, and another process may have
        written (or evicted and rewritten) an entry since; wiping the table first lost those
        rows and left their files outside the index, uncounted and never evicted.  Rows
        whose file is gone are dropped by ``gc``."""
        rows = list(rows)
        db.execute("BEGIN IMMEDIATE")
        db.executemany("INSERT OR IGNORE INTO entries (key, bytes, used, learned, tokens) VALUES (?, ?, ?, ?, ?)",
                       rows)
        db.execute("COMMIT")
        return len(rows)

    def _heal(self, error: sqlite3.Error) -> None:
        """Damage found after opening: replace the index, once per damage."""
        with self._lock:
            self._db.close()
            self._db = self._heal_at_open(error)

    def _follow(self) -> None:
        """Another process healed the index (moved the damaged file aside and made a new
        one): open the new one instead of healing again, which would move its good index
        aside.  One ``stat`` per query."""
        if self._inode is not None and _inode(self.path) not in (self._inode, None):
            self._db.close()
            self._db = self._open()

    def _go_read_only(self, error: sqlite3.Error) -> None:
        if not self.read_only:
            self.read_only, self.problem = True, f"index {self.path} cannot be written ({error})"
            self._read_only_at = time.monotonic()
            log.warning("disk tier: index %s cannot be written (%s); serving read-only", self.path, error)

    def writable(self) -> bool:
        """Whether a write may be tried.  Read-only, the index tries again every
        :data:`RETRY_WRITES_S` (if the next write fails, read-only for another interval)."""
        if self.read_only and time.monotonic() - self._read_only_at >= RETRY_WRITES_S:
            with self._lock:
                if self.read_only and time.monotonic() - self._read_only_at >= RETRY_WRITES_S:
                    self._try_writes_again()
        return not self.read_only

    def _try_writes_again(self) -> None:
        """Open the index file again (a connection SQLite opened read-only stays so) and let
        the next write find out; if it cannot be opened, the index serves on as it was."""
        self._read_only_at = time.monotonic()
        try:
            db = self._connect()
        except sqlite3.Error:
            return
        try:
            if db.execute("SELECT COUNT(*) FROM entries").fetchone()[0] == 0:
                self._fill(db, self._scan())
        except sqlite3.Error:
            db.close()
            return
        self._db.close()
        self._db, self._memory = db, False
        self.read_only, self.problem = False, None
        log.warning("disk tier: index %s is tried for writes again", self.path)

    # -- queries ---------------------------------------------------------------------
    def run(self, fn: Callable[[sqlite3.Connection], object], write: bool = False):
        """``fn(db)`` under the lock; damage heals the index and retries once.  A write
        the index cannot take (read-only, full, an I/O error, locked past the timeout, still
        damaged) raises :class:`IndexUnwritable`: the caller skips it, the request goes on."""
        if write and self.read_only:
            raise IndexUnwritable(self.problem or "read-only")
        for attempt in (0, 1):
            with self._lock:
                try:
                    self._follow()  # opening another process's new index can fail too (full, I/O)
                    return fn(self._db)
                except sqlite3.OperationalError as e:
                    with contextlib.suppress(sqlite3.Error):
                        if self._db.in_transaction:
                            self._db.execute("ROLLBACK")
                    if _read_only_error(e):
                        self._go_read_only(e)
                        raise IndexUnwritable(str(e)) from e
                    if write or "full" in str(e) or "disk I/O" in str(e):  # full, I/O, locked: skip it
                        raise IndexUnwritable(str(e)) from e
                    raise
                except sqlite3.DatabaseError as e:
                    if attempt:
                        if write:  # still damaged after healing: this write is skipped
                            raise IndexUnwritable(str(e)) from e
                        raise
                    self._heal(e)
        raise AssertionError("unreachable")

    def sql(self, query: str, args: tuple = ()) -> list[tuple]:
        return self.run(lambda db: db.execute(query, args).fetchall())  # type: ignore[return-value]

    def write(self, query: str, args: tuple = ()) -> bool:
        """A write that may be skipped (read-only, full): True if it was made."""
        try:
            self.run(lambda db: db.execute(query, args), write=True)
            return True
        except IndexUnwritable:
            return False

    def transaction(self, fn: Callable[[sqlite3.Connection], object]):
        """``fn(db)`` inside one ``BEGIN IMMEDIATE`` write transaction."""
        def body(db: sqlite3.Connection):
            db.execute("BEGIN IMMEDIATE")
            try:
                out = fn(db)
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            return out

        return self.run(body, write=True)

    def rebuild(self) -> int:
        """Rows from the entry files' headers (after a crash, a copy or a loss)."""
        return int(self.run(lambda db: self._fill(db, self._scan()), write=not self.read_only))  # type: ignore[arg-type]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def _add_columns(db: sqlite3.Connection) -> None:
    """Indexes made before entries were marked learned or counted in tokens get the
    columns (another process may add them at the same moment)."""
    for column in ("learned", "tokens"):
        have = {row[1] for row in db.execute("PRAGMA table_info(entries)").fetchall()}
        if column not in have:
            try:
                db.execute(f"ALTER TABLE entries ADD COLUMN {column} INTEGER NOT NULL DEFAULT 0")
            except sqlite3.OperationalError as e:
                if "duplicate column" not in str(e):
                    raise
