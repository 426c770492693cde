"""The work queue and measurement log beside the profile database (``profile-queue.sqlite``).

Two tables in one SQLite file (WAL, busy timeout, every change one ``BEGIN IMMEDIATE``
transaction, so any number of processes share it):

- ``log``: one row per measurement a profiler made (not per cache hit): its key, the run and rank
  that made it, and whether the profile database stored it (``inserted``) or already had the key
  (a duplicate: the same configuration measured twice). ``kareus plan`` reports the duplicates.
- ``items``: the work queue of the distributed profilers (:mod:`kareus_fx.runtime.group_profiler`).
  The coordinator adds (partition type or sequence, configuration) items of its run; a group's
  leader claims the oldest pending one (an ``UPDATE ... WHERE status='pending'`` inside the write
  transaction, so exactly one group gets it), measures it with its group, stores the measurement
  in the profile database and marks the item ``done``; a group that lost a peer marks its item
  ``failed`` with the reason. Each item key is unique in a run, so nothing is queued twice.

A run is named by ``run_id`` (the coordinator draws it); a new run first drops every item of
earlier runs (their measurements are in the profile database already, and a claim of a killed run
must not block the new one). ``heartbeat`` rows let workers notice a coordinator that is gone.

Assumption: every process of a run sees the same file (one node, or a shared file system with
working POSIX locks; SQLite over NFS is not safe).
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kareus_fx.cost_models.profile_db import write_retrying
from kareus_fx.errors import KareusError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS log (
    key TEXT NOT NULL, run TEXT NOT NULL, rank INTEGER NOT NULL, inserted INTEGER NOT NULL,
    created_unix_s REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS items (
    run TEXT NOT NULL, key TEXT NOT NULL, payload TEXT NOT NULL, status TEXT NOT NULL,
    group_index INTEGER, reason TEXT, seq INTEGER NOT NULL, claimed_unix_s REAL,
    PRIMARY KEY (run, key)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS heartbeat (
    run TEXT PRIMARY KEY, rank INTEGER NOT NULL, beat_unix_s REAL NOT NULL, closed INTEGER NOT NULL
) WITHOUT ROWID;
"""
_MAX_TRIES = 50


class ProfileQueueError(KareusError, RuntimeError):
    """The queue file cannot be used (locked too long, not a queue file)."""


@dataclass(frozen=True)
class WorkItem:
    """One queued measurement: its key (unique in the run) and what to measure (JSON payload)."""

    key: str
    payload: dict[str, Any]
    status: str = "pending"
    group_index: int | None = None
    reason: str | None = None
    seq: int = 0


class ProfileQueue:
    """The ``log`` and ``items`` tables of one file (module docstring)."""

    def __init__(self, path: str | Path, timeout_s: float = 60.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(str(self.path), timeout=timeout_s, isolation_level=None)
        try:
            self._conn.execute(f"PRAGMA busy_timeout = {int(timeout_s * 1000)}")
            self._conn.execute("PRAGMA journal_mode = WAL")
            self._conn.execute("PRAGMA synchronous = NORMAL")
            self._write(lambda cur: [cur.execute(s) for s in _SCHEMA.split(";") if s.strip()])
        except sqlite3.DatabaseError as err:
            self._conn.close()
            raise ProfileQueueError(f"{self.path} is not a usable profile queue ({err}); move it away") from None

    def _write(self, work) -> Any:
        """``work(cursor)`` in one IMMEDIATE transaction, retried while another writer holds the lock."""
        return write_retrying(
            self._conn,
            work,
            tries=_MAX_TRIES,
            first_delay_s=0.005,
            max_delay_s=0.5,
            still_locked=ProfileQueueError(f"{self.path}: still locked by another writer after {_MAX_TRIES} tries"),
        )

    # ----- the measurement log ---------------------------------------------------------------
    def log(self, key: str, run: str, rank: int, inserted: bool) -> None:
        """Record one measurement made (``inserted``: the profile database did not have the key)."""
        self._write(
            lambda cur: cur.execute(
                "INSERT INTO log VALUES (?, ?, ?, ?, ?)", (key, run, int(rank), int(inserted), time.time())
            )
        )

    def logged(self, run: str | None = None) -> list[tuple[str, str, int, bool]]:
        """Logged measurements, optionally of one run: (key, run, rank, inserted)."""
        sql = "SELECT key, run, rank, inserted FROM log"
        args: tuple[str, ...] = ()
        if run is not None:
            sql, args = sql + " WHERE run=?", (run,)
        return [(k, r, int(rank), bool(i)) for k, r, rank, i in self._conn.execute(sql + " ORDER BY rowid", args)]

    def duplicates(self) -> int:
        """Measurements made of a key the profile database already held (every run in the file)."""
        return int(self._conn.execute("SELECT COUNT(*) FROM log WHERE inserted=0").fetchone()[0])

    # ----- the work queue --------------------------------------------------------------------
    def start_run(self, run: str, rank: int) -> None:
        """Begin run ``run``: drop every other run's items and heartbeat, beat once."""

        def work(cur: sqlite3.Cursor) -> None:
            cur.execute("DELETE FROM items WHERE run<>?", (run,))
            cur.execute("DELETE FROM heartbeat WHERE run<>?", (run,))
            cur.execute("INSERT OR REPLACE INTO heartbeat VALUES (?, ?, ?, 0)", (run, int(rank), time.time()))

        self._write(work)

    def beat(self, run: str, rank: int, closed: bool = False) -> None:
        """The coordinator is alive (``closed``: it needs nothing more; workers may stop)."""
        self._write(
            lambda cur: cur.execute(
                "INSERT OR REPLACE INTO heartbeat VALUES (?, ?, ?, ?)", (run, int(rank), time.time(), int(closed))
            )
        )

    def heartbeat(self, run: str) -> tuple[float, bool] | None:
        """(seconds since the coordinator's last beat, closed), or None before its first."""
        row = self._conn.execute("SELECT beat_unix_s, closed FROM heartbeat WHERE run=?", (run,)).fetchone()
        return None if row is None else (time.time() - float(row[0]), bool(row[1]))

    def add(self, run: str, items: dict[str, dict[str, Any]]) -> int:
        """Queue ``items`` (key -> payload) of ``run``; keys already queued are left as they are.
        Returns how many were new."""

        def work(cur: sqlite3.Cursor) -> int:
            seq = int(cur.execute("SELECT COALESCE(MAX(seq), 0) FROM items WHERE run=?", (run,)).fetchone()[0])
            new = 0
            for key, payload in items.items():
                cur.execute(
                    "INSERT OR IGNORE INTO items (run, key, payload, status, seq) VALUES (?, ?, ?, 'pending', ?)",
                    (run, key, json.dumps(payload, sort_keys=True), seq + new + 1),
                )
                new += cur.rowcount
            return new

        return self._write(work)

    def claim(self, run: str, group_index: int) -> WorkItem | None:
        """The oldest pending item of ``run``, now claimed by ``group_index``; None if none is pending."""
        if (
            self._conn.execute("SELECT 1 FROM items WHERE run=? AND status='pending' LIMIT 1", (run,)).fetchone()
            is None
        ):
            return None  # nothing to claim: no write transaction (idle workers poll often)

        def work(cur: sqlite3.Cursor) -> WorkItem | None:
            row = cur.execute(
                "SELECT key, payload, seq FROM items WHERE run=? AND status='pending' ORDER BY seq LIMIT 1", (run,)
            ).fetchone()
            if row is None:
                return None
            cur.execute(
                "UPDATE items SET status='claimed', group_index=?, claimed_unix_s=? "
                "WHERE run=? AND key=? AND status='pending'",
                (group_index, time.time(), run, row[0]),
            )
            if cur.rowcount != 1:  # cannot happen inside one IMMEDIATE transaction; kept as a guard
                raise ProfileQueueError(f"item {row[0]} was claimed twice")
            return WorkItem(row[0], json.loads(row[1]), "claimed", group_index, None, int(row[2]))

        return self._write(work)

    def finish(self, run: str, key: str, status: str = "done", reason: str | None = None) -> None:
        """Mark a claimed item ``done`` or ``failed`` (with ``reason``)."""
        if status not in ("done", "failed"):
            raise ValueError(f"status must be done or failed, got {status!r}")
        self._write(
            lambda cur: cur.execute(
                "UPDATE items SET status=?, reason=? WHERE run=? AND key=?", (status, reason, run, key)
            )
        )

    def items(self, run: str, keys: list[str] | None = None) -> dict[str, WorkItem]:
        """The run's items (optionally only ``keys``) by key."""
        rows = self._conn.execute(
            "SELECT key, payload, status, group_index, reason, seq FROM items WHERE run=?", (run,)
        ).fetchall()
        wanted = None if keys is None else set(keys)
        return {
            r[0]: WorkItem(r[0], json.loads(r[1]), r[2], r[3], r[4], int(r[5]))
            for r in rows
            if wanted is None or r[0] in wanted
        }

    def claimed_by(self, run: str, group_index: int) -> list[WorkItem]:
        """The run's items ``group_index`` has claimed and not finished, oldest first."""
        rows = self._conn.execute(
            "SELECT key, payload, status, group_index, reason, seq FROM items WHERE run=? "
            "AND status='claimed' AND group_index=? ORDER BY seq",
            (run, group_index),
        ).fetchall()
        return [WorkItem(r[0], json.loads(r[1]), r[2], r[3], r[4], int(r[5])) for r in rows]

    def claimed_since_s(self, run: str, key: str) -> float | None:
        """Seconds since ``key`` was claimed, or None if it is not claimed now."""
        row = self._conn.execute(
            "SELECT claimed_unix_s FROM items WHERE run=? AND key=? AND status='claimed'", (run, key)
        ).fetchone()
        return None if row is None or row[0] is None else time.time() - float(row[0])

    def failed(self, run: str) -> list[WorkItem]:
        """The run's items a group could not measure because it lost a peer."""
        return [item for item in self.items(run).values() if item.status == "failed"]

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> ProfileQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
