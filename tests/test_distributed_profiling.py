"""The distributed profiler on CPU (gloo): the shared queue, a killed process, a dead peer, the cost record.

Real processes, real gloo collectives, real replays of kernel proxies on CPU (the ``cpu-replay``
test device: wall-clock time, fixed-power energy). A partition type is built by hand here (an mm,
a copy and an all-reduce) so each measurement takes milliseconds; ``kareus plan --profiler
cpu-replay --nproc 4`` itself runs in the slow test at the end.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sqlite3
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_harness import DistributedTestError, run_distributed

from kareus_fx.cost_models.profile_db import ProfileDB, measurement_key
from kareus_fx.cost_models.profile_queue import ProfileQueue
from kareus_fx.plan.profiling_cost import MeasurementLedger, ProfilingCost
from kareus_fx.workload import CollectiveSpec, OpCost, PartitionConfig, PartitionType, SlotSpec

GPU = "A100-SXM4-40GB"
PEER_TIMEOUT_S = 20.0
MEASUREMENT_S = 0.1
PTYPE = PartitionType(
    type_id="T0",
    graph="forward",
    slots=(
        SlotSpec((OpCost("mm", "aten.mm.default", 2 * 64**3, 3 * 64 * 64 * 2, "compute"),)),
        SlotSpec((OpCost("add", "aten.add.Tensor", 0.0, 3 * 4096 * 4, "memory"),)),
    ),
    collective=CollectiveSpec("all_reduce", 64 * 1024, 2),
    count=4,
    launch_slots=(0, 1),
)
CONFIGS = [
    PartitionConfig(clock, sms, slot) for clock in range(900, 1410, 60) for sms in (8, 16) for slot in (0, 1, None)
]


def test_profiling_cost_is_measurements_times_window_and_cooldown_over_groups():
    cost = ProfilingCost(measurements=720, duplicates=0, groups=2, gpus_per_group=8, window_s=5.0, cooldown_s=5.0)
    assert cost.wall_s_on_device == 720 * 10.0 / 2
    assert cost.gpu_hours == pytest.approx(3600 * 16 / 3600)  # 1 hour of 16 GPUs
    assert cost.to_dict()["gpu_hours"] == cost.gpu_hours


def test_ledger_counts_a_key_once_under_its_first_purpose():
    ledger = MeasurementLedger()
    ledger.add(("T0", CONFIGS[0]), "tuning")
    ledger.add(("T0", CONFIGS[0]), "nanobatching")  # the tuner measured it already
    ledger.add(("T0", CONFIGS[1]), "nanobatching")
    ledger.add(("seq", PartitionConfig(1410, 1, None)), "sequences")
    assert len(ledger) == 3
    assert ledger.by_purpose() == {"tuning": 1, "nanobatching": 1, "sequences": 1}
    cost = ProfilingCost(
        measurements=3, duplicates=0, groups=1, gpus_per_group=8, window_s=5.0, by_purpose=ledger.by_purpose()
    )
    assert cost.to_dict()["by_purpose"] == {"tuning": 1, "nanobatching": 1, "sequences": 1}
    with pytest.raises(ValueError, match="does not add up"):
        ProfilingCost(
            measurements=4, duplicates=0, groups=1, gpus_per_group=8, window_s=5.0, by_purpose=ledger.by_purpose()
        )


def test_queue_gives_each_item_to_exactly_one_claimant(tmp_path):
    """Four claimants with their own connections race for 200 items: each is claimed once."""
    path = tmp_path / "queue.sqlite"
    with ProfileQueue(path) as queue:
        queue.start_run("r", 0)
        assert queue.add("r", {f"k{i}": {"i": i} for i in range(200)}) == 200
        assert queue.add("r", {"k0": {"i": 0}}) == 0  # queued once
    claimed: dict[int, list[str]] = {g: [] for g in range(4)}

    def claim_all(group: int) -> None:
        with ProfileQueue(path) as mine:
            while (item := mine.claim("r", group)) is not None:
                claimed[group].append(item.key)
                mine.finish("r", item.key)

    threads = [threading.Thread(target=claim_all, args=(g,)) for g in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    keys = [k for ks in claimed.values() for k in ks]
    assert sorted(keys) == sorted(f"k{i}" for i in range(200))
    with ProfileQueue(path) as queue:
        assert {item.status for item in queue.items("r").values()} == {"done"}
        queue.start_run("r2", 0)  # a new run drops the old run's items
        assert queue.items("r") == {}


# ----- processes -------------------------------------------------------------------------------------
def _profiling_rank(rank: int, world_size: int, work: str, result_dir: str) -> None:
    """One rank of a 2-group world measuring ``CONFIGS`` of ``PTYPE`` through the queue; rank 0
    coordinates. Writes ``{ok, error, message, wall_s}`` to ``result_dir/rank{rank}.json``."""
    import torch

    from kareus_fx.plan.distributed_plan import Catalog, GroupWorker, Session, serve_or_coordinate
    from kareus_fx.runtime.group_replay import EnergyModel, GroupComms, GroupMeasurer

    started = time.monotonic()
    outcome: dict = {"ok": True}
    try:
        comms = GroupComms.create(tp=2, cp=1, timeout_s=PEER_TIMEOUT_S)
        run = [os.environ["KAREUS_TEST_RUN"]]
        session = Session(rank, world_size, rank, comms, run[0], PEER_TIMEOUT_S)
        catalog = Catalog("cpu-replay", GPU, {"T0": PTYPE}, {}, 16)
        worker = GroupWorker(catalog, session, GroupMeasurer(comms, EnergyModel(40.0), torch.device("cpu"), repeats=2))
        measure = worker.measure

        def paced(payload):
            # A device measurement takes seconds; 0.1 s here keeps the job running while the test
            # kills a rank (unpaced, an idle machine finishes all of CONFIGS between two polls).
            time.sleep(MEASUREMENT_S)
            return measure(payload)

        worker.measure = paced
        serve_or_coordinate(
            session,
            worker,
            Path(work),
            lambda profiler: profiler.prefetch(partitions=[(PTYPE, c) for c in CONFIGS]),
            30.0,
        )
    except Exception as err:  # noqa: BLE001 - reported to the test
        outcome = {"ok": False, "error": type(err).__name__, "message": str(err)}
    outcome["wall_s"] = time.monotonic() - started
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(outcome))


def _rank_main(rank: int, world_size: int, port: int, run: str, work: str, result_dir: str, sys_path: list) -> None:
    sys.path.extend(p for p in sys_path if p not in sys.path)
    os.environ["KAREUS_TEST_RUN"] = run
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    _profiling_rank(rank, world_size, work, result_dir)
    os._exit(0)  # no teardown collectives: peers may be gone


def _start_world(world_size: int, run: str, work: Path, result_dir: Path) -> list:
    from dist_harness import PRELOAD, _free_port

    ctx = mp.get_context("forkserver")
    # The ranks fork from a server that has imported the profiler (when this test starts it first).
    ctx.set_forkserver_preload([*PRELOAD, "kareus_fx.plan.distributed_plan"])
    port = _free_port()
    procs = [
        ctx.Process(
            target=_rank_main, args=(r, world_size, port, run, str(work), str(result_dir), list(sys.path)), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    return procs


def _result(result_dir: Path, rank: int) -> str | None:
    path = result_dir / f"rank{rank}.json"
    return path.read_text() if path.exists() else None


def _stored(work: Path) -> int:
    """Measurements in the profile database (read only: the job keeps writing)."""
    if not (work / "profile.sqlite").exists():
        return 0
    try:
        with sqlite3.connect(f"file:{work / 'profile.sqlite'}?mode=ro", uri=True) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM measurements").fetchone()[0])
    except sqlite3.OperationalError:  # the job is still creating the tables
        return 0


def test_a_killed_process_stops_the_job_and_the_rerun_measures_nothing_twice(tmp_path):
    """Kill rank 1 (rank 0's group peer) after some measurements; every other rank stops with a
    typed error within the timeout; a new job on the same database measures only what was missing."""
    work, first, second = tmp_path / "work", tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    procs = _start_world(4, "run1", work, first)
    deadline = time.monotonic() + 90
    while _stored(work) < 10:
        assert time.monotonic() < deadline, "the first job measured nothing"
        assert all(p.exitcode is None for p in procs), [(p.exitcode, _result(first, r)) for r, p in enumerate(procs)]
        time.sleep(0.05)
    killed_at = time.monotonic()
    os.kill(procs[1].pid, signal.SIGKILL)
    for p in procs:
        p.join(timeout=PEER_TIMEOUT_S + 40)
        assert p.exitcode is not None, "a rank hangs after its peer was killed"
    results = {r: json.loads((first / f"rank{r}.json").read_text()) for r in (0, 2, 3)}
    assert results[0]["ok"] is False and results[0]["error"] == "PeerLostError", results[0]
    assert "restart the job" in results[0]["message"]
    assert time.monotonic() - killed_at < PEER_TIMEOUT_S + 40
    stored_after_kill = _stored(work)
    assert 10 <= stored_after_kill < len(CONFIGS)

    procs = _start_world(4, "run2", work, second)
    for p in procs:
        p.join(timeout=120)
    results = {r: json.loads((second / f"rank{r}.json").read_text()) for r in range(4)}
    assert all(r["ok"] for r in results.values()), results
    with ProfileDB(work / "profile.sqlite") as db:
        rows = db.measurements()
    assert len(rows) == len(CONFIGS)  # every configuration stored exactly once
    with ProfileQueue(work / "profile-queue.sqlite") as queue:
        run1 = {key for key, *_ in queue.logged("run1")}
        run2 = [key for key, *_ in queue.logged("run2")]
        assert queue.duplicates() == 0
    assert len(run2) == len(set(run2)) == len(CONFIGS) - stored_after_kill  # only what was missing
    assert not run1 & set(run2)
    assert {k for k, *_ in queue_groups(work, "run2")} == {0, 1}  # both groups measured


def queue_groups(work: Path, run: str) -> list[tuple[int]]:
    with sqlite3.connect(work / "profile-queue.sqlite") as conn:
        return conn.execute("SELECT DISTINCT group_index FROM items WHERE run=?", (run,)).fetchall()


def _measure_while_peer_dies(rank: int, world_size: int, result_dir: str) -> str:
    import torch

    from kareus_fx.runtime.group_replay import EnergyModel, GroupComms, GroupMeasurer, GroupReplay, PeerLostError

    comms = GroupComms.create(tp=2, cp=1, timeout_s=PEER_TIMEOUT_S)
    replay = GroupReplay([s.ops for s in PTYPE.slots], [PTYPE.collective], comms, torch.device("cpu"))
    measurer = GroupMeasurer(comms, EnergyModel(40.0), torch.device("cpu"))
    measurer.measure(replay, 1410, 0, 16)  # both ranks: one good measurement
    if rank == 1:
        os._exit(1)  # dies before the next collective
    started = time.monotonic()
    try:
        measurer.measure(replay, 1410, 1, 16)
        outcome = {"error": None}
    except PeerLostError as err:
        outcome = {"error": "PeerLostError", "message": str(err)}
    outcome["wall_s"] = time.monotonic() - started
    Path(result_dir, "rank0.json").write_text(json.dumps(outcome))
    os._exit(0)


def test_a_peer_dying_mid_measurement_raises_a_typed_error_within_the_timeout(tmp_path):
    with pytest.raises(DistributedTestError):
        run_distributed(_measure_while_peer_dies, 2, str(tmp_path), timeout_s=90)
    deadline = time.monotonic() + PEER_TIMEOUT_S + 10
    while not (tmp_path / "rank0.json").exists():  # rank 0 reports after the harness saw rank 1 exit
        assert time.monotonic() < deadline, "rank 0 hangs after its peer died"
        time.sleep(0.1)
    outcome = json.loads((tmp_path / "rank0.json").read_text())
    assert outcome["error"] == "PeerLostError", outcome
    assert "rank 0 (profiling group 0, ranks [0, 1])" in outcome["message"]
    assert outcome["wall_s"] < PEER_TIMEOUT_S + 5


def test_measurement_keys_are_the_profile_database_keys():
    assert (
        measurement_key("cpu-replay", GPU, "abc", PartitionConfig(1410, 16, None))
        == f"cpu-replay|{GPU}|abc|1410|16|-1|mscclpp"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the NCCL group profiler needs a CUDA GPU")
def test_the_group_measurer_runs_on_one_gpu_over_nccl_with_an_sm_limited_communicator():
    """World of one GPU: the NCCL communicator limited to 8 CTAs, CUDA-event time, Zeus energy."""
    import datetime

    from kareus_fx.cost_models.hardware import gpu_spec
    from kareus_fx.runtime.group_replay import EnergyModel, GroupComms, GroupMeasurer, GroupReplay

    dist.init_process_group(
        "nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        comms = GroupComms.create(tp=1, cp=1, timeout_s=60.0, sm_counts=[8])
        assert (1, 8) in comms.by_sms
        spec = CollectiveSpec("all_reduce", 2**20, 1)
        device = torch.device("cuda", 0)
        replay = GroupReplay([s.ops for s in PTYPE.slots], [spec], comms, device)
        measurer = GroupMeasurer(comms, EnergyModel(gpu_spec(GPU).static_power_w, 0, min_window_s=1.0), device)
        m = measurer.measure(replay, 1410, 0, 8)
        assert m.time_s > 0 and m.energy_j > 0
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_kareus_plan_cpu_replay_on_four_processes_profiles_in_two_groups(tmp_path):
    """The acceptance command (about 4-5 minutes on 2 cores)."""
    import subprocess

    from kareus_fx.plan.plan_format import load_plan

    argv = [
        sys.executable,
        "-m",
        "kareus_fx.cli",
        "plan",
        "--model",
        "tiny-llama",
        "--tp",
        "2",
        "--mbs",
        "4",
        "--seq",
        "64",
        "--profiler",
        "cpu-replay",
        "--nproc",
        "4",
        "--out",
        str(tmp_path),
        "--json",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1200, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    profiling = json.loads(done.stdout.strip().splitlines()[-1])["profiling"]
    assert profiling["groups"] == 2 and profiling["duplicates"] == 0 and profiling["measurements"] > 0
    plan = load_plan(tmp_path / "plan.json")
    assert plan.data["profiler"] == "cpu-replay" and "test device" in plan.data["measurement"]
