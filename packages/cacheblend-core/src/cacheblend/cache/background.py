"""Work on stored chunks done off the request's critical path, one job per key at a time.

Two kinds of work leave a request without delaying its first token: precomputing a
passage first seen inside a prompt (*learning*: the prompt computed it in place, the next
one reuses it), and adding a deviation hint to an entry stored before hints existed (the
*hint backfill*: the prompt ran the full check, the next one checks the pool).  Both run on
one background thread, so they never take both cores from the requests.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future

log = logging.getLogger("cacheblend")

__all__ = ["KeyedJobs"]


class KeyedJobs:
    """Background jobs keyed by chunk, at most one pending per key.

    With ``once``, a key whose job returned False (the entry could not be improved: a
    read-only store, a chunk too long for the hint's filler) is not tried again in this
    process, so a store that cannot take the result does not cost every lookup a job."""

    def __init__(self, executor: Executor, name: str, once: bool = False) -> None:
        self._executor, self.name, self.once = executor, name, once
        self._pending: dict[str, Future] = {}
        self._failed: set[str] = set()
        self._lock = threading.Lock()

    def submit(self, key: str, job: Callable[[], object]) -> None:
        """Run ``job`` on the background thread unless ``key`` has one pending (or failed)."""
        with self._lock:
            if key in self._pending or key in self._failed:
                return
            self._pending[key] = self._executor.submit(self._run, key, job)

    def _run(self, key: str, job: Callable[[], object]) -> object:
        ok: object = None
        try:
            ok = job()
        except Exception:  # noqa: BLE001 - background work must never surface in a request
            log.warning("cacheblend: %s of chunk %s… failed; it is tried again on next use", self.name, key[:12],
                        exc_info=True)
        finally:
            with self._lock:
                self._pending.pop(key, None)
                if self.once and ok is False:
                    self._failed.add(key)
        return ok

    def wait(self, key: str | None = None) -> None:
        """Wait until ``key``'s job (or every pending one) has finished; its errors were logged."""
        with self._lock:
            pending = [self._pending.get(key)] if key is not None else list(self._pending.values())
        for future in pending:
            if future is not None:
                future.exception()
