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

import pytest
import torch
from dist_harness import run_distributed

from kareus_fx import cli
from kareus_fx.deploy.deployment import PlanMismatchError, clock_schedule
from kareus_fx.plan.plan_format import load_plan

LAYERS, MICROBATCHES, MBS, SEQ = 2, 2, 2, 64
PLAN_ARGS = (
    f"--model tiny-llama --microbatches {MICROBATCHES} --mbs {MBS} --seq {SEQ} --layers {LAYERS} "
    "--dtype float32 --clock-stride 240 --compile-unit block"
)


def _plan(tmp_path, tp: int) -> str:
    out = tmp_path / f"block-plan-tp{tp}"
    assert cli.main(["plan", *PLAN_ARGS.split(), "--tp", str(tp), "--out", str(out)]) == 0
    return str(out / "plan.json")


def _train_on_blocks(rank: int, world_size: int, plan_path: str) -> dict:
    """Every microbatch's forward and backward on blocks compiled with the plan, against eager."""
    from kareus_fx.integrations.torchtitan import compile_blocks
    from kareus_fx.models import ParallelLayout, build_model
    from kareus_fx.runtime.frequency import FrequencyController
    from kareus_fx.runtime.pipeline_hook import StepContext

    plan = load_plan(plan_path)
    point = plan.point_index("max-throughput")
    layout = ParallelLayout.from_default_group(tp=world_size) if world_size > 1 else ParallelLayout()
    model, reference = (build_model("tiny-llama", layout, num_layers=LAYERS, dtype=torch.float32) for _ in range(2))
    for m in (model, reference):
        m.init_weights(seed=0)  # the same weights (and shards) in both
    controller = FrequencyController.open("dry-run")
    compile_blocks(model, {"plan": plan_path, "clock_controller": controller, "inductor": False})
    batches = [model.example_batch(mbs=MBS, seq=SEQ, seed=mb) for mb in range(MICROBATCHES)]
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
    from kareus_fx.runtime.pipeline_hook import PipelineNode

    want = [
        schedule.clock_mhz(PipelineNode(0, instruction, mb))
        for mb in range(MICROBATCHES)
        for instruction in ("forward", "backward")
    ]
    for result in results:
        assert result["clocks"] == want


@pytest.fixture(scope="module")
def block_plan(tmp_path_factory) -> str:
    """The CLI's block plan at tp=1 (one process)."""
    return _plan(tmp_path_factory.mktemp("block-plan"), tp=1)


def test_block_plan_from_the_cli_deploys_on_compiled_blocks(block_plan):
    """One process (tp=1): the CLI's block plan on the blocks, clocks and parity."""
    plan = json.loads(open(block_plan).read())
    assert plan["workload"]["stage_layers"] == [LAYERS]  # a stage priced as its LAYERS blocks
    _check(block_plan, [_train_on_blocks(0, 1, block_plan)])


@pytest.mark.slow  # planning TP2 (partition types to tune) and 2 gloo ranks: about a minute
def test_tp2_block_plan_deploys_nanobatched_on_compiled_blocks(tmp_path):
    plan_path = _plan(tmp_path, tp=2)
    plan = load_plan(plan_path)
    assert plan.data["partition_types"]  # the block graph splits and partitions at TP2
    _check(plan_path, run_distributed(_train_on_blocks, 2, plan_path, timeout_s=600))


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
