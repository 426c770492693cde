"""Fixtures and helpers shared by several test modules."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

# Inductor's C++ code for this CPU, unvectorised: the kareus graphs run on GPUs through Triton, and
# no test checks Inductor's CPU vector code. Vectorised code generation (vector and tiling variants
# of every kernel) took 103 of the 272 profiled Inductor seconds of test_dynamic_shapes[automatic]
# (20 s unvectorised; Inductor in all 187 s), and the ISA probe (g++ builds of test programs) cost
# each compiling process 1.3 s (load 5) to 6.5 s (load 11). Set before torch's Inductor config is
# imported; gloo ranks inherit it (their forkserver starts from this process).
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

# Under pytest-xdist (``-n 2``) each worker keeps its own clock-lock directory: a controller's lock
# record is per GPU, and two workers' controllers on the same (simulated) GPU 0 are two processes.
if "PYTEST_XDIST_WORKER" in os.environ and "KAREUS_CLOCK_LOCK_DIR" not in os.environ:
    import tempfile

    os.environ["KAREUS_CLOCK_LOCK_DIR"] = tempfile.mkdtemp(
        prefix=f"kareus-clock-locks-{os.environ['PYTEST_XDIST_WORKER']}-"
    )

import pytest
import torch


@pytest.fixture
def no_tracing(monkeypatch):
    """Fail the test if the planner traces anything (input must be refused before)."""
    from kareus_fx.plan import stage_tracing

    def trace(*args, **kwargs):
        raise AssertionError("traced before validating the input")

    monkeypatch.setattr(stage_tracing, "trace_both_splits", trace)


@pytest.fixture
def cuda_gpu_name() -> str:
    """The GPU spec name of this machine's CUDA device 0 (skips where no spec matches)."""
    from kareus_fx.cost_models.hardware import gpu_name_for_device

    device = torch.cuda.get_device_name(0)
    name = gpu_name_for_device(device)
    if name is None:
        pytest.skip(f"no GPU spec for {device}")
    return name


def train_microbatches(model, fn, batches):
    """Forward and backward of ``fn`` (``model`` or its compiled form) on each batch in order;
    returns the detached losses and ``model``'s accumulated gradients."""
    model.zero_grad(set_to_none=True)
    losses = []
    for batch in batches:
        loss = fn(**batch)
        loss.backward()
        losses.append(loss.detach())
    return losses, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


# What the planner's tracer never reads (``trace_plan_stages`` traces from ``PlanRequest.trace_spec``,
# the stage split, ``full_trace``, ``profiler`` and ``gpu``): requests that differ only in these
# trace the same graphs; tuning and composing read them.
_NOT_TRACED = {"clock_stride_mhz": 0, "max_clock_only": False, "microbatches": 1}


@pytest.fixture(scope="session")
def session_traces():
    """Stage graphs the session's plan fixtures traced, by request less :data:`_NOT_TRACED`
    (filled and read through :func:`sharing_traces`)."""
    return {}


@contextlib.contextmanager
def sharing_traces(traces):
    """In the block the planner traces each request once per session: a request that traces the
    same graphs as one already traced (the same request but for :data:`_NOT_TRACED`) gets those
    graphs and its work directory holds no dumps; everything after the trace (tuning, composing,
    the plan file) runs for the request. Planner entry points (``make_plan``, ``kareus plan``)
    trace through ``planner.trace_plan_stages``."""
    from kareus_fx.plan import planner

    real = planner.trace_plan_stages

    def trace(req, dump_root, load=None):
        key = dataclasses.replace(req, **_NOT_TRACED)
        if key not in traces:
            traces[key] = real(req, dump_root, load)
        resolved, traced = traces[key]
        return dataclasses.replace(req, stage_layers=resolved.stage_layers), traced

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planner, "trace_plan_stages", trace)
        yield


SMALL_REAL_WORKLOAD = {
    "model": "tiny-llama",
    "tp": 2,
    "cp": 1,
    "pp": 2,
    "microbatches": 2,
    "mbs": 2,
    "seq": 1536,
    "layers": 2,
}
"""The workload of :func:`small_real_plan`."""


@pytest.fixture(scope="session")
def small_real_plan(tmp_path_factory, session_traces):
    """(plan.json path, planner work directory) of a real plan: tiny-llama TP2 PP2, 2 layers,
    2 microbatches of 2 x 1536 tokens, simulated GPU; planned once per session (about 12 s).
    The work directory holds the graph dumps the planner traced (``dumps/stage*-*/``); its traces
    serve the session's other plans of this workload (:func:`sharing_traces`), which request this
    fixture first so that the dumps are here."""
    from kareus_fx.plan.plan_format import write_plan
    from kareus_fx.plan.planner import make_plan
    from kareus_fx.plan.request import PlanRequest

    root = tmp_path_factory.mktemp("small-real-plan")
    request = PlanRequest(**SMALL_REAL_WORKLOAD, clock_stride_mhz=120)
    with sharing_traces(session_traces):
        outcome = make_plan(request, root / "work", progress=False)
    return write_plan(root / "plan.json", outcome.data), root / "work"


TINY_TP2_WORKLOAD = {
    "model": "tiny-llama",
    "tp": 2,
    "cp": 1,
    "pp": 1,
    "microbatches": 2,
    "mbs": 2,
    "seq": 256,
    "layers": 1,
}
"""The workload of :func:`tiny_tp2_plan_data`."""


@pytest.fixture(scope="session")
def tiny_tp2_plan_data(tmp_path_factory, session_traces):
    """The data of a real fp32 plan of :data:`TINY_TP2_WORKLOAD` (simulated GPU), planned once per
    session (about 15 s): the run-time switching tests give it frontiers of their own. Its traces
    serve the session's other plans of this workload (:func:`sharing_traces`)."""
    return _fp32_plan_data(TINY_TP2_WORKLOAD, tmp_path_factory.mktemp("tiny-tp2-plan"), session_traces)


TP2_PP2_WORKLOAD = {
    "model": "tiny-llama",
    "tp": 2,
    "cp": 1,
    "pp": 2,
    "microbatches": 3,
    "mbs": 2,
    "seq": 256,
    "layers": 2,
}
"""The workload of :func:`tp2_pp2_plan_data`."""


@pytest.fixture(scope="session")
def tp2_pp2_plan_data(tmp_path_factory, session_traces):
    """The data of a real fp32 plan of :data:`TP2_PP2_WORKLOAD` (simulated GPU), planned once per
    session for the pipeline deployment tests (each copies it before giving it options of its own)."""
    return _fp32_plan_data(TP2_PP2_WORKLOAD, tmp_path_factory.mktemp("tp2-pp2-plan"), session_traces)


def _fp32_plan_data(workload: dict, work_dir, session_traces) -> dict:
    """The data of a real fp32 plan of ``workload`` on the simulated GPU (clock stride 120 MHz),
    its traces shared with the session's other plans of that workload."""
    from kareus_fx.plan.planner import make_plan
    from kareus_fx.plan.request import PlanRequest

    request = PlanRequest(**workload, clock_stride_mhz=120, dtype="float32")
    with sharing_traces(session_traces):
        return make_plan(request, work_dir, progress=False).data


def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    """Whether process ``pid`` exits within ``timeout_s`` (polled every 10 ms)."""
    from kareus_fx.runtime.clock_locks import process_alive

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not process_alive(pid, None):
            return True
        time.sleep(0.01)
    return False
