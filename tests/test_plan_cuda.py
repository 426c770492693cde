"""``kareus plan --profiler cuda``: refused clearly without a GPU, and wired to the on-device profiler.

No test here changes a GPU clock: the controller is opened in dry-run, or its opening is
replaced by a recorder that returns a dry-run controller.
"""

from __future__ import annotations

import pytest
import torch

from kareus_fx import cli
from kareus_fx.capture.dump import load_dump
from kareus_fx.cost_models.hardware import canonical_gpu_name
from kareus_fx.errors import OptionsError
from kareus_fx.plan import profilers, stage_tracing
from kareus_fx.plan.planner import make_plan
from kareus_fx.plan.request import PlanRequest, validate_plan_request
from kareus_fx.runtime.clock_backends import ClockControlError
from kareus_fx.runtime.clock_controller import ClockController
from kareus_fx.runtime.device_profiler import DeviceProfiler, node_tables_from_dump
from kareus_fx.runtime.kernel_rebuild import build_kernel

TINY = {"model": "tiny-llama", "tp": 2, "cp": 1, "pp": 1, "microbatches": 1, "mbs": 2, "seq": 64, "layers": 2}
TINY_ARGV = ["--model", "tiny-llama", "--tp", "2", "--mbs", "2", "--seq", "64", "--layers", "2"]
MATMULS = ("aten.mm.default", "aten.bmm.default", "aten.addmm.default")


@pytest.fixture
def no_cuda(monkeypatch):
    """This machine as a CPU-only one, also where a GPU is present."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def fake_a100(monkeypatch):
    """A CUDA A100 as far as validation can tell; nothing here touches a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA A100-SXM4-40GB")


def test_cuda_without_gpu_is_refused_before_tracing(no_tracing, no_cuda, tmp_path):
    req = PlanRequest(**TINY, profiler="cuda")
    for call in (lambda: validate_plan_request(req), lambda: make_plan(req, tmp_path, progress=False)):
        with pytest.raises(OptionsError, match="needs a CUDA GPU") as err:
            call()
        assert "--profiler simulated" in str(err.value) and "GPU node" in str(err.value)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--profiler", "cuda"], "needs a CUDA GPU, but this machine has none"),
        (["--profiler", "cuda", "--clock-mode", "dry-run", "--workers", "2"], "use --workers 1"),
        (["--clock-mode", "dry-run"], "--clock-mode applies to --profiler cuda only"),
        (["--device-window", "10"], "--device-window applies to --profiler cuda only"),
        (["--profiler", "cuda", "--device-window", "0.5"], "--device-window must be at least 1 s"),
    ],
)
def test_cli_refuses_cuda_requests_it_cannot_run(no_tracing, no_cuda, tmp_path, capsys, extra, message):
    assert cli.main(["plan", *TINY_ARGV, *extra, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


def test_cuda_request_checks_workers_mode_and_card(fake_a100):
    with pytest.raises(OptionsError, match="--workers 1"):
        validate_plan_request(PlanRequest(**TINY, profiler="cuda", workers=4))
    with pytest.raises(OptionsError, match="--clock-mode must be one of real, dry-run"):
        validate_plan_request(PlanRequest(**TINY, profiler="cuda", clock_mode="simulated"))
    with pytest.raises(OptionsError, match="--gpu h100 is a H100, but this process's GPU is 'NVIDIA A100"):
        validate_plan_request(PlanRequest(**TINY, profiler="cuda", gpu="h100"))
    validate_plan_request(PlanRequest(**TINY, profiler="cuda", clock_mode="dry-run"))  # the card --gpu names


def test_cli_device_window_reaches_the_request(fake_a100):
    args = cli._parser().parse_args(
        ["plan", *TINY_ARGV, "--gpu", "a100", "--profiler", "cuda", "--device-window", "2.5"]
    )
    req = cli._plan_request(args)
    assert req.device_window_s == 2.5
    validate_plan_request(req)
    assert cli._plan_request(cli._parser().parse_args(["plan", *TINY_ARGV])).device_window_s == 5.0


@pytest.fixture(scope="module")
def tiny_traced(tmp_path_factory):
    """The tiny model traced as make_plan traces it: nanobatched and un-split dumps."""
    return stage_tracing.trace_stages(PlanRequest(**TINY), tmp_path_factory.mktemp("dumps"))


def _measured_work(stage):
    """(what, dump kind, graph, ops) of everything the planner measures for one traced stage."""
    for name, graph in stage.sequential.items():
        yield f"sequential {name}", "sequential", name, graph.ops
    for name, graph in stage.partitioned.items():
        yield f"outside {name}", "nanobatched", name, graph.outside.ops
        for ptype in graph.ptypes:
            yield f"type {ptype.type_id}", "nanobatched", name, [op for slot in ptype.slots for op in slot.ops]


def test_cuda_factory_builds_one_device_profiler_replaying_each_graph_from_its_dump(tiny_traced, tmp_path):
    (stage,) = tiny_traced
    assert stage.partitioned is not None
    req = PlanRequest(**TINY, profiler="cuda", clock_mode="dry-run")
    expected = {kind: node_tables_from_dump(load_dump(path)) for kind, path in stage.dump_paths.items()}
    with profilers.profiler_factory(req, tiny_traced, tmp_path / "profile.sqlite") as factory:
        cached = factory()
        device = cached.inner
        assert isinstance(device, DeviceProfiler) and factory().inner is device  # one GPU, one profiler
        assert cached.kind == "cuda-graph"  # the profile database key: CUDA-graph replays by default
        assert device.gpu_name == canonical_gpu_name(req.gpu)
        assert device.min_window_s == 5.0  # the default window
        controller = device.frequency
        assert controller.mode == "dry-run"
        work = list(_measured_work(stage))
        assert len(work) > 4
        for what, kind, name, ops in work:
            # the table of the dump the ops come from, even where node names repeat across dumps
            assert device._table(ops, name) == expected[kind][name], what
        # The same node name is in both dumps with different shapes (the nanobatch is half the batch).
        sequential_mm = next(op for op in stage.sequential["forward"].ops if op.target in MATMULS)
        assert (
            expected["sequential"]["forward"][sequential_mm.name]["shape"]
            != expected["nanobatched"]["forward"][sequential_mm.name]["shape"]
        )
        # The ops of a partition type replay (on CPU here) from the keyed table.
        ptype = stage.partitioned["forward"].ptypes[0]
        ops = [op for slot in ptype.slots for op in slot.ops]
        kernels = [build_kernel(op, "cpu", device._table(ops, ptype.graph)) for op in ops if op.target in MATMULS]
        assert kernels and all(k.source == "replay" for k in kernels)
    with pytest.raises(ClockControlError, match="closed"):  # leaving the block restored the clock
        controller.request(1200)
    cached.db.close()


def test_cuda_factory_opens_the_controller_in_the_requested_mode(tiny_traced, tmp_path, monkeypatch):
    opened: list[str] = []
    open_controller = ClockController.open

    def record(mode, **kwargs):
        opened.append(mode)
        return open_controller("dry-run", handle_sigterm=False)

    monkeypatch.setattr(profilers.ClockController, "open", record)
    for clock_mode, expected in ((None, "real"), ("real", "real"), ("dry-run", "dry-run")):
        req = PlanRequest(**TINY, profiler="cuda", clock_mode=clock_mode, device_window_s=0.5)
        with profilers.profiler_factory(req, tiny_traced, tmp_path / "profile.sqlite") as factory:
            assert factory.inner().min_window_s == 0.5
        assert opened[-1] == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_plan_measures_on_device_in_dry_run(tmp_path, cuda_gpu_name):
    """A whole plan measured on this GPU; dry-run: the card's clock is never changed.

    TP1, so the plan needs 12 measurements of at least the 1-s energy window (the planner's
    minimum): the TP2 tiny plan needs 379 (tuning 306), over 6 minutes of windows. The replay of
    a partition with its collective on the side stream is test_device_profiler's GPU test."""
    req = PlanRequest(
        **{**TINY, "tp": 1},
        gpu=cuda_gpu_name,
        profiler="cuda",
        clock_mode="dry-run",
        device_window_s=1.0,
        clock_stride_mhz=150,
    )
    data = make_plan(req, tmp_path, progress=False).data
    assert data["profiler"] == "cuda-graph" and data["simulated"] is False
    assert "measured on one GPU" in data["measurement"] and "dry-run" in data["measurement"]
    assert data["methods"]["kareus"]["frontier"]
    assert all(p["time_s"] > 0 and p["energy_j"] > 0 for p in data["iteration_frontier"])
