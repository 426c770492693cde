"""A plan made by `kareus plan --compile-unit block` deploys on per-block compiled transformer blocks.

The tiny-llama reference model (torchtitan-like: ``model.layers`` of identical decoder blocks)
with each block compiled on its own by :func:`kareus_fx.integrations.torchtitan.compile_blocks`,
torchtitan's way. The plan is made by the CLI (``kareus plan ... --compile-unit block``): its graphs
are one block's, so every block graph passes the deployment's fingerprint check; a microbatch of
another sequence length is refused naming the block unit. A :class:`StepContext` drives the
microbatches (each block runs once per layer, so counting calls cannot); the dry-run controller
receives exactly the plan's clock schedule, one request per instruction, in order. Reference:
the same model and weights, eager. fp32; tolerances: loss rtol 1e-5, gradients rtol 1e-4,
atol 1e-6 (nanobatched sums in another order).
"""

from __future__ import annotations

import json
import re
from unittest.mock import patch

import pytest
import torch
from dist_harness import run_distributed

from kareus_fx import cli
from kareus_fx.deploy.plan_checks import PlanMismatchError
from kareus_fx.deploy.plan_clocks import clock_schedule
from kareus_fx.plan.plan_format import load_plan

LAYERS, MICROBATCHES, MBS, SEQ = 2, 2, 2, 64
PLAN_ARGS = (
    f"--model tiny-llama --microbatches {MICROBATCHES} --mbs {MBS} --seq {SEQ} --layers {LAYERS} "
    "--dtype float32 --clock-stride 240 --compile-unit block"
)


def _plan(tmp_path, tp: int, dp: int) -> str:
    out = tmp_path / f"block-plan-tp{tp}-dp{dp}"
    assert cli.main(["plan", *PLAN_ARGS.split(), "--tp", str(tp), "--dp", str(dp), "--out", str(out)]) == 0
    return str(out / "plan.json")


def _train_on_blocks(rank: int, world_size: int, plan_path: str) -> dict:
    """Every microbatch's forward and backward on blocks compiled with the plan, against eager.

    The default group spans the plan's ``dp`` replicas of ``tp`` ranks: a (dp, tp) DeviceMesh
    gives this rank's TP group, and each replica trains on its own microbatches."""
    from torch.distributed.device_mesh import init_device_mesh

    from kareus_fx.deploy.deployment import prepare_collectives
    from kareus_fx.integrations.torchtitan import compile_blocks
    from kareus_fx.models import ParallelLayout, build_model
    from kareus_fx.runtime.clock_controller import ClockController
    from kareus_fx.runtime.step_context import StepContext

    plan = load_plan(plan_path)
    point = plan.point_index("max-throughput")
    tp, dp = plan.workload["tp"], plan.workload["dp"]
    assert world_size in (tp, tp * dp)
    layout, replica = ParallelLayout(), 0
    if world_size > 1:
        mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
        replica = mesh["dp"].get_local_rank()
        if tp > 1:
            tp_mesh = mesh["tp"]
            layout = ParallelLayout(tp=tp, tp_rank=tp_mesh.get_local_rank(), tp_group=tp_mesh.get_group())
            prepare_collectives(plan, "max-throughput", [layout.tp_group])  # one TP group per replica
    model, reference = (build_model("tiny-llama", layout, num_layers=LAYERS, dtype=torch.float32) for _ in range(2))
    for m in (model, reference):
        m.init_weights(seed=0)  # the same weights (and shards) in both
    controller = ClockController.open("dry-run")
    compile_blocks(model, {"plan": plan_path, "clock_controller": controller, "inductor": False})
    batches = [model.example_batch(mbs=MBS, seq=SEQ, seed=replica * MICROBATCHES + mb) for mb in range(MICROBATCHES)]
    losses = []
    with StepContext(clock_schedule(plan, point), controller, stage=0) as steps:
        for mb, batch in enumerate(batches):
            with steps.step("forward", mb):
                loss = model(**batch)
            with steps.step("backward", mb):
                loss.backward()
            losses.append(loss.detach())
    for batch, loss in zip(batches, losses):
        want = reference(**batch)
        want.backward()
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=0)
    for (name, p), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, want.grad, rtol=1e-4, atol=1e-6, msg=name)
    clocks = [r.clock_mhz for r in controller.requests]
    # outside a step the blocks cannot tell the microbatch (each runs once per layer): refused
    with pytest.raises(PlanMismatchError, match=r"per-block plan .* outside a pipeline step.*StepContext"):
        model(**batches[0])
    return {"clocks": clocks}


def _check(plan_path: str, results: list[dict]) -> None:
    plan = load_plan(plan_path)
    assert plan.compile_unit == "block" and plan.workload["compile_unit"] == "block"
    schedule = clock_schedule(plan, plan.point_index("max-throughput"))
    from kareus_fx.runtime.step_context import PipelineNode

    want = [
        schedule.clock_mhz(PipelineNode(0, instruction, mb))
        for mb in range(MICROBATCHES)
        for instruction in ("forward", "backward")
    ]
    for result in results:
        assert result["clocks"] == want


@pytest.fixture(scope="module")
def block_plan(tmp_path_factory) -> str:
    """The CLI's block plan at tp=1 for 2 data-parallel replicas."""
    return _plan(tmp_path_factory.mktemp("block-plan"), tp=1, dp=2)


def test_block_plan_from_the_cli_deploys_on_compiled_blocks(block_plan):
    """One process (one replica's group, TP 1): the blocks follow the plan (clocks in order,
    parity with eager)."""
    plan = json.loads(open(block_plan).read())
    assert plan["workload"]["stage_layers"] == [LAYERS]  # a stage priced as its LAYERS blocks
    _check(block_plan, [_train_on_blocks(0, 1, block_plan)])


@pytest.mark.slow  # 2 gloo ranks compiling on 2 cores: about 30 s; fast sibling above
def test_block_plan_deploys_on_a_group_spanning_its_replicas(block_plan):
    """2 gloo ranks = the plan's 2 replicas x TP 1 in one default group: each replica's blocks
    follow the same schedule on its own data."""
    _check(block_plan, run_distributed(_train_on_blocks, 2, block_plan, timeout_s=600))


@pytest.mark.slow  # planning TP2 (partition types to tune) and 4 gloo ranks on 2 cores: minutes
def test_dp2_tp2_block_plan_deploys_nanobatched_on_compiled_blocks(tmp_path):
    """4 gloo ranks, a (2 DP x 2 TP) mesh spanning the plan's replicas, TP groups from the mesh."""
    plan_path = _plan(tmp_path, tp=2, dp=2)
    plan = load_plan(plan_path)
    assert plan.data["partition_types"]  # the block graph splits and partitions at TP2
    _check(plan_path, run_distributed(_train_on_blocks, 4, plan_path, timeout_s=900))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_dp_plan_fits_one_replica_or_all_and_nothing_else(block_plan, world):
    """A --dp 2 plan of 1-process pipelines fits 1 process (one replica's group) or 2 (a group
    spanning the replicas); 3 is refused naming both counts and the --dp that would fit."""
    from kareus_fx.config import KareusOptions
    from kareus_fx.deploy.plan_checks import check_plan_fits

    plan = load_plan(block_plan)
    with (
        patch.object(torch.distributed, "is_initialized", return_value=True),
        patch.object(torch.distributed, "get_world_size", return_value=world),
    ):
        if world == 3:
            with pytest.raises(PlanMismatchError, match=r"replicas of it: 2\) but this job runs 3.*--dp 3"):
                check_plan_fits(plan, KareusOptions())
        else:
            check_plan_fits(plan, KareusOptions())


@pytest.mark.parametrize(
    ("unit", "message"),
    [
        ("block", r"its graph one transformer block compiled on its own \(--compile-unit block\)"),
        ("stage", r"torchtitan.*needs a plan made with `kareus plan --compile-unit block`"),
    ],
)
def test_a_graph_that_is_not_the_plans_is_refused_naming_the_compile_unit(block_plan, tmp_path, unit, message):
    """The per-graph fingerprint check still refuses a real mismatch (here a lone Linear), and
    the message says which compile unit the plan is for and what the other one needs."""
    data = json.loads(open(block_plan).read())
    data["workload"]["compile_unit"] = unit
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    compiled = torch.compile(torch.nn.Linear(8, 8), backend="kareus", options={"plan": str(path), "inductor": False})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=r"PlanMismatchError") as failed:
        compiled(torch.randn(2, 8, requires_grad=True))
    assert isinstance(failed.value.inner_exception, PlanMismatchError)
    assert re.search(message, str(failed.value.inner_exception)), failed.value.inner_exception


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("--recompute full", "does not support --recompute full"),
        ("--pp 2 --stage-layers balanced", "does not support --stage-layers balanced"),
        ("--profiler cpu-replay", "does not support --profiler cpu-replay"),
    ],
)
def test_block_unit_refuses_what_it_cannot_price_before_tracing(no_tracing, tmp_path, capsys, extra, message):
    argv = ["plan", *PLAN_ARGS.split(), *extra.split(), "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "--compile-unit stage" in err and "Traceback" not in err, err


def _pipelined_blocks(rank: int, world_size: int, plan_path: str) -> dict:
    """The block plan under Schedule1F1B (one stage): the engine's shape inference runs the blocks
    eagerly (no instruction), the stage announces each microbatch; parity with an eager
    PipelineStage running the same schedule."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from kareus_fx.deploy.pipelining import KareusPipelineStage, follow_plan, stage_loss
    from kareus_fx.integrations.torchtitan import compile_blocks
    from kareus_fx.models import build_model
    from kareus_fx.models.stage_module import StageModule
    from kareus_fx.runtime.clock_controller import ClockController

    cpu = torch.device("cpu")
    models = [build_model("tiny-llama", num_layers=LAYERS, dtype=torch.float32) for _ in range(2)]
    for m in models:
        m.init_weights(seed=0)
    parts = [models[0].example_batch(mbs=MBS, seq=SEQ, seed=mb) for mb in range(MICROBATCHES)]
    batch = {k: torch.cat([p[k] for p in parts]) for k in ("input_ids", "labels")}
    controller = ClockController.open("dry-run", handle_sigterm=False)
    compile_blocks(models[1], {"plan": plan_path, "clock_controller": controller, "inductor": False})
    runs = []
    for model, stage_cls in zip(models, (PipelineStage, KareusPipelineStage)):
        schedule = Schedule1F1B(stage_cls(StageModule(model), 0, 1, cpu), MICROBATCHES, loss_fn=stage_loss)
        losses: list[torch.Tensor] = []
        inputs = {"labels": batch["labels"], "target": batch["labels"], "losses": losses, "return_outputs": False}
        if stage_cls is KareusPipelineStage:
            with follow_plan(schedule, plan_path, "max-throughput", controller):
                schedule.step(batch["input_ids"], **inputs)
        else:
            schedule.step(batch["input_ids"], **inputs)
        runs.append((losses, {n: p.grad for n, p in model.named_parameters()}))
    (eager_losses, eager_grads), (losses, grads) = runs
    for loss, want in zip(losses, eager_losses, strict=True):
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    return {"clocks": [r.clock_mhz for r in controller.requests]}


@pytest.mark.slow  # a gloo rank and a compile: about 20 s; the StepContext sibling runs by default
def test_block_plan_under_a_pipelining_schedule(block_plan):
    _check(block_plan, run_distributed(_pipelined_blocks, 1, block_plan, timeout_s=600))
