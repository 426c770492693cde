"""Configurations that cannot run: recorded as failed with their reason, never measured again.

A profiler over the synthetic partition model fails every configuration with the most
communication SMs ("out of memory", as a replay holding the largest comm buffers would). What can
fail: the tuning run stops or raises, a failed configuration enters the frontier, is measured
twice in a run or again in a resumed run over the same profile database, the reason is lost, an
existing version-1 database is refused or loses its rows, the device profiler lets an
out-of-memory error through instead of a failed configuration.
"""

from __future__ import annotations

import sqlite3

import pytest
import torch

from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.cost_models.profile_db import SCHEMA_VERSION, CachedProfiler, ProfileDB
from kareus_fx.tuner import MBOSettings, TuningResult, tune_partition
from kareus_fx.tuner.synthetic import SyntheticProfiler, synthetic_partition_types
from kareus_fx.workload import Measurement, MeasurementFailedError, PartitionConfig, PartitionType

_, MEDIUM, _ = synthetic_partition_types()
SETTINGS = MBOSettings(clock_stride_mhz=120)
OOM = "out of memory: the replay needs 41.5 GiB, the GPU has 40 GiB"


class FailingProfiler:
    """The synthetic profiler, failing every configuration that gives the collective ``failing_sms``."""

    def __init__(self, failing_sms: int) -> None:
        self.inner = SyntheticProfiler()
        self.gpu_name = self.inner.gpu_name
        self.failing_sms = failing_sms
        self.calls: list[PartitionConfig] = []

    def measure(self, ptype: PartitionType, config: PartitionConfig) -> Measurement:
        self.calls.append(config)
        if config.comm_sms == self.failing_sms:
            raise MeasurementFailedError(OOM)
        return self.inner.measure(ptype, config)


def _failing_sms() -> int:
    return max(SETTINGS.space_for(MEDIUM, gpu_spec(SyntheticProfiler().gpu_name)).comm_sms)


def test_failing_replays_are_recorded_as_failed_and_the_tuning_run_completes(tmp_path):
    profiler = FailingProfiler(_failing_sms())
    with ProfileDB(tmp_path / "profile.sqlite") as db:
        result = tune_partition(MEDIUM, CachedProfiler(profiler, db, kind="synthetic"), settings=SETTINGS, seed=3)
        stored = db.failures("synthetic")
    assert result.failed, "the initial sample holds the most-SMs anchor, which fails"
    assert result.stats.stop_reason in ("converged", "max_batches", "budget", "exhausted")
    assert result.stats.failed == len(result.failed) and result.stats.measured == len(result.points)
    assert all(f.reason == OOM and f.config.comm_sms == profiler.failing_sms for f in result.failed)
    assert result.frontier and all(p.config.comm_sms != profiler.failing_sms for p in result.points)
    assert len(profiler.calls) == len(set(profiler.calls)) == len(result.points) + len(result.failed)
    assert {config for _, config, _ in stored} == {f.config for f in result.failed}
    assert {reason for *_, reason in stored} == {OOM}
    again = TuningResult.from_dict(result.to_dict())
    assert again.failed == result.failed and again.stats.failed == result.stats.failed

    # Resume over the same database: nothing is measured again, failed configurations included.
    fresh = FailingProfiler(profiler.failing_sms)
    with ProfileDB(tmp_path / "profile.sqlite") as db:
        cached = CachedProfiler(fresh, db, kind="synthetic")
        resumed = tune_partition(MEDIUM, cached, settings=SETTINGS, seed=3)
    assert fresh.calls == []
    assert resumed.failed == result.failed and cached.misses == 0


def test_a_run_whose_every_configuration_fails_stops_with_an_empty_frontier():
    class AlwaysFails(FailingProfiler):
        def measure(self, ptype, config):
            self.calls.append(config)
            raise MeasurementFailedError("collective timed out after 30 s")

    profiler = AlwaysFails(0)
    result = tune_partition(MEDIUM, profiler, settings=SETTINGS, seed=0)
    assert result.stats.stop_reason == "all_failed" and result.frontier == []
    assert len(result.failed) == len(profiler.calls) == result.stats.n_init


def test_a_version_1_database_is_migrated_and_keeps_its_rows(tmp_path):
    path = tmp_path / "v1.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript("""
        CREATE TABLE measurements (profiler TEXT NOT NULL, gpu TEXT NOT NULL, fingerprint TEXT NOT NULL,
            clock_mhz INTEGER NOT NULL, comm_sms INTEGER NOT NULL, launch_slot INTEGER NOT NULL, time_s REAL NOT NULL,
            energy_j REAL NOT NULL, dynamic_energy_j REAL NOT NULL, static_energy_j REAL NOT NULL,
            created_unix_s REAL NOT NULL,
            PRIMARY KEY (profiler, gpu, fingerprint, clock_mhz, comm_sms, launch_slot)) WITHOUT ROWID;
        CREATE TABLE partition_types (fingerprint TEXT PRIMARY KEY, type_id TEXT NOT NULL,
            structure TEXT NOT NULL) WITHOUT ROWID;
        INSERT INTO measurements VALUES ('synthetic', 'A100', 'abc', 1410, 8, -1, 1.0, 2.0, 0.5, 1.5, 0.0);
        PRAGMA user_version = 1;
    """)
    conn.close()
    config = PartitionConfig(1410, 8, None)
    with ProfileDB(path) as db:
        assert db.get("synthetic", "A100", "abc", config) == Measurement(1.0, 2.0, 0.5, 1.5)
        db.put_failure("synthetic", "A100", MEDIUM, PartitionConfig(1410, 16, None), OOM, fp="abc")
        assert db.get_failure("synthetic", "A100", "abc", PartitionConfig(1410, 16, None)) == OOM
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3
    conn.close()


def test_device_profiler_reports_out_of_memory_as_a_failed_configuration(monkeypatch):
    """The replay is built on CPU (as the replay tests do); the measurement raises CUDA's
    out-of-memory error, which must come back as a failed configuration naming the cause."""
    from kareus_fx.runtime.device_profiler import DeviceProfiler

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    profiler = DeviceProfiler(gpu_name=SyntheticProfiler().gpu_name)
    monkeypatch.setattr(profiler, "_check_cuda", lambda: None)
    monkeypatch.setattr(profiler, "_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(profiler, "_measure", out_of_memory)
    with pytest.raises(MeasurementFailedError, match=r"out of memory replaying .*Tried to allocate 2.00 GiB") as err:
        profiler.measure(MEDIUM, PartitionConfig(1410, 8, None))
    assert err.value.reason.startswith("out of memory")
    assert profiler._replays == {}  # dropped: the next configuration builds it afresh
