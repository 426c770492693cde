"""Profile database: keys, first-writer-wins, concurrent writer processes, resume after SIGKILL."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kareus_fx.cost_models.analytic_workloads import kareus_attention_tp2, llama_attention_partition
from kareus_fx.cost_models.profile_db import CachedProfiler, ProfileDB, ProfileDBError, fingerprint
from kareus_fx.workload import Measurement, PartitionConfig, PartitionType


def _m(x: float) -> Measurement:
    return Measurement(x, 10 * x, 4 * x, 6 * x)


class CountingProfiler:
    """A fake profiler that records every call."""

    gpu_name = "A100-SXM4-40GB"

    def __init__(self) -> None:
        self.calls: list[PartitionConfig] = []

    def measure(self, ptype: PartitionType, config: PartitionConfig) -> Measurement:
        self.calls.append(config)
        return _m(config.clock_mhz * 1e-6 + config.comm_sms * 1e-3 + (config.launch_slot or 0) * 1e-2)


def _configs() -> list[PartitionConfig]:
    return [
        PartitionConfig(clock, sms, slot) for clock in (1200, 1410) for sms in (2, 4, 8) for slot in (None, 0, 2, 5)
    ]


def test_fingerprint_depends_on_structure_only():
    a = llama_attention_partition()
    renamed = replace(a, type_id="other", count=7, graph="backward")
    assert fingerprint(a) == fingerprint(renamed)
    other_ops = replace(a, slots=a.slots[:-1])
    assert fingerprint(a) != fingerprint(other_ops)
    bigger = replace(a, collective=replace(a.collective, bytes=a.collective.bytes * 2))
    assert fingerprint(a) != fingerprint(bigger)
    assert fingerprint(a) != fingerprint(kareus_attention_tp2())


def test_fingerprint_is_stable_across_processes():
    code = (
        "from kareus_fx.cost_models.analytic_workloads import llama_attention_partition as f; "
        "from kareus_fx.cost_models.profile_db import fingerprint; print(fingerprint(f()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "123"},
    )
    assert out.stdout.strip() == fingerprint(llama_attention_partition())


def test_put_get_roundtrip_and_first_writer_wins(tmp_path: Path):
    pt = kareus_attention_tp2()
    cfg = PartitionConfig(1410, 4, 2)
    with ProfileDB(tmp_path / "p.sqlite") as db:
        assert db.get("sim", "A100", pt, cfg) is None
        assert db.put("sim", "A100", pt, cfg, _m(1.0)) == _m(1.0)
        assert db.put("sim", "A100", pt, cfg, _m(2.0)) == _m(1.0)  # kept the first
        assert db.get("sim", "A100", pt, cfg) == _m(1.0)
        assert db.get("sim", "A100", fingerprint(pt), cfg) == _m(1.0)
        # Every key part matters; sequential is its own key.
        assert db.get("other", "A100", pt, cfg) is None
        assert db.get("sim", "H100", pt, cfg) is None
        assert db.get("sim", "A100", pt, PartitionConfig(1410, 4, None)) is None
        db.put("sim", "A100", pt, PartitionConfig(1410, 4, None), _m(3.0))
        rows = db.measurements(profiler="sim")
        assert {r[3] for r in rows} == {cfg, PartitionConfig(1410, 4, None)}
    with ProfileDB(tmp_path / "p.sqlite") as db:  # persisted
        assert db.count() == 2


def test_the_collective_library_is_part_of_the_key(tmp_path: Path):
    """NCCL's and MSCCL++'s measurements of the same (clock, SMs, slot) never mix."""
    pt = kareus_attention_tp2()
    mscclpp, nccl = PartitionConfig(1410, 24, 0), PartitionConfig(1410, 24, 0, "nccl")
    with ProfileDB(tmp_path / "p.sqlite") as db:
        db.put("sim", "A100", pt, mscclpp, _m(1.0))
        assert db.get("sim", "A100", pt, nccl) is None
        db.put("sim", "A100", pt, nccl, _m(2.0))
        assert db.get("sim", "A100", pt, mscclpp) == _m(1.0) and db.get("sim", "A100", pt, nccl) == _m(2.0)
        assert {r[3] for r in db.measurements()} == {mscclpp, nccl}
        db.put_failure("sim", "A100", pt, PartitionConfig(1410, 3, 0, "nccl"), "timed out")
        assert db.get_failure("sim", "A100", fingerprint(pt), PartitionConfig(1410, 3, 0)) is None
        assert db.failures() == [(fingerprint(pt), PartitionConfig(1410, 3, 0, "nccl"), "timed out")]


def test_a_version_2_database_keeps_its_rows_as_the_tuned_kernels(tmp_path: Path):
    """A file written before the library column: its rows and failures read as MSCCL++ (what
    every earlier version priced a partition configuration as), NCCL rows are measured anew."""
    import sqlite3

    path = tmp_path / "v2.sqlite"
    conn = sqlite3.connect(path)
    key = "profiler TEXT NOT NULL, gpu TEXT NOT NULL, fingerprint TEXT NOT NULL, clock_mhz INTEGER NOT NULL, "
    key += "comm_sms INTEGER NOT NULL, launch_slot INTEGER NOT NULL"
    pk = "PRIMARY KEY (profiler, gpu, fingerprint, clock_mhz, comm_sms, launch_slot)"
    conn.executescript(f"""
        CREATE TABLE measurements ({key}, time_s REAL NOT NULL, energy_j REAL NOT NULL,
            dynamic_energy_j REAL NOT NULL, static_energy_j REAL NOT NULL, created_unix_s REAL NOT NULL,
            {pk}) WITHOUT ROWID;
        CREATE TABLE failures ({key}, reason TEXT NOT NULL, created_unix_s REAL NOT NULL, {pk}) WITHOUT ROWID;
        CREATE TABLE partition_types (fingerprint TEXT PRIMARY KEY, type_id TEXT NOT NULL,
            structure TEXT NOT NULL) WITHOUT ROWID;
        INSERT INTO measurements VALUES ('sim', 'A100', 'abc', 1410, 24, 0, 1.0, 10.0, 4.0, 6.0, 0.0);
        INSERT INTO failures VALUES ('sim', 'A100', 'abc', 1410, 3, 0, 'oom', 0.0);
        PRAGMA user_version = 2;
    """)
    conn.close()
    with ProfileDB(path) as db:
        assert db.get("sim", "A100", "abc", PartitionConfig(1410, 24, 0)) == _m(1.0)
        assert db.get("sim", "A100", "abc", PartitionConfig(1410, 24, 0, "nccl")) is None
        assert db.get_failure("sim", "A100", "abc", PartitionConfig(1410, 3, 0)) == "oom"
    with ProfileDB(path) as db:  # reopened: version 3, same rows
        assert db.count() == 1 and db.failures() == [("abc", PartitionConfig(1410, 3, 0, "mscclpp"), "oom")]


def test_cached_profiler_counts_hits_and_misses(tmp_path: Path):
    pt = llama_attention_partition()
    inner = CountingProfiler()
    with ProfileDB(tmp_path / "p.sqlite") as db:
        cached = CachedProfiler(inner, db)
        first = [cached.measure(pt, c) for c in _configs()]
        again = [cached.measure(pt, c) for c in _configs()]
        assert first == again
        assert cached.misses == len(_configs()) and cached.hits == len(_configs())
        assert len(inner.calls) == len(_configs())
        assert cached.kind == "CountingProfiler" and cached.gpu_name == inner.gpu_name


def _writer(path: str, worker: int, n: int) -> None:
    pt = kareus_attention_tp2()
    with ProfileDB(path) as db:
        for k in range(n):
            # Half the keys are shared by all workers, half are the worker's own.
            sms = 1 + k % 20 if k % 2 == 0 else 21 + worker
            db.put("sim", "A100", pt, PartitionConfig(900 + 15 * k, sms, k % 7), _m(worker + 1.0))


def test_concurrent_writer_processes(tmp_path: Path):
    path = str(tmp_path / "p.sqlite")
    ProfileDB(path).close()
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=_writer, args=(path, w, 40)) for w in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
        assert w.exitcode == 0
    with ProfileDB(path) as db:
        rows = db.measurements()
        keys = {(r[3].clock_mhz, r[3].comm_sms, r[3].launch_slot) for r in rows}
        assert len(rows) == len(keys) == 20 + 4 * 20  # shared keys once, each worker's own keys
        pt = kareus_attention_tp2()
        for r in rows:  # one consistent value per key
            assert db.get("sim", "A100", pt, r[3]) == r[4]


_KILLED_CHILD = textwrap.dedent("""
    import sys, time
    from kareus_fx.cost_models.analytic_workloads import llama_attention_partition
    from kareus_fx.cost_models.profile_db import CachedProfiler, ProfileDB
    from kareus_fx.workload import Measurement, PartitionConfig

    class Slow:
        gpu_name = "A100-SXM4-40GB"
        def measure(self, ptype, config):
            time.sleep(0.05)
            return Measurement(config.clock_mhz * 1e-6, 1.0, 0.4, 0.6)

    configs = [PartitionConfig(c, s, l) for c in (1200, 1410) for s in (2, 4, 8) for l in (None, 0, 2, 5)]
    profiler = CachedProfiler(Slow(), ProfileDB(sys.argv[1]), kind="slow")
    for c in configs:
        profiler.measure(llama_attention_partition(), c)
    time.sleep(60)  # never finishes on its own before the parent kills it
""")


def test_resume_after_killed_process(tmp_path: Path):
    path = tmp_path / "p.sqlite"
    ProfileDB(path).close()
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, str(path)])
    try:
        deadline = time.time() + 60
        with ProfileDB(path) as db:
            while db.count() < 5 and time.time() < deadline:
                time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    with ProfileDB(path) as db:
        stored = db.count()
        assert 5 <= stored < len(_configs())  # killed mid-way: some rows, not all
        inner = CountingProfiler()
        resumed = CachedProfiler(inner, db, kind="slow")
        for c in _configs():
            resumed.measure(llama_attention_partition(), c)
        assert resumed.hits == stored
        assert len(inner.calls) == resumed.misses == len(_configs()) - stored
        assert db.count() == len(_configs())
        # Nothing measured twice: the killed child's configs are not among the new calls.
        child_configs = {r[3] for r in db.measurements() if r[4].time_s == r[3].clock_mhz * 1e-6}
        assert len(child_configs) == stored and not child_configs & set(inner.calls)


def test_rejects_other_schema_version(tmp_path: Path):
    import sqlite3

    path = tmp_path / "p.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 99")
    conn.commit()
    conn.close()
    from kareus_fx.cost_models.profile_db import ProfileDBError

    with pytest.raises(ProfileDBError, match="schema version 99"):
        ProfileDB(path)


# ----- files that are not a usable profile database: refused, left exactly as they were ---------
def _filled_db(path: Path, rows: int = 300) -> list:
    pt = kareus_attention_tp2()
    with ProfileDB(path) as db:
        for k in range(rows):
            db.put("sim", "A100", pt, PartitionConfig(600 + k, 1 + k % 40, k % 5), _m(1.0 + k))
        stored = db.measurements()
    return stored


def _refused_unchanged(path: Path, match: str) -> None:
    before = path.read_bytes()
    with pytest.raises(ProfileDBError, match=match):
        ProfileDB(path)
    assert path.read_bytes() == before
    assert not Path(f"{path}-wal").exists() or Path(f"{path}-wal").stat().st_size == 0


def test_truncated_database_is_refused_and_left_unchanged(tmp_path):
    path = tmp_path / "p.sqlite"
    _filled_db(path)
    data = path.read_bytes()
    assert len(data) > 3 * 4096
    path.write_bytes(data[: len(data) // 2])
    _refused_unchanged(path, r"p.sqlite: .*corrupt or truncated|p.sqlite is not a usable profile database")
    path.write_bytes(data[:50])  # shorter than SQLite's header page
    _refused_unchanged(path, "p.sqlite is not a usable profile database \\(database disk image is malformed\\)")
    path.write_bytes(data[:10])  # not even SQLite's header
    _refused_unchanged(path, "not an SQLite profile database")


def test_corrupt_database_is_refused_and_left_unchanged(tmp_path):
    path = tmp_path / "p.sqlite"
    _filled_db(path)
    data = bytearray(path.read_bytes())
    data[2 * 4096 : 2 * 4096 + 200] = bytes(range(200))  # garbage over a b-tree page's header
    path.write_bytes(bytes(data))
    _refused_unchanged(path, r"corrupt or truncated|not a usable profile database")


def test_foreign_files_are_refused_and_left_unchanged(tmp_path):
    import sqlite3

    text = tmp_path / "notes.sqlite"
    text.write_text("stage,instruction\n0,forward\n")
    _refused_unchanged(text, "not an SQLite profile database")
    other = tmp_path / "other.sqlite"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO customers VALUES (1, 'a')")
    conn.commit()
    conn.close()
    _refused_unchanged(other, r"not a kareus profile database \(another program's tables: customers\)")
    conn = sqlite3.connect(other)
    conn.execute("PRAGMA user_version = 1")  # right version number, wrong tables
    conn.commit()
    conn.close()
    _refused_unchanged(other, "table measurements has columns none")
    conn = sqlite3.connect(other)
    assert conn.execute("SELECT * FROM customers").fetchall() == [(1, "a")]
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # not switched to WAL
    conn.close()


def test_a_valid_database_keeps_every_row_on_reopening(tmp_path):
    path = tmp_path / "p.sqlite"
    stored = _filled_db(path)
    with ProfileDB(path) as db:
        assert db.measurements() == stored and db.count() == 300


def test_invalid_rows_are_refused_on_write_and_on_read(tmp_path):
    import sqlite3

    path = tmp_path / "p.sqlite"
    pt = kareus_attention_tp2()
    with ProfileDB(path) as db:
        with pytest.raises(ProfileDBError, match=r"row \('sim', 'A100', .*time_s: expected a finite number"):
            db.put("sim", "A100", pt, PartitionConfig(1410, 8, 0), Measurement(float("nan"), 1.0, 0.5, 0.5))
        assert db.count() == 0
        db.put("sim", "A100", pt, PartitionConfig(1410, 8, 0), _m(1.0))
    conn = sqlite3.connect(path)
    conn.execute("UPDATE measurements SET time_s = -1.0")  # another tool wrote a bad value
    conn.commit()
    conn.close()
    with ProfileDB(path) as db, pytest.raises(ProfileDBError, match=r"time_s: expected a number >= 0"):
        db.measurements()
