"""SQLite WAL checkpoints on a thread of their own, off the path of the commits.

In WAL mode SQLite copies its log back into the database file (a checkpoint) from inside
the commit that finds the log past ``wal_autocheckpoint`` pages (1,000 by default). With
``synchronous=NORMAL`` a checkpoint is when the files are synced, so that one commit also
waits for the disk: ~30-40 µs a step of a run's wall time on our 2-core test VM, some
15-20 % of it (bench/README.md, twelfth pass). SQLite's own page on WAL names the remedy:
checkpoint from a separate thread.

A :class:`~flowloop.store.sql.SQLStore` on a SQLite file starts one :class:`Checkpointer`
when it first writes: a daemon thread with its own connection, checkpointing (PASSIVE: it
never waits for, nor blocks, a reader or a writer) every :data:`EVERY_S` while the log
grows and less often while it does not. Once that connection is open, the store's write
connection raises its automatic checkpoint to :data:`FALLBACK_PAGES`.

That threshold is still reached while commits go on without a pause: only a writer starts
the log over, and only when a checkpoint has copied all of it, which a pass racing the
commits never does. The commit that crosses it checkpoints (copying only what the thread
has not yet copied) and the log starts over: one commit in ~10,000 pages waits for the
disk instead of one in ~1,000, and the ``-wal`` file grows to ~40 MB instead of ~4 MB.
While the writes pause, the thread copies everything and the next commit starts the log
over. What a commit promises does not change: a committed transaction is in the log,
whoever copies it into the database file later.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path
from typing import Final

log = logging.getLogger("flowloop.store")

EVERY_S: Final = 0.25
"""Between checkpoints while the log grows: ~5,000 pages at one process's full speed on
SQLite (~20,000 pages/s of sequential runs on our test VM)."""

IDLE_EVERY_S: Final = 0.5
"""At most this long between checkpoints while nothing is written (the wait doubles from
:data:`EVERY_S` after a checkpoint that found the log as the previous one left it). A
checkpoint of an unchanged log costs microseconds."""

FALLBACK_PAGES: Final = 10_000
"""The store's write connection's ``wal_autocheckpoint`` while the thread runs: a commit
checkpoints past this many pages in the log (40 MB of 4 KB pages), when the thread has not
copied it all — under steady writing, every ~10,000 pages (see above)."""

THREAD_NAME: Final = "flowloop-checkpointer"
"""Its thread's name, followed by the database's path."""

CLOSE_TIMEOUT_S: Final = 10.0
"""How long closing the store waits for a checkpoint under way (copying a log of
:data:`FALLBACK_PAGES` pages and syncing takes well under a second on a working disk)."""


class Checkpointer:
    """Checkpoints the WAL of one SQLite file from a daemon thread, until :meth:`close`.
    Made by :meth:`open`, which opens its connection first."""

    def __init__(
        self,
        path: Path,
        conn: sqlite3.Connection,
        *,
        every: float = EVERY_S,
        idle_every: float = IDLE_EVERY_S,
    ) -> None:
        self.path = path
        self.every = every
        self.idle_every = idle_every
        self.passes = 0
        """Checkpoints begun (for tests and the curious)."""
        self.last: tuple[int, int, int] | None = None
        """The last checkpoint's answer: (busy, pages in the log, pages copied), as
        ``PRAGMA wal_checkpoint`` gives it."""
        self._conn = conn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{THREAD_NAME} {path}", daemon=True)

    @classmethod
    def open(cls, path: Path, synchronous: str) -> Checkpointer | None:
        """A checkpointer of the database at ``path`` (absolute, as SQLite names it), its
        connection open; ``None`` when it cannot be opened (a debug line says why)."""
        conn: sqlite3.Connection | None = None
        try:
            # mode=rw: a file deleted under a running store is not created again here.
            conn = sqlite3.connect(
                f"{path.as_uri()}?mode=rw",
                uri=True,
                isolation_level=None,
                check_same_thread=False,  # opened here, used by the thread alone
            )
            # A checkpoint syncs the files as the store's commits would (NORMAL: the log
            # before copying it, the database after).
            conn.execute(f"PRAGMA synchronous={synchronous}")
        except sqlite3.Error as error:
            if conn is not None:
                conn.close()
            # Only a matter of speed (the commits checkpoint as SQLite does by default), and
            # the store's own use of the file says what is wrong with it, if anything.
            log.debug("WAL checkpoints of %s stay in its commits: cannot open it (%s)", path, error)
            return None
        return cls(path, conn)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end, without waiting for it (a store being collected)."""
        self._stop.set()

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop checkpointing; wait for a checkpoint under way (at most ``timeout``)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        elif self._thread.ident is None:  # never started: the connection is ours to close
            self._conn.close()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            wait = self.every
            while not self._stop.wait(wait):
                wait = self.every if self._checkpoint() else min(wait * 2, self.idle_every)
        finally:
            self._conn.close()

    def _checkpoint(self) -> bool:
        """One PASSIVE checkpoint; whether to take the next one soon: the log changed since
        the previous one, or another connection's checkpoint kept this one out."""
        self.passes += 1
        try:
            row = self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error as error:  # a full disk, a file made read-only, ...
            log.debug("WAL checkpoint of %s: %s", self.path, error)
            return False  # spaced out as when idle: the commits' fallback still holds
        answer = (int(row[0]), int(row[1]), int(row[2]))
        previous, self.last = self.last, answer
        return soon(previous, answer)


def soon(previous: tuple[int, int, int] | None, answer: tuple[int, int, int]) -> bool:
    """Whether to checkpoint again soon after ``answer``: the log changed since the
    ``previous`` checkpoint, or this one was kept out (busy: another connection's
    checkpoint, another process's or prune's TRUNCATE, held the lock)."""
    return answer != previous or answer[0] == 1
