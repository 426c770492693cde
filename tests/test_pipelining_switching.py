"""Point switching under ``torch.distributed.pipelining``: PyTorch's ``Schedule1F1B``
runs the stages and a :class:`PointSwitcher` changes the frontier point between its ``step`` calls.

The plan's frontier gets four points (:data:`POINTS`), each with its own clock per (stage,
instruction, microbatch) and, in the compiled test, its own split per microbatch (un-split, or
nanobatched with per-type SM counts that differ by point). Every iteration runs another point
(:data:`ORDER`), decided collectively (the first rank's choice, broadcast).

- ``test_switching_under_schedule_1f1b_on_tp2_pp2`` (slow: 4 gloo ranks compile the tiny-llama
  stages with the kareus backend): the plan of ``test_deploy_pipeline.py`` (the real planner's,
  tp=2 x pp=2, 3 microbatches, fp32).
- ``test_switching_under_schedule_1f1b_fast`` (the default run's sibling): 2 gloo ranks, pp=2 x
  tp=1, un-compiled linear stages and the session's ``small_real_plan`` (2 microbatches); it checks
  the clock schedule and the collective switch, not variants.

What can fail: the dry-run controller does not get exactly the running point's clock of each
instruction in the schedule's own order (1F1B), in every iteration; a switch lands mid-iteration
or on one rank only; an iteration dispatches another point's variant (its collectives' SM counts,
or a split where the point runs un-split); anything is compiled after the first iteration; a
loss or gradient differs from the same schedule over plain ``PipelineStage`` on the eager module
(fp32, rtol=1e-5, atol=1e-6, as test_torch_pipelining).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_distributed
from test_deploy_pipeline import WORKLOAD, _configs, plan_data  # noqa: F401

from kareus_fx.compose.pipeline_schedule import one_f_one_b_order
from kareus_fx.plan.plan_format import instruction_key, write_plan

TOL = {"rtol": 1e-5, "atol": 1e-6}
POINTS = ((1.00, 1.30), (1.10, 1.18), (1.25, 1.08), (1.40, 1.02))
"""Per frontier point: (time, energy) relative to the planner's fastest point."""
CLOCKS_MHZ = (1410, 1290, 1170, 1050)
"""Per point; microbatch m runs 30 x m MHz lower, stage s 10 x s, a backward 60."""
ORDER = (0, 3, 1, 2, 3, 0)
"""The point of each iteration (every iteration switches)."""


def _clock_mhz(point: int, stage: int, graph: str, mb: int) -> int:
    return CLOCKS_MHZ[point] - 30 * mb - 10 * stage - (60 if graph == "backward" else 0)


def _unsplit(point: int, mb: int, microbatches: int) -> bool:
    """Point p runs microbatch p mod microbatches un-split (point 3 of 3 microbatches: microbatch 0)."""
    return mb == point % microbatches


def switching_pipeline_plan(data, path, *, splits: bool):
    """``data`` with the frontier of :data:`POINTS`; each point's options of its own (clocks, and
    with ``splits`` the split and per-type configs of each microbatch, module docstring)."""
    data = copy.deepcopy(data)
    base = min(data["iteration_frontier"], key=lambda p: p["time_s"])
    workload = data["workload"]
    frontier = [{"time_s": base["time_s"] * t, "energy_j": base["energy_j"] * e, "choices": {}} for t, e in POINTS]
    for stage in range(workload["pp"]):
        for graph in ("forward", "backward"):
            key = instruction_key(stage, graph)
            options = data["microbatch_options"][key]
            template = options[base["choices"][key][0]]
            for point in range(len(POINTS)):
                chosen = []
                for mb in range(workload["microbatches"]):
                    option = {**template, "clock_mhz": _clock_mhz(point, stage, graph, mb)}
                    if splits:
                        unsplit = _unsplit(point, mb, workload["microbatches"])
                        option["sequential"] = unsplit
                        option["configs"] = None if unsplit else _configs(data, stage, graph, point + mb)
                    chosen.append(len(options))
                    options.append(option)
                frontier[point]["choices"][key] = chosen
    data["iteration_frontier"] = frontier
    write_plan(path, data)
    return data


def _expected_requests(stage: int, microbatches: int) -> list[list[tuple[int, str]]]:
    """Per iteration of :data:`ORDER`: (clock, instruction) of each instruction in 1F1B order."""
    order = one_f_one_b_order(2, microbatches, stage)
    return [
        [(_clock_mhz(point, stage, inst, mb), f"{inst[0].upper()}{mb}@S{stage}") for inst, mb in order]
        for point in ORDER
    ]


# ----- the fast sibling: pp=2 x tp=1, un-compiled stages ------------------------------------------------
def _linear_stage_worker(rank, world_size, plan_path):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from kareus_fx.deploy.pipelining import KareusPipelineStage, follow_plan
    from kareus_fx.deploy.switching import PointSwitcher
    from kareus_fx.runtime.clock_controller import ClockController

    torch.manual_seed(0)
    modules = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(2)]
    module, cpu = modules[rank], torch.device("cpu")
    microbatches = 2
    inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    target = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))

    def loss_fn(output, target):
        return torch.nn.functional.mse_loss(output, target)

    def step(schedule):
        module.zero_grad(set_to_none=True)
        losses = []
        if rank == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=target, losses=losses)
        return [loss.detach() for loss in losses], [p.grad.detach().clone() for p in module.parameters()]

    eager = step(Schedule1F1B(PipelineStage(module, rank, 2, cpu), microbatches, loss_fn=loss_fn))
    switcher = PointSwitcher(plan_path, candidates=[0, 1, 2, 3])
    schedule = Schedule1F1B(KareusPipelineStage(module, rank, 2, cpu), microbatches, loss_fn=loss_fn)
    controller = ClockController.open("dry-run", handle_sigterm=False)
    iterations = []
    with follow_plan(schedule, plan_path, "max-throughput", controller):
        for iteration, point in enumerate(ORDER):
            if iteration:
                switcher.switch_to(point if rank == 0 else None)  # rank 0 decides; the broadcast tells rank 1
            before = len(controller.requests)
            losses, grads = step(schedule)
            for got, want in zip(losses + grads, eager[0] + eager[1], strict=True):
                torch.testing.assert_close(got, want, **TOL)
            iterations.append(
                {
                    "point": switcher.current_index,
                    "requests": [(r.clock_mhz, r.instruction) for r in controller.requests[before:]],
                }
            )
    controller.close()
    return {"iterations": iterations, "switches": [(s.iteration, s.from_index, s.to_index) for s in switcher.switches]}


def test_switching_under_schedule_1f1b_fast(small_real_plan, tmp_path):
    source, _ = small_real_plan
    from kareus_fx.plan.plan_format import load_plan

    plan_path = tmp_path / "plan.json"
    switching_pipeline_plan(load_plan(source).data, plan_path, splits=False)
    results = run_distributed(_linear_stage_worker, 2, str(plan_path), timeout_s=300)
    for stage, result in enumerate(results):
        expected = _expected_requests(stage, 2)
        assert [it["point"] for it in result["iterations"]] == list(ORDER)
        for iteration, got in enumerate(result["iterations"]):
            assert got["requests"] == expected[iteration], f"stage {stage}, iteration {iteration}"
        assert result["switches"] == [(i, ORDER[i - 1], ORDER[i]) for i in range(1, len(ORDER))]


# ----- the compiled test: tp=2 x pp=2, tiny-llama stages through the kareus backend ---------------------
def _compiled_worker(rank, world_size, plan_path):
    from test_torch_pipelining import _stage_module, _step
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from kareus_fx.deploy.hook_ops import recording_hooks
    from kareus_fx.deploy.pipelining import KareusPipelineStage, follow_plan, kareus_stage, pipeline_group, stage_loss
    from kareus_fx.deploy.switching import PointSwitcher
    from kareus_fx.deploy.variants import deployed_graphs
    from kareus_fx.models import ParallelLayout
    from kareus_fx.runtime.clock_controller import ClockController

    torch._dynamo.reset()
    layout = ParallelLayout.from_default_group(tp=WORKLOAD["tp"], pp=WORKLOAD["pp"])
    group = pipeline_group(layout)
    stage, num_stages, microbatches, cpu = layout.pp_rank, WORKLOAD["pp"], WORKLOAD["microbatches"], torch.device("cpu")
    _stage_module.layout = layout
    module = _stage_module(stage)
    parts = [
        module.model.example_batch(mbs=WORKLOAD["mbs"], seq=WORKLOAD["seq"], seed=mb) for mb in range(microbatches)
    ]
    batch = {k: torch.cat([p[k] for p in parts]) for k in ("input_ids", "labels") if k in parts[0]}
    eager_losses, eager_grads = _step(
        Schedule1F1B(PipelineStage(module, stage, num_stages, cpu, group=group), microbatches, loss_fn=stage_loss),
        module,
        stage,
        batch,
    )
    switcher = PointSwitcher(plan_path, candidates=[0, 1, 2, 3])  # the whole job is one pipeline (dp=1)
    switcher.prepare_collectives([layout.tp_group])
    compiled = kareus_stage(
        module, stage, num_stages, cpu, plan=plan_path, options={"inductor": False, "switching": switcher}, group=group
    ).submod
    schedule = Schedule1F1B(
        KareusPipelineStage(compiled, stage, num_stages, cpu, group=group), microbatches, loss_fn=stage_loss
    )
    controller = ClockController.open("dry-run", handle_sigterm=False)
    iterations, compiled_after_first = [], None
    with follow_plan(schedule, plan_path, "max-throughput", controller):
        for iteration, point in enumerate(ORDER):
            if iteration:
                switcher.switch_to(point if dist.get_rank() == 0 else None)
            before = len(controller.requests)
            with recording_hooks() as hooks:
                losses, grads = _step(schedule, module, stage, batch)
            for loss, eager in zip(losses, eager_losses, strict=True):
                torch.testing.assert_close(loss, eager, **TOL)
            for name, grad in grads.items():
                torch.testing.assert_close(grad, eager_grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")
            launched = []  # per graph run (each starts with its clock hook): the SM counts its collectives used
            for entry in hooks:
                if entry[0] == "clock_hook":
                    launched.append(set())
                elif entry[0] == "comm_launch" and launched:
                    launched[-1].add(entry[2])
            if iteration == 0:
                compiled_after_first = len(deployed_graphs())
            iterations.append(
                {
                    "point": switcher.current_index,
                    "requests": [(r.clock_mhz, r.instruction) for r in controller.requests[before:]],
                    "launched": [sorted(sms) for sms in launched],
                    "losses": len(losses),
                }
            )
    controller.close()
    return {
        "stage": stage,
        "iterations": iterations,
        "compiled_after_first": compiled_after_first,
        "compiled_at_end": len(deployed_graphs()),
        "switches": [(s.iteration, s.from_index, s.to_index) for s in switcher.switches],
    }


@pytest.mark.slow
def test_switching_under_schedule_1f1b_on_tp2_pp2(plan_data, tmp_path):  # noqa: F811
    plan_path = tmp_path / "plan.json"
    data = switching_pipeline_plan(plan_data, plan_path, splits=True)
    microbatches = WORKLOAD["microbatches"]
    results = run_distributed(_compiled_worker, 4, str(plan_path), timeout_s=900)
    for rank, result in enumerate(results):
        stage = rank // 2
        assert result["stage"] == stage
        expected = _expected_requests(stage, microbatches)
        order = one_f_one_b_order(2, microbatches, stage)
        for iteration, (point, got) in enumerate(zip(ORDER, result["iterations"], strict=True)):
            where = f"rank {rank}, iteration {iteration} (point {point})"
            assert got["point"] == point, where
            assert got["requests"] == expected[iteration], where
            planned = [
                sorted(
                    {c["comm_sms"] for c in _configs(data, stage, inst, point + mb).values()}
                    if not _unsplit(point, mb, microbatches)
                    else set()
                )
                for inst, mb in order
            ]
            assert got["launched"] == planned, where
            assert got["losses"] == (microbatches if stage == 1 else 0)
        assert result["compiled_at_end"] == result["compiled_after_first"]  # every candidate compiled up front
        assert result["switches"] == [(i, ORDER[i - 1], ORDER[i]) for i in range(1, len(ORDER))]
