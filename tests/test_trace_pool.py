"""Independent traces at once (``kareus_fx/capture/trace_pool.py``): results in the calls' order,
a worker's error raised here as the same type and message, a dead worker a typed error (no hang),
and the planner's traces, run in two processes, giving the serial run's dumps and plan.

The error test runs with either start method (``fork``, ``spawn``), the others with the one
chosen here (``fork``). In the pool tests the parent's call (the last: this process takes calls from the back) waits until
the worker has run the first, so the first call is the worker's whatever the machine's load.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from kareus_fx.capture import trace_pool
from kareus_fx.capture.trace_pool import TraceWorkerError, run_calls
from kareus_fx.errors import UnsupportedGraphError
from kareus_fx.plan import planner, stage_tracing
from kareus_fx.plan.request import PlanRequest

WORKER_START_LIMIT_S = 120.0
"""How long the parent's call waits for the worker's (a spawned worker starts in seconds)."""


def _mark_pid(marker: Path) -> int:
    marker.write_text(str(os.getpid()))
    return os.getpid()


def _raise_unsupported(marker: Path) -> None:
    _mark_pid(marker)
    raise UnsupportedGraphError("stage 3 of toy traced into 2 graphs; the planner needs one graph per stage")


def _exit_hard(marker: Path) -> None:
    _mark_pid(marker)
    os._exit(3)


def _after(*markers: Path) -> int:
    """This process's id, once every marker exists (the workers have run their calls)."""
    deadline_s = time.monotonic() + WORKER_START_LIMIT_S
    while not all(marker.exists() for marker in markers):
        assert time.monotonic() < deadline_s, "the worker never ran the first call"
        time.sleep(0.05)
    return os.getpid()


def _warn_fallback(marker: Path) -> int:
    warnings.warn("kareus: the split pass cannot prove stage 0 safe; it runs un-split", UserWarning, stacklevel=1)
    return _mark_pid(marker)


@pytest.fixture(params=["fork", "spawn"])
def start_method(request, monkeypatch) -> str:
    """Each start method :func:`trace_pool.start_method` may choose."""
    monkeypatch.setattr(trace_pool, "start_method", lambda: request.param)
    return request.param


def _fresh_process_prints(probe: str) -> list[str]:
    """The words ``probe`` prints, run in a fresh Python process."""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    return result.stdout.split()


def test_fork_only_where_this_is_the_only_thread():
    """In a fresh process (as ``kareus plan`` traces), fork; once another thread runs, spawn."""
    probe = (
        "import threading\n"
        "from kareus_fx.capture.trace_pool import start_method\n"
        "alone = start_method()\n"
        "release = threading.Event()\n"
        "threading.Thread(target=release.wait).start()\n"
        "print(alone, start_method())\n"
        "release.set()\n"
    )
    assert _fresh_process_prints(probe) == ["fork", "spawn"]


def test_this_processs_own_traces_leave_no_thread_that_stops_a_later_fork():
    """torch.fx's interpreter opens a tqdm bar on every run, and tqdm's monitor thread outlived it:
    after a first pool had traced here, every later pool spawned. With the pool's tqdm switch the
    process stays single-threaded (without it: 2 threads and ``spawn``)."""
    probe = (
        "import threading, torch, torch.fx\n"
        "from kareus_fx.capture.trace_pool import run_calls, start_method\n"
        "run_calls([], 1)\n"
        "torch.fx.Interpreter(torch.fx.symbolic_trace(torch.nn.Linear(2, 2))).run(torch.ones(1, 2))\n"
        "print(threading.active_count(), start_method())\n"
    )
    assert _fresh_process_prints(probe) == ["1", "fork"]


def test_results_come_back_in_the_calls_order(tmp_path):
    marker = tmp_path / "worker-ran"
    calls = [functools.partial(_mark_pid, marker), functools.partial(_after, marker)]
    worker_pid, parent_pid = run_calls(calls, processes=2)
    assert parent_pid == os.getpid() != worker_pid
    assert run_calls([functools.partial(pow, 2, k) for k in range(4)], processes=1) == [1, 2, 4, 8]


def test_a_workers_error_is_raised_here_with_its_type_and_message(tmp_path, start_method):
    marker = tmp_path / "worker-ran"
    calls = [functools.partial(_raise_unsupported, marker), functools.partial(_after, marker)]
    with pytest.raises(UnsupportedGraphError) as raised:
        run_calls(calls, processes=2)
    assert str(raised.value) == "stage 3 of toy traced into 2 graphs; the planner needs one graph per stage"
    assert int(marker.read_text()) != os.getpid()


def test_a_workers_warnings_are_issued_here_once(tmp_path, start_method):
    """Two workers issue the same warning: it is issued here, once, with its category and text."""
    markers = [tmp_path / "worker-0-ran", tmp_path / "worker-1-ran"]
    calls = [
        functools.partial(_warn_fallback, markers[0]),
        functools.partial(_warn_fallback, markers[1]),
        functools.partial(_after, *markers),
    ]
    with warnings.catch_warnings(record=True) as issued:
        warnings.simplefilter("default")
        *worker_pids, parent_pid = run_calls(calls, processes=3)
    assert os.getpid() == parent_pid not in worker_pids
    assert [(w.category, str(w.message)) for w in issued] == [
        (UserWarning, "kareus: the split pass cannot prove stage 0 safe; it runs un-split")
    ]
    assert issued[0].filename == __file__


def test_a_dead_worker_is_a_typed_error_not_a_hang(tmp_path):
    marker = tmp_path / "worker-ran"
    calls = [functools.partial(_exit_hard, marker), functools.partial(_after, marker)]
    with pytest.raises(TraceWorkerError, match=r"running _exit_hard\(.*\) exited before returning"):
        run_calls(calls, processes=2)


def _dump_contents(root: Path) -> dict[str, dict]:
    """Every dump under ``root`` by its directory (or file) relative to ``root``, without the
    backend's ``graph_id`` (a per-process counter of compiled graphs; it names the file too)."""
    contents = {}
    for path in sorted(root.rglob("*.json")):
        key = str(path.parent.relative_to(root)) if path.name.startswith("kareus_graph_") else path.name
        contents[key] = {k: v for k, v in json.loads(path.read_text()).items() if k != "graph_id"}
    return contents


def _trace_serially_and_in_parallel(req: PlanRequest, root: Path, monkeypatch) -> dict[int, list]:
    """``req``'s traced stages with the planner's traces in one process and in two, by process
    count; the dumps go under ``root / p<count> / dumps``."""
    traced = {}
    for processes in (1, 2):
        monkeypatch.setattr(stage_tracing, "parallel_processes", lambda tasks, n=processes: min(n, tasks))
        traced[processes] = stage_tracing.trace_stages(req, root / f"p{processes}" / "dumps")
    return traced


# About 30 s on 2 cores (each stage traced twice). Fast coverage: the pool's tests above, and every
# PP2 plan of the default run traces its stages in 2 processes (parallel_processes: one per core)
# and is checked downstream (tests/test_plan.py's report, tests/test_deploy_pipeline.py's parity).
@pytest.mark.slow
def test_parallel_stage_traces_give_the_serial_dumps(tmp_path, monkeypatch):
    """The two stages of a PP2 tiny-llama of 2 layers (one each, traced in full), traced in one
    process and in two: the same dumps (but the graph counter). The slow test below traces slices."""
    req = PlanRequest(model="tiny-llama", tp=2, cp=1, pp=2, microbatches=2, mbs=2, seq=512, layers=2)
    _trace_serially_and_in_parallel(req, tmp_path, monkeypatch)
    serial, parallel = (_dump_contents(tmp_path / f"p{p}" / "dumps") for p in (1, 2))
    assert sorted(serial) == [f"stage{s}-{kind}" for s in (0, 1) for kind in ("nanobatched", "sequential")]
    assert serial == parallel


@pytest.mark.slow
def test_parallel_traces_give_the_serial_plan(tmp_path, monkeypatch):
    """A PP2 tiny-llama whose stages (6 layers each) are traced as slices: 4 traces, run in one
    process and in two. Dumps equal (but the graph counter); the plan's stages, partition types,
    microbatch options and frontiers equal exactly."""
    req = PlanRequest(
        model="tiny-llama", tp=2, cp=1, pp=2, microbatches=2, mbs=2, seq=512, layers=12, clock_stride_mhz=240
    )
    traced = _trace_serially_and_in_parallel(req, tmp_path, monkeypatch)
    serial, parallel = (_dump_contents(tmp_path / f"p{p}" / "dumps") for p in (1, 2))
    assert len(serial) == 12  # 2 stages x (2 slices x 2 splits + 1 extended dump per split)
    assert serial == parallel
    plans = {p: planner.plan_traced(req, traced[p], tmp_path / f"p{p}", progress=False) for p in (1, 2)}
    for key in ("stages", "partition_types", "microbatch_options", "iteration_frontier", "methods"):
        assert plans[1].data[key] == plans[2].data[key], key
