"""The checks that refuse a plan made for another job: GPU, world size and stage at load time;
recompute at the Dynamo graph; rank layout and graph fingerprint per aten graph.

Each raises :class:`PlanMismatchError` saying what differs and how to re-plan; the order in which
a deployment runs them is in :mod:`kareus_fx.deploy.deployment`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from kareus_fx.capture.dump import graph_record
from kareus_fx.config import KareusOptions
from kareus_fx.cost_models.hardware import DEFAULT_GPU
from kareus_fx.deploy.plan_clocks import plan_num_stages
from kareus_fx.errors import KareusError
from kareus_fx.models.recompute import checkpoint_regions
from kareus_fx.passes.analysis import META_KEY
from kareus_fx.passes.partitions import GraphPartitioning
from kareus_fx.plan.graph_workload import graph_fingerprint
from kareus_fx.plan.plan_format import Plan

__all__ = [
    "PlanDeviationWarning",
    "PlanMismatchError",
    "check_fingerprint",
    "check_layout",
    "check_plan_fits",
    "check_plan_recompute",
]


class PlanMismatchError(KareusError, ValueError):
    """A valid plan made for another graph, world size, rank layout, GPU or pipeline stage."""


class PlanDeviationWarning(UserWarning):
    """The deployment runs part of the plan otherwise than priced (the message says what)."""


def check_plan_fits(plan: Plan, opts: KareusOptions) -> None:
    """Refuse a plan made for another GPU, world size or stage (step 1 of :mod:`kareus_fx.deploy.deployment`)."""
    workload = plan.workload
    if plan.gpu != opts.gpu:
        raise PlanMismatchError(
            f"GPU differs: the plan {plan.source} was made for {plan.gpu}, but options gpu is {opts.gpu} "
            f"({DEFAULT_GPU} when not given); pass options gpu={plan.gpu!r} if this job runs on that "
            f"GPU, or re-plan with `kareus plan --gpu {opts.gpu}`"
        )
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    job = "this job runs"
    pipeline, dp = workload["world_size"], workload.get("dp", 1)
    fits = {pipeline, pipeline * dp}  # one replica's group, or a group spanning the plan's replicas
    if opts.switching is not None and opts.switching.group is not None:  # one replica of several
        world, job = dist.get_world_size(opts.switching.group), "this pipeline (the PointSwitcher's group) has"
        fits = {pipeline}
    if world not in fits:
        replicas = (
            f"launch {pipeline * dp} processes ({dp} data-parallel replicas x {pipeline}) or {pipeline} (one replica)"
            if dp > 1
            else f"launch {pipeline} processes"
        )
        refit = f"`kareus plan --dp {world // pipeline}`" if world % pipeline == 0 else "`kareus plan` for this layout"
        spanning = f" ({dp} data-parallel replicas of it: {pipeline * dp})" if dp > 1 else ""
        raise PlanMismatchError(
            f"world size differs: the plan {plan.source} was made for {pipeline} processes (tp={workload['tp']} "
            f"x cp={workload['cp']} x pp={workload['pp']}){spanning} but {job} {world}; {replicas}, or re-plan "
            f"with {refit}"
        )
    num_stages = plan_num_stages(workload)
    if opts.stage >= num_stages:
        raise PlanMismatchError(
            f"options stage={opts.stage}, but the plan {plan.source} has {num_stages} pipeline "
            f"stage(s) (pp={workload['pp']} x virtual_stages={workload.get('virtual_stages', 1)}); pass the "
            f"global index of the stage (model chunk) this graph runs (0..{num_stages - 1})"
        )


def check_plan_recompute(plan: Plan, gm: torch.fx.GraphModule) -> None:
    """Refuse Dynamo's graph ``gm`` if it is activation-checkpointed and the plan was traced
    without checkpointing, or the other way round (a plan older than the field is not checked;
    the fingerprint check still compares the graphs op by op)."""
    planned = plan.workload.get("recompute")
    if planned is None:
        return
    regions = checkpoint_regions(gm)
    if (planned == "none") == (regions == 0):
        return
    if regions:
        raise PlanMismatchError(
            f"recompute differs: the plan {plan.source} was made with recompute=none, but this model "
            f"checkpoints {regions} region(s) (torch.utils.checkpoint or gradient_checkpointing_enable()), so "
            f"its backward recomputes them; remove the checkpointing or re-plan with `kareus plan --recompute "
            f"full` (every layer) or `--recompute selective` (core attention)"
        )
    raise PlanMismatchError(
        f"recompute differs: the plan {plan.source} was made with recompute={planned}, but this model "
        f"checkpoints nothing, so its backward has no recomputed forward; checkpoint it as the plan "
        f"did (torch.utils.checkpoint per layer, HF gradient_checkpointing_enable()) or re-plan with "
        f"`kareus plan --recompute none`"
    )


def check_layout(plan: Plan, name: str, gm: torch.fx.GraphModule) -> None:
    """Refuse ``gm`` if it communicates over groups the plan's tp and cp do not give (step 2 of
    :mod:`kareus_fx.deploy.deployment`)."""
    workload = plan.workload
    planned = {workload["tp"], workload["cp"]} - {1}
    live = {
        node.meta[META_KEY].collective.group_size
        for node in gm.graph.nodes
        if META_KEY in node.meta and node.meta[META_KEY].kind == "collective"
    }
    unexpected = sorted(size for size in live if size is not None and size not in planned)
    if unexpected:
        raise PlanMismatchError(
            f"rank layout differs from the plan {plan.source}: the {name} graph communicates "
            f"over groups of {unexpected} ranks, but the plan was made for tp={workload['tp']}, "
            f"cp={workload['cp']} (groups of {sorted(planned) or 'no'} ranks); build the model "
            f"with that layout or re-plan with `kareus plan` for this one"
        )


def check_fingerprint(
    plan: Plan,
    stage: int,
    name: str,
    gm: torch.fx.GraphModule,
    partitioning: GraphPartitioning | None,
    stage_graph: Mapping[str, Any],
    *,
    unsplit: bool = False,
) -> None:
    """Refuse ``gm`` if its fingerprint is not the plan's for this stage graph (step 2 of
    :mod:`kareus_fx.deploy.deployment`), saying what is likely to differ."""
    record = graph_record(name, gm, partitioning)
    live = graph_fingerprint(record)
    planned = stage_graph["sequential_fingerprint" if unsplit else "fingerprint"]
    if live == planned:
        return
    workload = plan.workload
    what = ", ".join(f"{k}={workload[k]}" for k in ("model", "tp", "cp", "pp", "mbs", "seq", "layers"))
    if not unsplit and partitioning is None and live == stage_graph.get("sequential_fingerprint"):
        raise PlanMismatchError(
            f"the {name} graph ran un-split (options nanobatch=False, or the nanobatch split fell "
            f"back with a warning) but the plan {plan.source} was made for the nanobatched "
            f"graph; drop nanobatch=False or re-plan"
        )
    ops = [n for n in record["nodes"] if n["kind"] in ("compute", "collective")]
    collectives = sum(1 for n in ops if n["kind"] == "collective")
    live_types = sorted(partitioning.types) if partitioning is not None else []
    planned_types = sorted(stage_graph["partition_types"])
    types_note = (
        "the same partition types"
        if live_types == planned_types
        else f"partition types {live_types or 'none'} (the plan has {planned_types or 'none'})"
    )
    if plan.compile_unit == "block":
        unit = (
            "one transformer block compiled on its own (--compile-unit block); a whole stage compiled "
            "as one graph needs a plan made with --compile-unit stage"
        )
    else:
        unit = (
            "the whole stage compiled as one graph; a job that compiles each transformer block on its "
            "own (torchtitan, kareus_fx.integrations.torchtitan.compile_blocks) needs a plan made with "
            "`kareus plan --compile-unit block`"
        )
    raise PlanMismatchError(
        f"the {name} graph of stage {stage} is not the graph the plan {plan.source} was "
        f"made for (fingerprint {live} vs the plan's {planned}): it has {len(ops) - collectives} "
        f"compute ops, {collectives} collectives and {types_note}. The plan is for {what} with "
        f"the reference model's dtype, its graph {unit}; another model, microbatch size, sequence "
        f"length, layer count or dtype gives another graph: re-plan with `kareus plan` for this workload"
    )
