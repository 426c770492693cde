"""An interleaved plan followed through ``ScheduleInterleaved1F1B`` on 4 gloo ranks, against eager.

tiny-llama with 4 layers, tp=2 x pp=2 with 2 model chunks per rank (4 global stages of one layer:
ranks 0-1 hold stages 0 and 2, ranks 2-3 stages 1 and 3; pipelines {0, 2} and {1, 3}), 4
microbatches of [2, 256] tokens, fp32. The plan is the real planner's (``kareus plan --pp 2
--virtual-stages 2``), deployed at its fastest point: each chunk is compiled with the kareus
backend for its global stage (``kareus_stage``) and ``follow_plan`` drives the clocks.

What can fail: the dry-run controller must receive the plan's clock of each (global stage,
instruction, microbatch) in the order ``ScheduleInterleaved1F1B`` runs them (the composer's
``interleaved_order``); the losses and every gradient must equal the same schedule over plain
``PipelineStage`` chunks of the eager modules (rtol=1e-5, atol=1e-6, as test_torch_pipelining).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_distributed

from kareus_fx.compose.pipeline_schedule import interleaved_order

WORKLOAD = {
    "model": "tiny-llama",
    "tp": 2,
    "cp": 1,
    "pp": 2,
    "virtual_stages": 2,
    "microbatches": 4,
    "mbs": 2,
    "seq": 256,
    "layers": 4,
}
NUM_STAGES = WORKLOAD["pp"] * WORKLOAD["virtual_stages"]
TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    from kareus_fx.plan.plan_format import write_plan
    from kareus_fx.plan.planner import make_plan
    from kareus_fx.plan.request import PlanRequest

    root = tmp_path_factory.mktemp("interleaved-plan")
    outcome = make_plan(PlanRequest(**WORKLOAD, clock_stride_mhz=120, dtype="float32"), root / "work", progress=False)
    return write_plan(root / "plan.json", outcome.data)


def _chunk(layout, stage):
    from kareus_fx.models import PipelineStage, build_model
    from kareus_fx.models.stage_module import StageModule

    torch.manual_seed(0)
    model = build_model(
        WORKLOAD["model"],
        layout,
        num_layers=WORKLOAD["layers"],
        dtype=torch.float32,
        stage=PipelineStage(stage, NUM_STAGES),
    )
    model.init_weights(seed=0)
    return StageModule(model)


def _step(schedule, chunks, batch, holds_first, holds_last):
    """One ``schedule.step``: the last stage's losses and every chunk's gradients."""
    for chunk in chunks.values():
        chunk.zero_grad(set_to_none=True)
    losses = []
    args = (batch["input_ids"],) if holds_first else ()
    kwargs = {"labels": batch["labels"], "target": batch["labels"], "losses": losses} if holds_last else {}
    schedule.step(*args, return_outputs=False, **kwargs)
    grads = {}
    for stage, chunk in chunks.items():
        chunk.model.finalize_grads()
        grads.update({f"{stage}.{n}": p.grad.detach().clone() for n, p in chunk.named_parameters()})
    return [loss.detach() for loss in losses], grads


def _worker(rank, world_size, plan_path):
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    from kareus_fx.deploy.deployment import prepare_collectives
    from kareus_fx.deploy.pipelining import follow_plan, kareus_stage, pipeline_group, stage_loss
    from kareus_fx.models import ParallelLayout
    from kareus_fx.runtime.clock_controller import ClockController

    torch._dynamo.reset()
    layout = ParallelLayout.from_default_group(tp=WORKLOAD["tp"], pp=WORKLOAD["pp"])
    group = pipeline_group(layout)
    pp_rank, cpu = layout.pp_rank, torch.device("cpu")
    my_stages = [pp_rank + chunk * WORKLOAD["pp"] for chunk in range(WORKLOAD["virtual_stages"])]
    chunks = {stage: _chunk(layout, stage) for stage in my_stages}
    holds_first, holds_last = 0 in chunks, NUM_STAGES - 1 in chunks
    # Each pipeline rank holds the first or the last stage here: that chunk's example batch has its inputs.
    source = chunks[0] if holds_first else chunks[NUM_STAGES - 1]
    parts = [
        source.model.example_batch(mbs=WORKLOAD["mbs"], seq=WORKLOAD["seq"], seed=mb)
        for mb in range(WORKLOAD["microbatches"])
    ]
    batch = {k: torch.cat([p[k] for p in parts]) for k in ("input_ids", "labels") if k in parts[0]}
    microbatches = WORKLOAD["microbatches"]

    eager = ScheduleInterleaved1F1B(
        [PipelineStage(chunks[s], s, NUM_STAGES, cpu, group=group) for s in my_stages], microbatches, loss_fn=stage_loss
    )
    eager_losses, eager_grads = _step(eager, chunks, batch, holds_first, holds_last)

    prepare_collectives(plan_path, "max-throughput", [layout.tp_group])
    kstages = [
        kareus_stage(chunks[s], s, NUM_STAGES, cpu, plan=plan_path, options={"inductor": False}, group=group)
        for s in my_stages
    ]
    schedule = ScheduleInterleaved1F1B(kstages, microbatches, loss_fn=stage_loss)
    controller = ClockController.open("dry-run", handle_sigterm=False)
    with follow_plan(schedule, plan_path, "max-throughput", controller):
        losses, grads = _step(schedule, chunks, batch, holds_first, holds_last)
    controller.close()
    assert len(losses) == len(eager_losses) == (microbatches if holds_last else 0)
    for loss, expected in zip(losses, eager_losses):
        torch.testing.assert_close(loss, expected, **TOL)
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")
    return {
        "pp_rank": pp_rank,
        "pipeline": dist.get_process_group_ranks(group),
        "requests": [(r.clock_mhz, r.instruction) for r in controller.requests],
    }


@pytest.mark.slow  # about 40 s with its plan on 2 cores; tests/test_interleaved.py is its fast sibling (schedule order)
def test_interleaved_run_follows_the_plan_and_matches_eager(plan_path):
    from kareus_fx.plan.plan_format import load_plan

    plan = load_plan(plan_path)
    results = run_distributed(_worker, 4, str(plan_path), timeout_s=900)
    for rank, result in enumerate(results):
        pp_rank = rank // 2
        assert result["pp_rank"] == pp_rank and result["pipeline"] == [rank % 2, rank % 2 + 2]
        order = interleaved_order(WORKLOAD["pp"], WORKLOAD["virtual_stages"], WORKLOAD["microbatches"], pp_rank)
        assert result["requests"] == [
            (int(plan.option(0, stage, inst, mb)["clock_mhz"]), f"{inst[0].upper()}{mb}@S{stage}")
            for stage, inst, mb in order
        ]
