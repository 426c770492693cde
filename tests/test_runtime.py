"""Runtime pieces on CPU: clock controller, pipeline hook, streams, collectives, energy monitor.

No test changes a GPU's clocks: real-mode tests use fake Zeus GPU objects.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_distributed
from zeus.device.gpu import ZeusGPUNoPermissionError

from kareus_fx.compose.pipeline_schedule import PipelineNode, one_f_one_b_order
from kareus_fx.errors import KareusError
from kareus_fx.runtime.clock_backends import (
    ClockControlError,
    ClockPermissionError,
    ClockRequestError,
    read_simulated_clock_state,
)
from kareus_fx.runtime.clock_controller import ClockController
from kareus_fx.runtime.collectives import CollectiveBackends, nccl_options_for
from kareus_fx.runtime.energy import (
    IterationEnergyMonitor,
    IterationMeasurement,
    compare_with_plan,
)
from kareus_fx.runtime.step_context import (
    ClockSchedule,
    ClockScheduleError,
    StepContext,
    current_clock_mhz,
    next_instruction,
)
from kareus_fx.runtime.streams import (
    CudaStreamTable,
    NullStreamTable,
    StreamTableError,
    make_stream_table,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def planned_clock_mhz(node: PipelineNode) -> int:
    """A distinct clock per instruction, so a wrong order cannot match by accident."""
    return 1000 + 100 * node.stage + 10 * node.microbatch + (5 if node.instruction == "backward" else 0)


def schedule_for(num_stages: int, num_microbatches: int) -> ClockSchedule:
    nodes = [
        PipelineNode(stage, instruction, mb)
        for stage in range(num_stages)
        for instruction, mb in one_f_one_b_order(num_stages, num_microbatches, stage)
    ]
    return ClockSchedule({node: planned_clock_mhz(node) for node in nodes})


# --- clock controller -------------------------------------------------------------------------


def test_dry_run_controller_receives_plan_clocks_in_1f1b_order():
    num_stages, num_microbatches, iterations = 3, 4, 3
    schedule = schedule_for(num_stages, num_microbatches)
    for stage in range(num_stages):
        order = one_f_one_b_order(num_stages, num_microbatches, stage)
        with ClockController.open("dry-run", handle_sigterm=False) as controller:
            with StepContext(schedule, controller, stage=stage) as steps:
                for _ in range(iterations):
                    for instruction, mb in order:
                        with steps.step(instruction, mb):
                            assert current_clock_mhz() == planned_clock_mhz(PipelineNode(stage, instruction, mb))
            controller.flush()
        expected_nodes = [PipelineNode(stage, inst, mb) for inst, mb in order] * iterations
        requests = controller.requests
        assert [r.clock_mhz for r in requests] == [planned_clock_mhz(n) for n in expected_nodes]
        assert [r.instruction for r in requests] == [str(n) for n in expected_nodes]
        assert all(a.time_s <= b.time_s for a, b in itertools.pairwise(requests))
        assert controller.applied_clock_mhz is None  # restored on leaving the with block


class BlockingBackend:
    """A clock backend whose switches block until the test releases them."""

    mode = "real"
    clock_range_mhz = None

    def __init__(self) -> None:
        self.switch_started = threading.Event()
        self.release = threading.Event()
        self.applied_mhz: list[int] = []
        self.resets = 0

    def set_clock(self, clock_mhz: int) -> None:
        self.switch_started.set()
        self.release.wait(timeout=60)
        self.applied_mhz.append(clock_mhz)

    def reset_clock(self) -> None:
        self.resets += 1


def test_request_returns_while_switch_blocks_and_coalesces_to_latest():
    backend = BlockingBackend()
    controller = ClockController(backend, handle_sigterm=False)
    controller.request(1000)
    assert backend.switch_started.wait(timeout=30)  # the worker is inside a blocked switch
    controller.request(1100)  # both return while the switch is still blocked
    controller.request(1200)
    assert backend.applied_mhz == []
    backend.release.set()
    controller.flush(timeout_s=30)
    assert backend.applied_mhz == [1000, 1200]  # 1100 was superseded before the worker got to it
    assert controller.applied_clock_mhz == 1200
    controller.close()
    assert backend.resets == 1 and controller.applied_clock_mhz is None
    with pytest.raises(ClockControlError, match="closed"):
        controller.request(1000)


class FailingBackend:
    mode = "real"
    clock_range_mhz = None

    def set_clock(self, clock_mhz: int) -> None:
        raise OSError("driver went away")

    def reset_clock(self) -> None:
        pass


def test_worker_failure_is_raised_in_the_caller():
    controller = ClockController(FailingBackend(), handle_sigterm=False)
    controller.request(1000)
    with pytest.raises(ClockControlError, match="driver went away"):
        controller.flush(timeout_s=30)
    controller.close()


def test_context_manager_restores_simulated_clock_on_exception(tmp_path):
    state_path = tmp_path / "clock.json"
    with pytest.raises(RuntimeError, match="training failed"):
        with ClockController.open(
            "simulated", default_clock_mhz=1980, state_path=state_path, handle_sigterm=False
        ) as controller:
            controller.request(1200)
            controller.flush(timeout_s=30)
            state = read_simulated_clock_state(state_path)
            assert (state.clock_mhz, state.locked) == (1200, True)
            raise RuntimeError("training failed")
    state = read_simulated_clock_state(state_path)
    assert (state.clock_mhz, state.locked) == (1980, False)


CHILD_TRAINING_LOOP = textwrap.dedent(
    """
    import sys, time
    from kareus_fx.runtime.clock_controller import ClockController

    state_path, steps = sys.argv[1], int(sys.argv[2])  # steps < 0: run until killed
    controller = ClockController.open("simulated", default_clock_mhz=1980, state_path=state_path)
    clocks_mhz = [1200, 1410, 1005]
    step = 0
    while step != steps:
        controller.request(clocks_mhz[step % 3], instruction=f"step {step}")
        controller.flush()
        step += 1
        time.sleep(0.01)
    # Ends without closing the controller: atexit restores the clock.
    """
)


def _start_child_training_loop(state_path: Path, steps: int) -> subprocess.Popen:
    python_path = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": python_path}
    return subprocess.Popen([sys.executable, "-c", CHILD_TRAINING_LOOP, str(state_path), str(steps)], env=env)


def test_sigterm_to_a_running_process_leaves_the_simulated_clock_restored(tmp_path):
    state_path = tmp_path / "clock.json"
    child = _start_child_training_loop(state_path, steps=-1)
    try:
        deadline = time.monotonic() + 60  # a guard against a hung child, not a timing assertion
        while not (state_path.exists() and read_simulated_clock_state(state_path).locked):
            assert child.poll() is None, "the child exited before locking a clock"
            assert time.monotonic() < deadline, "the child never locked a clock"
            time.sleep(0.05)
        child.send_signal(signal.SIGTERM)
        returncode = child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert returncode == -signal.SIGTERM  # terminated by the signal, as without the handler
    state = read_simulated_clock_state(state_path)
    assert (state.clock_mhz, state.locked, state.pid) == (1980, False, child.pid)


def test_normal_exit_without_close_restores_the_simulated_clock(tmp_path):
    state_path = tmp_path / "clock.json"
    child = _start_child_training_loop(state_path, steps=3)
    assert child.wait(timeout=120) == 0
    state = read_simulated_clock_state(state_path)
    assert (state.clock_mhz, state.locked, state.pid) == (1980, False, child.pid)


def test_sigterm_handler_restores_then_calls_the_previous_handler(tmp_path):
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        controller = ClockController.open("simulated", default_clock_mhz=1980, state_path=tmp_path / "clock.json")
        controller.request(1410)
        controller.flush(timeout_s=30)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not received and time.monotonic() < deadline:
            time.sleep(0.01)
        assert received == [signal.SIGTERM]
        assert read_simulated_clock_state(tmp_path / "clock.json").locked is False
        assert signal.getsignal(signal.SIGTERM) is not controller._on_sigterm  # uninstalled
    finally:
        signal.signal(signal.SIGTERM, previous)


class FakeZeusGPUs:
    """Stands in for ``zeus.device.get_gpus()``; records calls, or raises Zeus's permission error."""

    def __init__(self, permitted: bool) -> None:
        self.permitted = permitted
        self.calls: list[tuple] = []

    def __len__(self) -> int:
        return 1

    def get_supported_memory_clocks(self, gpu_index):
        return [1593]

    def get_supported_graphics_clocks(self, gpu_index, memory_clock_mhz=None):
        return [1980, 1410, 1005, 210]

    def set_gpu_locked_clocks(self, gpu_index, min_clock_mhz, max_clock_mhz, block=True):
        self._check()
        self.calls.append(("set", gpu_index, min_clock_mhz, max_clock_mhz))

    def reset_gpu_locked_clocks(self, gpu_index, block=True):
        self._check()
        self.calls.append(("reset", gpu_index))

    def _check(self) -> None:
        if not self.permitted:
            raise ZeusGPUNoPermissionError("Insufficient Permissions")


def test_missing_permission_names_the_fix():
    with pytest.raises(ClockPermissionError) as info:
        ClockController.open("real", zeus_gpus=FakeZeusGPUs(permitted=False), handle_sigterm=False)
    message = str(info.value)
    for fix in ("zeusd", "ZEUSD_SOCK_PATH", "SYS_ADMIN", "root", "fallback='dry-run'"):
        assert fix in message


def test_missing_permission_falls_back_to_dry_run_with_one_warning():
    with pytest.warns(RuntimeWarning, match="dry-run") as warnings_seen:
        controller = ClockController.open(
            "real", zeus_gpus=FakeZeusGPUs(permitted=False), fallback="dry-run", handle_sigterm=False
        )
    assert len(warnings_seen) == 1
    with controller:
        assert controller.mode == "dry-run"
        controller.request(1410, instruction="F0@S0")
    assert [(r.clock_mhz, r.instruction) for r in controller.requests] == [(1410, "F0@S0")]


def test_real_mode_locks_and_resets_through_zeus():
    gpus = FakeZeusGPUs(permitted=True)
    with ClockController.open("real", zeus_gpus=gpus, handle_sigterm=False) as controller:
        controller.request(1410)
        controller.flush(timeout_s=30)
        controller.request(1410)  # already applied: no second call
        controller.flush(timeout_s=30)
        with pytest.raises(ClockRequestError, match=r"outside the GPU's supported range 210..1980"):
            controller.request(2100)
    assert gpus.calls == [("reset", 0), ("set", 0, 1410, 1410), ("reset", 0)]


@pytest.mark.parametrize("bad", [0, -5, 1200.5, True, "1200"])
def test_bad_clock_requests_are_refused(bad):
    with ClockController.open("dry-run", handle_sigterm=False) as controller:
        with pytest.raises(ClockRequestError, match="positive integer"):
            controller.request(bad)


def test_simulated_mode_needs_a_default_clock():
    with pytest.raises(ClockRequestError, match="default_clock_mhz"):
        ClockController.open("simulated", handle_sigterm=False)


# --- pipeline hook ----------------------------------------------------------------------------


def test_schedule_without_an_instruction_says_what_it_covers():
    steps = StepContext(schedule_for(num_stages=2, num_microbatches=2), stage=0)
    with pytest.raises(ClockScheduleError, match=r"no clock for F5@S0.*microbatches \[0, 1\]"):
        steps.next_instruction("forward", 5)
    with pytest.raises(ClockScheduleError, match="instruction must be one of"):
        steps.next_instruction("recompute", 0)


def test_next_instruction_needs_one_active_context():
    with pytest.raises(KareusError, match="active StepContext"):
        next_instruction("forward", 0)
    schedule = schedule_for(num_stages=1, num_microbatches=1)
    with StepContext(schedule) as steps:
        with pytest.raises(KareusError, match="already active"):
            with StepContext(schedule):
                pass
        assert next_instruction("forward", 0) == PipelineNode(0, "forward", 0)
        assert steps.current_clock_mhz() == 1000
    assert current_clock_mhz() is None


def test_schedule_rejects_duplicate_and_invalid_entries():
    with pytest.raises(ClockScheduleError, match="twice"):
        ClockSchedule.from_entries([(0, "forward", 0, 1200), (0, "forward", 0, 1300)])
    with pytest.raises(ClockScheduleError, match="positive integer"):
        ClockSchedule.from_entries([(0, "forward", 0, 0)])


def _two_stage_pipeline(rank: int, world_size: int, num_microbatches: int, iterations: int):
    """Rank = pipeline stage; 1F1B with gloo isend/recv, driven by the module-level hook.

    Sends are asynchronous (as in real pipeline schedules): with blocking sends, stage 0's
    second warm-up forward and stage 1's first backward would each wait for the other.
    """
    torch.manual_seed(0)
    stage0, stage1 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    layer = stage0 if rank == 0 else stage1
    inputs = torch.randn(num_microbatches, 2, 4, generator=torch.Generator().manual_seed(1))
    schedule = schedule_for(world_size, num_microbatches)
    losses = []
    with ClockController.open("dry-run", handle_sigterm=False) as controller:
        with StepContext(schedule, controller, stage=rank):
            for _ in range(iterations):
                layer.zero_grad()
                saved, sends = {}, []
                for instruction, mb in one_f_one_b_order(world_size, num_microbatches, rank):
                    next_instruction(instruction, mb)
                    if instruction == "forward" and rank == 0:
                        saved[mb] = layer(inputs[mb])
                        sends.append(dist.isend(saved[mb].detach(), dst=1))
                    elif instruction == "forward":
                        activation = torch.empty(2, 4)
                        dist.recv(activation, src=0)
                        activation.requires_grad_()
                        saved[mb] = (activation, layer(activation).pow(2).mean())
                        losses.append(saved[mb][1].item())
                    elif rank == 1:
                        activation, loss = saved.pop(mb)
                        loss.backward()
                        sends.append(dist.isend(activation.grad, dst=0))
                    else:
                        grad = torch.empty(2, 4)
                        dist.recv(grad, src=1)
                        saved.pop(mb).backward(grad)
                for send in sends:
                    send.wait()
    return [(r.clock_mhz, r.instruction) for r in controller.requests], losses, layer.weight.grad


def test_two_stage_gloo_pipeline_requests_plan_clocks_in_1f1b_order():
    num_microbatches, iterations = 3, 2
    results = run_distributed(_two_stage_pipeline, 2, num_microbatches, iterations)
    for stage, (requests, _, _) in enumerate(results):
        nodes = [
            PipelineNode(stage, inst, mb) for inst, mb in one_f_one_b_order(2, num_microbatches, stage)
        ] * iterations
        assert requests == [(planned_clock_mhz(n), str(n)) for n in nodes]
    # The pipeline ran the real model: same losses and gradients as eager on one process.
    torch.manual_seed(0)
    stage0, stage1 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    inputs = torch.randn(num_microbatches, 2, 4, generator=torch.Generator().manual_seed(1))
    eager_losses = [stage1(stage0(x)).pow(2).mean() for x in inputs]
    sum(eager_losses).backward()
    assert results[1][1] == pytest.approx([loss.item() for loss in eager_losses] * iterations)
    torch.testing.assert_close(results[0][2], stage0.weight.grad)
    torch.testing.assert_close(results[1][2], stage1.weight.grad)


# --- streams ----------------------------------------------------------------------------------


def test_null_stream_table_checks_names_and_order():
    table = make_stream_table("cpu")
    assert isinstance(table, NullStreamTable)
    with table.use("comm"):
        table.record("all_reduce_3", "comm")
    table.wait("all_reduce_3", "compute")
    with pytest.raises(StreamTableError, match="never recorded"):
        table.wait(7, "comm")
    with pytest.raises(StreamTableError, match="unknown stream"):
        table.record(7, "copy")
    with pytest.raises(StreamTableError, match="partition id"):
        table.record(1.5, "comm")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_cuda_stream_table_refused_without_cuda():
    with pytest.raises(StreamTableError, match="CUDA is not available"):
        make_stream_table("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_stream_table_orders_comm_after_compute():
    table = make_stream_table()
    assert isinstance(table, CudaStreamTable)
    x = torch.randn(2048, 2048, device="cuda")
    with table.use("compute"):
        y = x @ x
    table.record(0, "compute")
    table.wait(0, "comm")
    with table.use("comm"):
        z = y * 2
    table.record("z", "comm")
    table.wait("z", "compute")
    torch.testing.assert_close(z, (x @ x) * 2)


# --- collectives ------------------------------------------------------------------------------


def _all_reduce_through_sm_groups(rank: int, world_size: int, sm_counts: list[int]):
    backends = CollectiveBackends()
    backends.prepare(sm_counts)
    assert backends.group_for(sm_counts[0]) is backends.group_for(sm_counts[0])
    sums = []
    for sm_count in sm_counts:
        value = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
        dist.all_reduce(value, group=backends.group_for(sm_count))
        functional = torch.ops._c10d_functional.all_reduce(
            torch.tensor([float(rank)]), "sum", backends.group_name_for(sm_count)
        )
        sums.append((value.tolist(), torch.ops._c10d_functional.wait_tensor(functional).tolist()))
    return sums, backends.limits


def test_gloo_collectives_through_sm_groups_give_the_right_sums():
    sm_counts = [4, 16]
    results = run_distributed(_all_reduce_through_sm_groups, 2, sm_counts)
    for sums, limits in results:
        assert sums == [([3.0, 30.0], [1.0])] * len(sm_counts)
        assert sorted(limits) == sm_counts
        for sm_count, limit in limits.items():
            assert (limit.sm_count, limit.backend, limit.enforced) == (sm_count, "gloo", False)
            assert limit.mscclpp_grid_size is None


def test_nccl_cta_option_names_exist_in_installed_torch():
    """The CPU wheel has no ProcessGroupNCCL; its type stub still names the fields we set."""
    if dist.is_nccl_available():
        options = nccl_options_for(16)
        assert (options.config.min_ctas, options.config.max_ctas) == (16, 16)
        return
    stub = Path(torch.__file__).parent / "_C" / "_distributed_c10d.pyi"
    nccl_config = stub.read_text().split("class NCCLConfig:")[1].split("class Options")[0]
    assert "min_ctas: int" in nccl_config and "max_ctas: int" in nccl_config


# --- energy monitor ---------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU report")
def test_energy_monitor_on_cpu_reports_time_and_no_energy():
    monitor = IterationEnergyMonitor()
    assert monitor.energy_available is False
    for _ in range(2):
        with monitor.iteration():
            torch.randn(64, 64) @ torch.randn(64, 64)
    assert [m.iteration for m in monitor.measurements] == [0, 1]
    assert all(m.time_s > 0 and m.energy_j is None for m in monitor.measurements)
    comparison = compare_with_plan(monitor.measurements, predicted_time_s=0.5, predicted_energy_j=100.0)
    assert comparison.energy_ratio is None and comparison.measured_energy_j is None
    assert comparison.time_ratio == pytest.approx(comparison.measured_time_s / 0.5)


class FakeZeusMonitor:
    """Stands in for ``ZeusMonitor`` on two GPUs with fixed readings."""

    gpu_indices: ClassVar[list[int]] = [0, 1]

    def __init__(self) -> None:
        self.open: set[str] = set()

    def begin_window(self, key: str) -> None:
        self.open.add(key)

    def end_window(self, key: str, cancel: bool = False):
        from zeus.monitor.energy import Measurement  # imports sklearn: slow, keep it out of ranks

        self.open.remove(key)
        return Measurement(time=0.4, gpu_energy={0: 50.0, 1: 70.0})


def test_energy_monitor_sums_gpus_and_compares_with_plan():
    zeus = FakeZeusMonitor()
    monitor = IterationEnergyMonitor(zeus_monitor=zeus)
    with pytest.raises(ZeroDivisionError):
        with monitor.iteration():
            raise ZeroDivisionError
    assert monitor.measurements == [] and zeus.open == set()  # the failed window was cancelled
    with monitor.iteration():
        pass
    assert monitor.measurements == [IterationMeasurement(iteration=0, time_s=0.4, energy_j=120.0)]
    comparison = compare_with_plan(monitor.measurements, predicted_time_s=0.5, predicted_energy_j=100.0)
    assert comparison.time_ratio == pytest.approx(0.8)
    assert comparison.energy_ratio == pytest.approx(1.2)


def _prepare_per_stage_groups(rank: int, world_size: int):
    """Two TP groups {0, 1} and {2, 3}: prepare twice (idempotent), all-reduce within each."""
    from kareus_fx.runtime.collectives import CollectiveBackendError, backends_for, prepare_comm_groups

    groups = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])]
    mine = groups[rank // 2]
    prepare_comm_groups([8, 4], [mine, None])
    names = {count: limit.group_name for count, limit in backends_for(mine).limits.items()}
    prepare_comm_groups([4, 8], [mine])
    again = {count: limit.group_name for count, limit in backends_for(mine).limits.items()}
    sums = []
    for count in (4, 8):
        out = torch.ops._c10d_functional.all_reduce(torch.tensor([float(rank)]), "sum", names[count])
        sums.append(torch.ops._c10d_functional.wait_tensor(out).item())
    try:
        prepare_comm_groups([4, 16] if rank == 3 else [4, 8], [mine])
        mismatch = None
    except CollectiveBackendError as err:
        mismatch = str(err)
    return names, again, sums, mine.group_name, mismatch


def test_prepare_comm_groups_over_several_tp_groups():
    results = run_distributed(_prepare_per_stage_groups, 4)
    for rank, (names, again, sums, base_name, mismatch) in enumerate(results):
        assert sorted(names) == [4, 8] and again == names and base_name not in names.values()
        assert sums == ([1.0, 1.0] if rank < 2 else [5.0, 5.0])
        assert "different SM counts on different ranks" in mismatch
