"""A plan followed through ``torch.distributed.pipelining``: the schedule's own calls drive it.

Same job and plan as ``test_deploy_pipeline.py``: tiny-llama, tp=2 x pp=2 on 4 gloo ranks (ranks
0-1 stage 0, 2-3 stage 1; pipelines {0, 2} and {1, 3}), 3 microbatches of [2, 256] tokens, fp32,
the real planner's plan with every (stage, instruction, microbatch) on its own option: distinct
clocks, per-type SM counts and launch slots, microbatch 1 un-split. Here PyTorch's
``Schedule1F1B`` / ``ScheduleGPipe`` run the stages (``KareusPipelineStage`` over the
kareus-compiled stage module) and no user code calls ``next_instruction``.

What can fail: the dry-run controller must receive the plan's clock of each instruction in the
schedule's own order, for 2 iterations; each instruction must run the variant the plan gives its
microbatch (the SM counts its collectives launch with; none for the un-split microbatch); losses
and every gradient must equal the same schedule over plain ``PipelineStage`` on the eager module
(fp32, rtol=1e-5, atol=1e-6 as test_deploy_pipeline: the nanobatch split sums each weight
gradient from two halves); schedules the plan cannot follow are refused with errors naming the fix.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from dist_harness import run_distributed
from test_deploy_pipeline import CLOCKS_MHZ, UNSPLIT_MB, WORKLOAD, _pipeline_plan, plan_data  # noqa: F401

from kareus_fx.compose.pipeline_schedule import one_f_one_b_order

TOL = {"rtol": 1e-5, "atol": 1e-6}
ITERATIONS = 2


def _stage_module(stage):
    from kareus_fx.models import PipelineStage, build_model
    from kareus_fx.models.stage_module import StageModule

    torch.manual_seed(0)
    model = build_model(
        WORKLOAD["model"],
        _stage_module.layout,
        num_layers=WORKLOAD["layers"],
        dtype=torch.float32,
        stage=PipelineStage(stage, WORKLOAD["pp"]),
    )
    model.init_weights(seed=0)
    return StageModule(model)


def _step(schedule, module, stage, batch):
    """One ``schedule.step`` of the whole batch; the last stage's losses and every gradient."""
    module.zero_grad(set_to_none=True)
    losses = []
    if stage == 0:
        schedule.step(batch["input_ids"])
    else:
        schedule.step(labels=batch["labels"], target=batch["labels"], losses=losses, return_outputs=False)
    module.model.finalize_grads()
    return [loss.detach() for loss in losses], {n: p.grad.detach().clone() for n, p in module.named_parameters()}


def _schedule_worker(rank, world_size, plan_path):
    """Per schedule: one eager step, then ``ITERATIONS`` steps of the kareus stages (one compile
    serves both schedules: the stage module is compiled once and wrapped per schedule)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from kareus_fx.deploy.deployment import prepare_collectives
    from kareus_fx.deploy.hook_ops import recording_hooks
    from kareus_fx.deploy.pipelining import KareusPipelineStage, follow_plan, kareus_stage, pipeline_group, stage_loss
    from kareus_fx.deploy.plan_checks import PlanDeviationWarning
    from kareus_fx.models import ParallelLayout
    from kareus_fx.runtime.clock_controller import ClockController

    torch._dynamo.reset()
    layout = ParallelLayout.from_default_group(tp=WORKLOAD["tp"], pp=WORKLOAD["pp"])
    group = pipeline_group(layout)
    stage, num_stages = layout.pp_rank, WORKLOAD["pp"]
    _stage_module.layout = layout
    module = _stage_module(stage)
    parts = [
        module.model.example_batch(mbs=WORKLOAD["mbs"], seq=WORKLOAD["seq"], seed=mb)
        for mb in range(WORKLOAD["microbatches"])
    ]
    batch = {k: torch.cat([p[k] for p in parts]) for k in ("input_ids", "labels") if k in parts[0]}
    microbatches, cpu = WORKLOAD["microbatches"], torch.device("cpu")
    prepare_collectives(plan_path, "max-throughput", [layout.tp_group])
    compiled = kareus_stage(
        module, stage, num_stages, cpu, plan=plan_path, options={"inductor": False}, group=group
    ).submod
    results = {"stage": stage, "pipeline": dist.get_process_group_ranks(group)}
    for name, schedule_cls in (("1f1b", Schedule1F1B), ("gpipe", ScheduleGPipe)):
        eager_stage = PipelineStage(module, stage, num_stages, cpu, group=group)
        eager_losses, eager_grads = _step(
            schedule_cls(eager_stage, microbatches, loss_fn=stage_loss), module, stage, batch
        )
        kstage = KareusPipelineStage(compiled, stage, num_stages, cpu, group=group)
        schedule = schedule_cls(kstage, microbatches, loss_fn=stage_loss)
        controller = ClockController.open("dry-run", handle_sigterm=False)
        with warnings.catch_warnings(record=True) as caught, recording_hooks() as hooks:
            warnings.simplefilter("always", PlanDeviationWarning)
            with follow_plan(schedule, plan_path, "max-throughput", controller):
                runs = [_step(schedule, module, stage, batch) for _ in range(ITERATIONS)]
        controller.close()
        for losses, grads in runs:
            assert len(losses) == len(eager_losses)
            for loss, eager in zip(losses, eager_losses):
                torch.testing.assert_close(loss, eager, **TOL)
            for param, grad in grads.items():
                torch.testing.assert_close(
                    grad, eager_grads[param], **TOL, msg=lambda m, param=param, name=name: f"{name} {param}: {m}"
                )
        # Per graph run (each starts with its clock hook): the SM counts its collectives launched with.
        launched = []
        for entry in hooks:
            if entry[0] == "clock_hook":
                launched.append((entry[2], set()))
            elif entry[0] == "comm_launch" and launched:
                launched[-1][1].add(entry[2])
        results[name] = {
            "requests": [(r.clock_mhz, r.instruction) for r in controller.requests],
            "launched": [(inst, sorted(sms)) for inst, sms in launched],
            "losses": len(eager_losses),
            "deviation_warnings": [str(w.message) for w in caught if issubclass(w.category, PlanDeviationWarning)],
        }
    return results


def _planned_sms(data, stage, instruction, mb):
    from kareus_fx.plan.plan_format import Plan

    option = Plan(data).option(0, stage, instruction, mb)
    return sorted({c["comm_sms"] for c in (option["configs"] or {}).values()})


def test_schedule_1f1b_and_gpipe_follow_the_plan_and_match_eager(plan_data, tmp_path):  # noqa: F811
    plan_path = tmp_path / "plan.json"
    data = _pipeline_plan(plan_data, plan_path)
    results = run_distributed(_schedule_worker, 4, str(plan_path), timeout_s=900)
    for rank, result in enumerate(results):
        stage = rank // 2
        assert result["stage"] == stage and result["pipeline"] == [rank % 2, rank % 2 + 2]
        orders = {
            "1f1b": one_f_one_b_order(2, 3, stage),
            "gpipe": [("forward", mb) for mb in range(3)] + [("backward", mb) for mb in range(3)],
        }
        for name, one_iteration in orders.items():
            run = result[name]
            if name == "1f1b":
                assert run["deviation_warnings"] == []
            else:
                (warning,) = run["deviation_warnings"]
                assert "ScheduleGPipe" in warning and "composed for Schedule1F1B" in warning
            order = one_iteration * ITERATIONS
            assert run["requests"] == [
                (CLOCKS_MHZ[mb] - 30 * stage, f"{inst[0].upper()}{mb}@S{stage}") for inst, mb in order
            ], name
            assert run["launched"] == [(inst, _planned_sms(data, stage, inst, mb)) for inst, mb in order], name
            assert [sms == [] for _, sms in run["launched"]] == [mb == UNSPLIT_MB for _, mb in order]
            assert run["losses"] == (3 if stage == 1 else 0)


def _refusals_worker(rank, world_size, plan_path):
    """One rank, a plain module: what follow_plan refuses before any step runs."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    from kareus_fx.deploy.pipelining import KareusPipelineStage, follow_plan, stage_loss

    cpu = torch.device("cpu")

    def stages(cls, count, num_stages):
        return [cls(torch.nn.Linear(4, 4), i, num_stages, cpu) for i in range(count)]

    cases = {
        "interleaved": ScheduleInterleaved1F1B(stages(KareusPipelineStage, 2, 2), 3, loss_fn=stage_loss),
        "zero_bubble": ScheduleZBVZeroBubble(stages(KareusPipelineStage, 2, 2), 3, loss_fn=stage_loss),
        "plain_stage": Schedule1F1B(stages(PipelineStage, 1, 2)[0], 3, loss_fn=stage_loss),
        "microbatches": Schedule1F1B(stages(KareusPipelineStage, 1, 2)[0], 4, loss_fn=stage_loss),
    }
    messages = {}
    for name, schedule in cases.items():
        try:
            with follow_plan(schedule, plan_path):
                pass
        except Exception as err:  # noqa: BLE001 - returned for the parent's assertions
            messages[name] = f"{type(err).__name__}: {err}"
    # A stage run outside follow_plan says how to wrap the step.
    lone = KareusPipelineStage(torch.nn.Linear(4, 4), 0, 1, cpu)
    try:
        Schedule1F1B(lone, 2, loss_fn=lambda out, target: out.sum()).step(torch.randn(4, 4), target=torch.zeros(4))
    except Exception as err:  # noqa: BLE001
        messages["outside"] = f"{type(err).__name__}: {err}"
    return messages


def test_schedules_the_plan_cannot_follow_are_refused(plan_data, tmp_path):  # noqa: F811
    plan_path = tmp_path / "plan.json"
    _pipeline_plan(plan_data, plan_path)
    (messages,) = run_distributed(_refusals_worker, 1, str(plan_path), timeout_s=300)
    assert messages["interleaved"].startswith("PlanMismatchError: ScheduleInterleaved1F1B runs 2 pipeline stages, 2 on")
    assert "pp=2 x virtual_stages=1" in messages["interleaved"]
    assert messages["zero_bubble"].startswith("UnsupportedScheduleError: ScheduleZBVZeroBubble splits backwards")
    assert "plain PipelineStage" in messages["plain_stage"] and "kareus_stage(" in messages["plain_stage"]
    assert "runs 4 microbatches per step but the plan" in messages["microbatches"]
    assert "n_microbatches=3" in messages["microbatches"]
    assert messages["outside"].startswith("KareusError: KareusPipelineStage 0 ran the forward of microbatch 0")
    assert "follow_plan(" in messages["outside"]
