"""The profile database: every measurement, keyed so that a run resumes and nothing is measured twice.

A SQLite file (standard library ``sqlite3``) in WAL mode with a busy timeout, so several
processes (tuner workers, one per partition type or GPU) can read and write it at once. Each
measurement is committed as soon as it is stored: a run killed mid-way leaves every finished
measurement behind, and the next run reuses them.

A configuration that cannot run (the profiler raised
:class:`~kareus_fx.workload.MeasurementFailedError`: out of memory, a collective timed out) is
stored once in the ``failures`` table with its reason, under the same key; :class:`CachedProfiler`
raises it again from there, so no run measures it again. Schema version 2 added that table;
version 3 added the collective library to the key. Older files are migrated in place when opened
(their rows are kept, read as what they were: ``"mscclpp"``, the tuned kernel every earlier
version priced and keyed a partition configuration as).

Key: (profiler kind, GPU name, partition-type fingerprint, clock MHz, comm SMs, launch slot;
-1 for sequential; collective library, ``"nccl"`` or ``"mscclpp"``: rows of the two never mix). The fingerprint is a stable hash of the partition type's structure (each
slot's ops as target, FLOPs and bytes; the collective), not of its names or count, so the same
structure found in another layer, model run or process maps to the same rows.

:class:`CachedProfiler` wraps any :class:`~kareus_fx.workload.SequenceProfiler`: it answers from the
database when it can and records what the inner profiler measures, counting hits and misses.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import StrictInt, StrictStr, ValidationError, create_model

from kareus_fx.capture.validated_input import MAX_MAGNITUDE, Number, SchemaModel, error_text, finite, int_range
from kareus_fx.errors import KareusError
from kareus_fx.workload import (
    CollectiveSpec,
    CommLibrary,
    Measurement,
    MeasurementFailedError,
    OpCost,
    PartitionConfig,
    PartitionType,
    SequenceProfiler,
)

SCHEMA_VERSION = 3
_MIGRATES_FROM = (1, 2)  # versions whose files gain the failures table and the library column when opened
_OLD_LIBRARY = "mscclpp"
"""The library of a row written before the column (module docstring)."""
_SEQUENTIAL = -1
_MAX_TRIES = 20
_SQLITE_HEADER = b"SQLite format 3\x00"

KEY_COLUMNS = ("profiler", "gpu", "fingerprint", "clock_mhz", "comm_sms", "launch_slot", "comm_library")
MEASUREMENT_COLUMNS: tuple[tuple[str, str, Any], ...] = (
    ("profiler", "TEXT NOT NULL", StrictStr),
    ("gpu", "TEXT NOT NULL", StrictStr),
    ("fingerprint", "TEXT NOT NULL", StrictStr),
    ("clock_mhz", "INTEGER NOT NULL", Annotated[StrictInt, int_range(1, 100_000)]),
    ("comm_sms", "INTEGER NOT NULL", Annotated[StrictInt, int_range(1, 100_000)]),
    ("launch_slot", "INTEGER NOT NULL", Annotated[StrictInt, int_range(_SEQUENTIAL, 100_000)]),
    ("comm_library", "TEXT NOT NULL", CommLibrary),
    ("time_s", "REAL NOT NULL", Number),
    ("energy_j", "REAL NOT NULL", Number),
    ("dynamic_energy_j", "REAL NOT NULL", Annotated[int | float, finite(-MAX_MAGNITUDE)]),
    ("static_energy_j", "REAL NOT NULL", Number),
    ("created_unix_s", "REAL NOT NULL", Number),
)
"""The one description of a ``measurements`` row: (column, SQL type, validated type). The table,
the queries and :class:`MeasurementRow` (which checks every row written and read: finite
numbers, clocks and SM counts in range) are built from it; a new column is added here."""
MEASUREMENT_FIELDS = ("time_s", "energy_j", "dynamic_energy_j", "static_energy_j")
"""The columns that make a :class:`~kareus_fx.workload.Measurement`, in its field order."""

_ROW_FIELDS: dict[str, Any] = {name: (kind, ...) for name, _, kind in MEASUREMENT_COLUMNS}
"""Field name -> (type, required); ``Any`` as ``create_model`` takes it: typed values would be
checked against its ``__config__`` / ``__doc__`` / ... keywords too when unpacked."""
MeasurementRow = create_model("MeasurementRow", __base__=SchemaModel, **_ROW_FIELDS)
"""One validated ``measurements`` row."""

_TABLE_COLUMNS = {
    "measurements": tuple(name for name, _, _ in MEASUREMENT_COLUMNS),
    "partition_types": ("fingerprint", "type_id", "structure"),
    "failures": (*KEY_COLUMNS, "reason", "created_unix_s"),
}
_TABLES_OF_VERSION = {1: ("measurements", "partition_types"), 2: ("measurements", "partition_types", "failures")}
_OLD_COLUMNS = {table: tuple(c for c in columns if c != "comm_library") for table, columns in _TABLE_COLUMNS.items()}
"""Columns of versions 1 and 2: the same, less the library."""
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS measurements (
    {", ".join(f"{name} {sql}" for name, sql, _ in MEASUREMENT_COLUMNS)},
    PRIMARY KEY ({", ".join(KEY_COLUMNS)})
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS failures (
    profiler TEXT NOT NULL,
    gpu TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    clock_mhz INTEGER NOT NULL,
    comm_sms INTEGER NOT NULL,
    launch_slot INTEGER NOT NULL,
    comm_library TEXT NOT NULL,
    reason TEXT NOT NULL,
    created_unix_s REAL NOT NULL,
    PRIMARY KEY ({", ".join(KEY_COLUMNS)})
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS partition_types (
    fingerprint TEXT PRIMARY KEY,
    type_id TEXT NOT NULL,
    structure TEXT NOT NULL
) WITHOUT ROWID;
"""
_SELECT_MEASUREMENT = f"SELECT {', '.join(MEASUREMENT_FIELDS)} FROM measurements"
_WHERE_KEY = " WHERE " + " AND ".join(f"{name}=?" for name in KEY_COLUMNS)
_ORDER = " ORDER BY fingerprint, clock_mhz, comm_sms, launch_slot, comm_library"


def structure_of(ptype: PartitionType) -> dict[str, Any]:
    """The parts of a partition type that determine its measurements (no names, ids or counts)."""
    c = ptype.collective
    return {
        "slots": [[[op.target, float(op.flops), float(op.bytes)] for op in slot.ops] for slot in ptype.slots],
        "collective": [c.kind, float(c.bytes), int(c.group_size), int(c.fused)],
    }


def fingerprint(ptype: PartitionType) -> str:
    """Stable hash of a partition type's structure (hex SHA-256, 32 characters)."""
    text = json.dumps(structure_of(ptype), separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class FingerprintCache:
    """:func:`fingerprint` per partition-type object, computed once (profilers call it per measurement).

    Keyed by object identity, holding the object so its id cannot be reused while cached.
    """

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[PartitionType, str]] = {}

    def __call__(self, ptype: PartitionType) -> str:
        hit = self._by_id.get(id(ptype))
        if hit is None or hit[0] is not ptype:
            hit = (ptype, fingerprint(ptype))
            self._by_id[id(ptype)] = hit
        return hit[1]


class ProfileDBError(KareusError, RuntimeError):
    """The profile database file is not one this version can use (corrupt, truncated, another
    program's, another schema version) or a row in it is invalid; the file is left untouched."""


class ProfileDB:
    """Measurements in a SQLite file; safe to share between threads and processes.

    ``put`` keeps the first measurement stored for a key (a concurrent writer that measured the
    same configuration gets the stored one back), so every reader sees one value per key.
    """

    def __init__(self, path: str | Path, timeout_s: float = 60.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        with _opening_lock(self.path):  # processes that open one new file at once: one sets it up
            self._open(timeout_s)

    def _open(self, timeout_s: float) -> None:
        _check_header(self.path)
        self._conn = sqlite3.connect(str(self.path), timeout=timeout_s, isolation_level=None, check_same_thread=False)
        try:
            self._conn.execute(f"PRAGMA busy_timeout = {int(timeout_s * 1000)}")
            self._check_readable()  # before anything writes: a refused file is left as it was
            mode = self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise ProfileDBError(
                    f"{self.path}: could not switch to WAL mode (got {mode!r}); is it on a network file system?"
                )
            self._conn.execute("PRAGMA synchronous = NORMAL")  # WAL: a killed process loses nothing committed
            with self._lock:
                self._write(self._init_schema)
        except sqlite3.DatabaseError as err:
            self._conn.close()
            raise ProfileDBError(
                f"{self.path} is not a usable profile database ({err}); it was left "
                f"unchanged: move it away or use another file"
            ) from None
        except BaseException:
            self._conn.close()
            raise

    # ----- setup --------------------------------------------------------------------------------
    def _refuse(self, what: str) -> None:
        raise ProfileDBError(f"{self.path}: {what}; it was left unchanged: move it away or use another file")

    def _check_readable(self) -> None:
        """Refuse a corrupt or truncated file (SQLite's quick check) and another program's
        database, reading only."""
        problems = [row[0] for row in self._conn.execute("PRAGMA quick_check").fetchall()]
        if problems != ["ok"]:
            self._refuse(f"the database is corrupt or truncated (SQLite: {problems[0]})")
        version = self._conn.execute("PRAGMA user_version").fetchone()[0]
        self._check_tables(self._conn.cursor(), version)

    def _check_tables(self, cur: sqlite3.Cursor, version: int) -> None:
        tables = {row[0] for row in cur.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if version == 0 and tables:
            self._refuse(f"not a kareus profile database (another program's tables: {', '.join(sorted(tables))})")
        if version not in (0, SCHEMA_VERSION, *_MIGRATES_FROM):
            self._refuse(f"schema version {version}; this kareus-fx reads version {SCHEMA_VERSION}")
        for table, current in _TABLE_COLUMNS.items():
            migrating = version in _MIGRATES_FROM and table in _TABLES_OF_VERSION[version]
            columns = _OLD_COLUMNS[table] if migrating else current
            if version == SCHEMA_VERSION or migrating:
                found = tuple(row[1] for row in cur.execute(f"PRAGMA table_info({table})"))
                if found != columns:
                    self._refuse(
                        f"table {table} has columns {found or 'none'}, expected {columns} "
                        f"(not a kareus profile database of version {SCHEMA_VERSION})"
                    )

    def _init_schema(self, cur: sqlite3.Cursor) -> None:
        version = cur.execute("PRAGMA user_version").fetchone()[0]
        self._check_tables(cur, version)  # again, in the write transaction: another process may have set it up
        if version != SCHEMA_VERSION:  # new, or migrated: CREATE IF NOT EXISTS adds what is missing
            keyed = [t for t in ("measurements", "failures") if t in _TABLES_OF_VERSION.get(version, ())]
            for table in keyed:  # the key gains the library: SQLite rebuilds a table to change its key
                cur.execute(f"ALTER TABLE {table} RENAME TO {table}_before_library")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    cur.execute(statement)
            for table in keyed:
                old = ", ".join(_OLD_COLUMNS[table])
                cur.execute(
                    f"INSERT INTO {table} ({old}, comm_library) SELECT {old}, ? FROM {table}_before_library",
                    (_OLD_LIBRARY,),
                )
                cur.execute(f"DROP TABLE {table}_before_library")
            cur.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _write(self, work) -> Any:
        """Run ``work(cursor)`` in one IMMEDIATE transaction (:func:`write_retrying`)."""
        still_locked = ProfileDBError(f"{self.path}: still locked by another writer after {_MAX_TRIES} tries")
        return write_retrying(
            self._conn, work, tries=_MAX_TRIES, first_delay_s=0.01, max_delay_s=1.0, still_locked=still_locked
        )

    # ----- access -------------------------------------------------------------------------------
    @staticmethod
    def _key(profiler: str, gpu: str, fp: str, config: PartitionConfig) -> tuple:
        slot = _SEQUENTIAL if config.launch_slot is None else int(config.launch_slot)
        return (profiler, gpu, fp, int(config.clock_mhz), int(config.comm_sms), slot, config.comm_library)

    def _measurement(self, key: tuple, values: tuple) -> Measurement:
        """A row's measurement, validated (:class:`MeasurementRow`)."""
        row = dict(zip(KEY_COLUMNS, key)) | dict(zip(MEASUREMENT_FIELDS, values)) | {"created_unix_s": 0.0}
        try:
            MeasurementRow.model_validate(row)
        except ValidationError as err:
            raise ProfileDBError(
                f"{error_text(err, f'{self.path}: row {key}')}; delete that row or use another file"
            ) from None
        return Measurement(*values)

    def get(
        self,
        profiler: str,
        gpu: str,
        ptype_or_fp: PartitionType | str,
        config: PartitionConfig,
    ) -> Measurement | None:
        """The stored measurement for this key, or None."""
        fp = ptype_or_fp if isinstance(ptype_or_fp, str) else fingerprint(ptype_or_fp)
        key = self._key(profiler, gpu, fp, config)
        with self._lock:
            row = self._conn.execute(_SELECT_MEASUREMENT + _WHERE_KEY, key).fetchone()
        return None if row is None else self._measurement(key, row)

    def put(
        self,
        profiler: str,
        gpu: str,
        ptype: PartitionType,
        config: PartitionConfig,
        measurement: Measurement,
        fp: str | None = None,
    ) -> Measurement:
        """Store a measurement (committed at once); returns the one stored for the key (first wins).

        A measurement :class:`MeasurementRow` refuses (NaN, a negative time) raises
        :class:`ProfileDBError` and stores nothing."""
        fp = fp or fingerprint(ptype)
        return self.insert(profiler, gpu, fp, ptype.type_id, structure_of(ptype), config, measurement)[0]

    def insert(
        self,
        profiler: str,
        gpu: str,
        fp: str,
        type_id: str,
        structure: Any,
        config: PartitionConfig,
        measurement: Measurement,
    ) -> tuple[Measurement, bool]:
        """:meth:`put` by fingerprint: ``structure`` (JSON-able) describes what ``fp`` hashes (a
        partition type, or a sequence of ops). Returns the stored measurement and whether this call
        stored it (False: the key was there already, this measurement was a duplicate)."""
        key = self._key(profiler, gpu, fp, config)
        values = tuple(getattr(measurement, name) for name in MEASUREMENT_FIELDS)
        self._measurement(key, values)

        def work(cur: sqlite3.Cursor) -> tuple[Measurement, bool]:
            cur.execute(
                "INSERT OR IGNORE INTO partition_types VALUES (?, ?, ?)",
                (fp, type_id, json.dumps(structure, separators=(",", ":"))),
            )
            cur.execute(
                f"INSERT OR IGNORE INTO measurements ({', '.join(_TABLE_COLUMNS['measurements'])}) "
                f"VALUES ({', '.join('?' * len(MEASUREMENT_COLUMNS))})",
                (*key, *values, time.time()),
            )
            inserted = cur.rowcount == 1
            return Measurement(*cur.execute(_SELECT_MEASUREMENT + _WHERE_KEY, key).fetchone()), inserted

        with self._lock:
            return self._write(work)

    def get_failure(self, profiler: str, gpu: str, fp: str, config: PartitionConfig) -> str | None:
        """The reason stored for a configuration that failed, or None."""
        with self._lock:
            row = self._conn.execute(
                "SELECT reason FROM failures" + _WHERE_KEY,
                self._key(profiler, gpu, fp, config),
            ).fetchone()
        return None if row is None else str(row[0])

    def put_failure(
        self, profiler: str, gpu: str, ptype: PartitionType, config: PartitionConfig, reason: str, fp: str | None = None
    ) -> None:
        """Record that ``config`` cannot run, and why (committed at once; the first reason stays)."""
        fp = fp or fingerprint(ptype)

        def work(cur: sqlite3.Cursor) -> None:
            cur.execute(
                "INSERT OR IGNORE INTO partition_types VALUES (?, ?, ?)",
                (fp, ptype.type_id, json.dumps(structure_of(ptype), separators=(",", ":"))),
            )
            cur.execute(
                f"INSERT OR IGNORE INTO failures VALUES ({', '.join('?' * len(_TABLE_COLUMNS['failures']))})",
                (*self._key(profiler, gpu, fp, config), reason, time.time()),
            )

        with self._lock:
            self._write(work)

    def failures(self, profiler: str | None = None) -> list[tuple[str, PartitionConfig, str]]:
        """Stored failures, optionally of one profiler: (fingerprint, config, reason)."""
        sql, args = "SELECT fingerprint, clock_mhz, comm_sms, launch_slot, comm_library, reason FROM failures", []
        if profiler is not None:
            sql, args = sql + " WHERE profiler=?", [profiler]
        with self._lock:
            rows = self._conn.execute(sql + _ORDER, args).fetchall()
        return [(r[0], PartitionConfig(r[1], r[2], None if r[3] == _SEQUENTIAL else r[3], r[4]), r[5]) for r in rows]

    def measurements(
        self, profiler: str | None = None, gpu: str | None = None, fp: str | None = None
    ) -> list[tuple[str, str, str, PartitionConfig, Measurement]]:
        """Stored rows, optionally filtered: (profiler, gpu, fingerprint, config, measurement)."""
        where, args = [], []
        for column, value in (("profiler", profiler), ("gpu", gpu), ("fingerprint", fp)):
            if value is not None:
                where.append(f"{column}=?")
                args.append(value)
        sql = f"SELECT {', '.join((*KEY_COLUMNS, *MEASUREMENT_FIELDS))} FROM measurements"
        if where:
            sql += " WHERE " + " AND ".join(where)
        with self._lock:
            rows = self._conn.execute(sql + _ORDER, args).fetchall()
        n = len(KEY_COLUMNS)
        return [
            (
                r[0],
                r[1],
                r[2],
                PartitionConfig(r[3], r[4], None if r[5] == _SEQUENTIAL else r[5], r[6]),
                self._measurement(r[:n], r[n:]),
            )
            for r in rows
        ]

    def count(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM measurements").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> ProfileDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_retrying(
    conn: sqlite3.Connection, work, *, tries: int, first_delay_s: float, max_delay_s: float, still_locked: KareusError
) -> Any:
    """``work(cursor)`` in one IMMEDIATE transaction, retried with doubling sleeps while another
    writer holds the lock (each try already waits up to the connection's busy timeout); raises
    ``still_locked`` after ``tries``."""
    delay_s = first_delay_s
    for _ in range(tries):
        try:
            cur = conn.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                result = work(cur)
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")
            return result
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            time.sleep(delay_s)
            delay_s = min(2 * delay_s, max_delay_s)
    raise still_locked


@contextlib.contextmanager
def _opening_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``<path>.lock`` while a process checks and sets up the file:
    several processes opening a new database at once (a distributed profiling job) otherwise see
    each other's half-made file (WAL switch, first schema) and refuse it."""
    with open(path.with_name(path.name + ".lock"), "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _check_header(path: Path) -> None:
    """Refuse a non-empty file that does not start with SQLite's header (another kind of file, or
    one truncated below its first page), before SQLite opens it."""
    try:
        with path.open("rb") as f:
            head = f.read(len(_SQLITE_HEADER))
    except FileNotFoundError:
        return
    except OSError as err:
        raise ProfileDBError(f"cannot read profile database {path}: {err.strerror}") from None
    if head and head != _SQLITE_HEADER:
        raise ProfileDBError(
            f"{path} is not an SQLite profile database (it does not start with SQLite's "
            f"header: another kind of file, or truncated); it was left unchanged: move it "
            f"away or use another file"
        )


def measurement_key(profiler: str, gpu: str, fp: str, config: PartitionConfig) -> str:
    """One text for a measurement's database key (the queue's and the log's item key)."""
    slot = _SEQUENTIAL if config.launch_slot is None else int(config.launch_slot)
    return f"{profiler}|{gpu}|{fp}|{int(config.clock_mhz)}|{int(config.comm_sms)}|{slot}|{config.comm_library}"


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0


class CachedProfiler:
    """A :class:`~kareus_fx.workload.Profiler` that consults a :class:`ProfileDB` first.

    ``kind`` names the inner profiler in the database key (default: its ``kind`` attribute, else
    its class name): measurements of different profilers never mix.
    """

    def __init__(
        self,
        inner: SequenceProfiler,
        db: ProfileDB,
        kind: str | None = None,
        log: Any | None = None,
        run: str = "",
        rank: int = 0,
    ) -> None:
        self.inner = inner
        self.db = db
        self.log = log
        """A :class:`~kareus_fx.cost_models.profile_queue.ProfileQueue` that logs each measurement
        made (with ``run`` and ``rank``), or None."""
        self.run = run
        self.rank = rank
        self.gpu_name = inner.gpu_name
        self.kind = kind or getattr(inner, "kind", None) or type(inner).__name__
        self.stats = CacheStats()
        self._fingerprint = FingerprintCache()

    @property
    def hits(self) -> int:
        return self.stats.hits

    @property
    def misses(self) -> int:
        return self.stats.misses

    def measure(self, ptype: PartitionType, config: PartitionConfig) -> Measurement:
        """The stored measurement, else the inner profiler's (stored); a configuration that failed,
        now or in an earlier run, raises :class:`MeasurementFailedError` with the stored reason."""
        fp = self._fingerprint(ptype)
        stored = self.db.get(self.kind, self.gpu_name, fp, config)
        if stored is not None:
            self.stats.hits += 1
            return stored
        failed = self.db.get_failure(self.kind, self.gpu_name, fp, config)
        if failed is not None:
            self.stats.hits += 1
            raise MeasurementFailedError(failed)
        self.stats.misses += 1
        try:
            measurement = self.inner.measure(ptype, config)
        except MeasurementFailedError as err:
            self.db.put_failure(self.kind, self.gpu_name, ptype, config, err.reason, fp=fp)
            raise
        stored, inserted = self.db.insert(
            self.kind, self.gpu_name, fp, ptype.type_id, structure_of(ptype), config, measurement
        )
        if self.log is not None:
            self.log.log(measurement_key(self.kind, self.gpu_name, fp, config), self.run, self.rank, inserted)
        return stored

    def measure_sequence(
        self, ops: Sequence[OpCost], collectives: Sequence[CollectiveSpec], clock_mhz: int
    ) -> Measurement:
        """Work run op after op, measured by the inner profiler (not stored: the database keys
        partitions; sequential work is one measurement per clock and graph)."""
        return self.inner.measure_sequence(ops, collectives, clock_mhz)
