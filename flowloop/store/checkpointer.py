"""SQLite WAL checkpoints on a thread of their own, off the path of the commits.

In WAL mode SQLite copies its log back into the database file (a checkpoint) from inside
the commit that finds the log past ``wal_autocheckpoint`` pages (1,000 by default). With
``synchronous=NORMAL`` a checkpoint is when the files are synced, so that one commit also
waits for the disk: ~38 µs a step of a run's wall time on our 2-core test VM, a fifth of
it (bench/README.md, twelfth pass). SQLite's own page on WAL names the remedy: turn the
automatic checkpoint off and checkpoint from a separate thread.

A writing :class:`~flowloop.store.sql.SQLStore` on a SQLite file runs one
:class:`Checkpointer`: a daemon thread with its own connection, checkpointing (PASSIVE:
it never waits for, nor blocks, a reader or a writer) every :data:`EVERY_S` while the log
grows and less often while it does not. The store's own connections keep an automatic
checkpoint only as a fallback far past the usual size (:data:`FALLBACK_PAGES`), for when
this thread falls behind, cannot open the file, or is gone (a forked child). What a commit
promises does not change: a committed transaction is in the log, whoever copies it later.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path
from typing import Final

log = logging.getLogger("flowloop.store")

EVERY_S: Final = 0.25
"""Between checkpoints while the log grows: ~4,000 pages at a worker's full speed on SQLite
(~16,000 pages/s here), well inside :data:`FALLBACK_PAGES`."""

IDLE_EVERY_S: Final = 2.0
"""At most this long between checkpoints while nothing is written (the wait doubles from
:data:`EVERY_S` after each checkpoint that found nothing new)."""

FALLBACK_PAGES: Final = 10_000
"""The store's connections' own ``wal_autocheckpoint``: a commit checkpoints only past this
many pages in the log (40 MB of 4 KB pages), when the thread has not kept up."""

CLOSE_TIMEOUT_S: Final = 10.0
"""How long closing the store waits for a checkpoint under way (copying a log of
:data:`FALLBACK_PAGES` pages and syncing takes well under a second on a working disk)."""


class Checkpointer:
    """Checkpoints the WAL of the SQLite file at ``path`` from a daemon thread, until
    :meth:`close`."""

    def __init__(
        self,
        path: Path,
        synchronous: str,
        *,
        every: float = EVERY_S,
        idle_every: float = IDLE_EVERY_S,
    ) -> None:
        self.path = path.absolute()  # the file it is now, whatever the directory later
        self.synchronous = synchronous
        self.every = every
        self.idle_every = idle_every
        self.passes = 0
        """Checkpoints tried (for tests and the curious)."""
        self.last: tuple[int, int, int] | None = None
        """The last checkpoint's answer: (busy, pages in the log, pages copied), as
        ``PRAGMA wal_checkpoint`` gives it."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flowloop-checkpointer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop checkpointing; wait for a checkpoint under way (at most ``timeout``)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            # mode=rw: a file deleted under a running store is not created again here.
            conn = sqlite3.connect(
                f"{self.path.as_uri()}?mode=rw",
                uri=True,
                isolation_level=None,
                check_same_thread=False,
            )
        except sqlite3.Error as error:
            log.warning(
                "WAL checkpoints of %s fall back to commits: cannot open it (%s)",
                self.path,
                error,
            )
            return
        try:
            # The checkpoint syncs the files as the store's commits would (NORMAL: the log
            # before copying it, the database after).
            conn.execute(f"PRAGMA synchronous={self.synchronous}")
            wait = self.every
            while not self._stop.wait(wait):
                wait = self.every if self._checkpoint(conn) else min(wait * 2, self.idle_every)
        finally:
            conn.close()

    def _checkpoint(self, conn: sqlite3.Connection) -> bool:
        """One PASSIVE checkpoint; whether the log changed since the previous one."""
        self.passes += 1
        try:
            row = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error as error:  # locked by a TRUNCATE of prune's, a full disk, ...
            log.debug("WAL checkpoint of %s: %s", self.path, error)
            return True  # try again soon: the log may be growing meanwhile
        answer = (int(row[0]), int(row[1]), int(row[2]))
        changed = answer != self.last
        self.last = answer
        return changed
