"""Deploying a plan on a TP x PP job: 4 gloo processes, two TP groups, a real 1F1B pipeline.

The plan is made by the real planner for tiny-llama with tp=2, pp=2 (one decoder layer per
stage), 3 microbatches of [2, 256] tokens, fp32 (the parity dtype). Its options are replaced so
that, on both stages, microbatch 0 and 2 run the nanobatched graph with different per-type SM
counts and launch slots, and microbatch 1 runs the un-split graph (the Megatron-LM microbatch a
``sequential`` option prices). Ranks 0-1 run stage 0, ranks 2-3 stage 1; activations and their
gradients go point to point between rank r and r + 2, driven by a StepContext in 1F1B order.

What can fail: a communicator created inside a compile (each stage compiles at its own time) is
refused, not left to hang; losses and every gradient equal the same pipeline run eagerly
(fp32, rtol=1e-5, atol=1e-6: the nanobatch split sums each weight gradient from two halves); the
un-split microbatch runs the un-split graphs (no partitions, its planned clock) and the others
the scheduled ones; the scheduled collectives run on the prepared per-SM-count communicators of
their own stage's TP group; the dry-run controller receives the plan's clocks in 1F1B order.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from conftest import TP2_PP2_WORKLOAD
from dist_harness import run_distributed

from kareus_fx.plan.plan_format import instruction_key, write_plan

TOL = {"rtol": 1e-5, "atol": 1e-6}
WORKLOAD = TP2_PP2_WORKLOAD
UNSPLIT_MB = 1
CLOCKS_MHZ = (1200, 1020, 900)  # per microbatch; stage 1 runs 30 MHz lower


@pytest.fixture(scope="module")
def plan_data(tp2_pp2_plan_data):
    """conftest's session plan of WORKLOAD: this module, tests/test_torch_pipelining.py and
    tests/test_pipelining_switching.py (which import this fixture) plan it once per session."""
    return tp2_pp2_plan_data


def _configs(data, stage, graph, variant):
    """Per partition type of ``graph`` of ``stage``: launch slots and SM counts cycling with ``variant``."""
    configs = {}
    for i, tid in enumerate(sorted(set(data["stages"][stage]["graphs"][graph]["partition_types"].values()))):
        choices = [*range(len(data["partition_types"][tid]["slots"])), None]
        configs[tid] = {"comm_sms": 4 * (1 + (i + variant) % 3), "launch_slot": choices[(i + variant) % len(choices)]}
    return configs


def _pipeline_plan(data, path):
    """``data`` with every (stage, instruction, microbatch) on a new option (module docstring)."""
    data = copy.deepcopy(data)
    for stage in range(WORKLOAD["pp"]):
        for graph in ("forward", "backward"):
            key = instruction_key(stage, graph)
            options = data["microbatch_options"][key]
            chosen = []
            for mb, clock_mhz in enumerate(CLOCKS_MHZ):
                unsplit = mb == UNSPLIT_MB
                chosen.append(len(options))
                options.append(
                    {
                        **options[0],
                        "clock_mhz": clock_mhz - 30 * stage,
                        "sequential": unsplit,
                        "configs": None if unsplit else _configs(data, stage, graph, mb),
                    }
                )
            for point in data["iteration_frontier"]:
                point["choices"][key] = chosen
    write_plan(path, data)
    return data


def _run_1f1b(fn, model, stage, batches, layout):
    """One iteration of 1F1B of ``fn`` (``model`` or its compiled form) over ``batches``; returns
    the last stage's losses and every gradient."""
    from kareus_fx.compose.pipeline_schedule import one_f_one_b_order
    from kareus_fx.runtime.step_context import next_instruction

    rank, peer_offset = dist.get_rank(), layout.tp * layout.cp
    model.zero_grad(set_to_none=True)
    saved, sends, losses = {}, [], []
    for instruction, mb in one_f_one_b_order(WORKLOAD["pp"], WORKLOAD["microbatches"], stage):
        next_instruction(instruction, mb)
        batch = batches[mb]
        if instruction == "forward":
            if stage == 0:
                out = fn(input_ids=batch["input_ids"])
                sends.append(dist.isend(out.detach().contiguous(), dst=rank + peer_offset))
                saved[mb] = (None, out)
            else:
                hidden = torch.empty_like(batch["hidden"])
                dist.recv(hidden, src=rank - peer_offset)
                hidden.requires_grad_()
                loss = fn(hidden=hidden, labels=batch["labels"])
                losses.append(loss.detach())
                saved[mb] = (hidden, loss)
        else:
            hidden, out = saved.pop(mb)
            if stage == 0:
                grad = torch.empty_like(out)
                dist.recv(grad, src=rank + peer_offset)
                out.backward(grad)
            else:
                out.backward()
                sends.append(dist.isend(hidden.grad.contiguous(), dst=rank - peer_offset))
    for send in sends:
        send.wait()
    model.finalize_grads()
    return losses, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _pipeline_worker(rank, world_size, plan_path):
    from kareus_fx.deploy.deployment import prepare_collectives
    from kareus_fx.deploy.plan_clocks import clock_schedule
    from kareus_fx.deploy.variants import deployed_graphs
    from kareus_fx.models import ParallelLayout, build_model
    from kareus_fx.models.stage_layers import PipelineStage
    from kareus_fx.plan.plan_format import load_plan
    from kareus_fx.runtime.clock_controller import ClockController
    from kareus_fx.runtime.collectives import CollectiveBackendError, backends_for
    from kareus_fx.runtime.step_context import StepContext

    torch._dynamo.reset()
    layout = ParallelLayout.from_default_group(tp=WORKLOAD["tp"], pp=WORKLOAD["pp"])
    stage = layout.pp_rank
    torch.manual_seed(0)
    model = build_model(
        WORKLOAD["model"],
        layout,
        num_layers=WORKLOAD["layers"],
        dtype=torch.float32,
        stage=PipelineStage(stage, WORKLOAD["pp"]),
    )
    model.init_weights(seed=0)
    batches = [
        model.example_batch(mbs=WORKLOAD["mbs"], seq=WORKLOAD["seq"], seed=mb) for mb in range(WORKLOAD["microbatches"])
    ]
    plan = load_plan(plan_path)
    point = plan.point_index("max-throughput")

    # One TP group per stage: a communicator is collective over the world, so none is made lazily.
    try:
        backends_for(layout.tp_group).group_for(4)
        lazy_refusal = None
    except CollectiveBackendError as err:
        lazy_refusal = str(err)

    with StepContext(clock_schedule(plan, point), None, stage=stage):
        eager_losses, eager_grads = _run_1f1b(model, model, stage, batches, layout)
    sm_counts = prepare_collectives(plan, "max-throughput", [layout.tp_group])
    controller = ClockController.open("dry-run", handle_sigterm=False)
    compiled = torch.compile(
        model, backend="kareus", fullgraph=True, options={"plan": plan_path, "stage": stage, "inductor": False}
    )
    iterations = 2
    with StepContext(clock_schedule(plan, point), controller, stage=stage):
        runs = [_run_1f1b(compiled, model, stage, batches, layout) for _ in range(iterations)]
    controller.close()
    for losses, grads in runs:
        for loss, eager in zip(losses, eager_losses):
            torch.testing.assert_close(loss, eager, **TOL)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, eager_grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")
    del compiled
    tp_limits = backends_for(layout.tp_group).limits
    collective_groups = {
        str(n.args[-1])
        for g in deployed_graphs()
        for n in g.gm.graph.nodes
        if n.op == "call_function"
        and str(n.target).startswith("_c10d_functional.")
        and "wait" not in str(n.target)
        and n.meta.get("kareus_comm_sms") is not None
    }
    return {
        "stage": stage,
        "tp_ranks": dist.get_process_group_ranks(layout.tp_group),
        "lazy_refusal": lazy_refusal,
        "sm_counts": sorted(sm_counts),
        "limits": {count: (limit.group_name, limit.backend) for count, limit in tp_limits.items()},
        "collective_groups": sorted(collective_groups),
        "requests": [(r.clock_mhz, r.instruction) for r in controller.requests],
        "graphs": [
            (g.name, g.stage, list(g.microbatches), g.nanobatched, len(g.partitions)) for g in deployed_graphs()
        ],
        "losses": len(eager_losses),
    }


def test_tp2_pp2_pipeline_with_split_and_unsplit_microbatches_matches_eager(plan_data, tmp_path):
    from kareus_fx.compose.pipeline_schedule import one_f_one_b_order

    plan_path = tmp_path / "plan.json"
    data = _pipeline_plan(plan_data, plan_path)
    results = run_distributed(_pipeline_worker, 4, str(plan_path), timeout_s=900)
    planned_counts = sorted(
        {
            c["comm_sms"]
            for key, options in data["microbatch_options"].items()
            for o in options[-3:]
            for c in (o["configs"] or {}).values()
        }
    )
    for rank, result in enumerate(results):
        stage = rank // 2
        assert result["stage"] == stage and result["tp_ranks"] == [2 * stage, 2 * stage + 1]
        assert "must happen at startup" in result["lazy_refusal"] and "prepare_collectives" in result["lazy_refusal"]
        assert result["sm_counts"] == planned_counts
        # Every planned SM count got its own gloo communicator over this stage's TP group, and
        # the scheduled collectives run on those (never on the base TP group).
        assert sorted(result["limits"]) == planned_counts
        assert all(backend == "gloo" for _, backend in result["limits"].values())
        prepared = {name for name, _ in result["limits"].values()}
        assert len(prepared) == len(planned_counts)
        assert result["collective_groups"] and set(result["collective_groups"]) <= prepared
        # Microbatches 0 and 2 run nanobatched variants with partitions, 1 the un-split graphs.
        graphs = sorted(result["graphs"])
        assert [(name, mbs, nb) for name, _, mbs, nb, _ in graphs] == [
            ("backward", [0], True),
            ("backward", [1], False),
            ("backward", [2], True),
            ("forward", [0], True),
            ("forward", [1], False),
            ("forward", [2], True),
        ]
        assert all((count > 0) == nanobatched for _, _, _, nanobatched, count in graphs)
        assert {g[1] for g in graphs} == {stage}
        # The dry-run controller got the plan's clock of each instruction in 1F1B order.
        order = one_f_one_b_order(2, 3, stage) * 2
        assert result["requests"] == [
            (CLOCKS_MHZ[mb] - 30 * stage, f"{inst[0].upper()}{mb}@S{stage}") for inst, mb in order
        ]
        assert result["losses"] == (3 if stage == 1 else 0)


def test_forward_and_backward_split_differently_warn_and_follow_the_forward(plan_data, tmp_path):
    """Microbatch 2's backward option is sequential but its forward is split (and microbatch 1
    the other way round): the deployment warns once naming both; the backward follows its forward."""
    from kareus_fx.deploy.deployment import Deployment
    from kareus_fx.deploy.plan_checks import PlanDeviationWarning
    from kareus_fx.plan.plan_format import load_plan

    data = _pipeline_plan(plan_data, tmp_path / "plan.json")
    key = instruction_key(0, "backward")
    options, chosen = data["microbatch_options"][key], data["iteration_frontier"][0]["choices"][key]
    options[chosen[1]] = {**options[chosen[0]], "clock_mhz": CLOCKS_MHZ[1]}
    options[chosen[2]] = {**options[chosen[2]], "sequential": True, "configs": None}
    write_plan(tmp_path / "deviating.json", data)
    with pytest.warns(PlanDeviationWarning, match=r"microbatch\(es\) \[1, 2\] of stage 0") as caught:
        deployment = Deployment(plan=load_plan(tmp_path / "deviating.json"), point_index=0, stage=0, clock=None)
    assert len(caught) == 1
    assert deployment.unsplit == {UNSPLIT_MB}
