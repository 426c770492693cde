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
from kareus_fx.cost_models.profile_db import CachedProfiler, ProfileDB, fingerprint
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
    return [PartitionConfig(clock, sms, slot) for clock in (1200, 1410) for sms in (2, 4, 8)
            for slot in (None, 0, 2, 5)]


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
    code = ("from kareus_fx.cost_models.analytic_workloads import llama_attention_partition as f; "
            "from kareus_fx.cost_models.profile_db import fingerprint; print(fingerprint(f()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "123"})
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
