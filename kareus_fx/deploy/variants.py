"""Compile a plan's variants of one aten graph and dispatch each call to the running one.

A variant is one stream-scheduled copy of the graph (``passes/stream_schedule.py``) per distinct
set of per-partition-type schedules the plan gives this stage's microbatches (at every point
compiled); the dispatcher picks the variant of the running (point, microbatch) per call (step 3
of :mod:`kareus_fx.deploy.deployment`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from kareus_fx.deploy.hook_ops import ClockBinding, set_running
from kareus_fx.deploy.microbatch_cursor import MicrobatchCursor
from kareus_fx.deploy.peer_failure import is_collective_failure, peer_failure
from kareus_fx.deploy.plan_checks import PlanMismatchError
from kareus_fx.deploy.run_log import RunLog
from kareus_fx.passes.partitions import GraphPartitioning
from kareus_fx.passes.stream_schedule import (
    CommSchedule,
    GroupRewrite,
    ScheduledPartition,
    copy_partitioned_graph,
    insert_clock_hook,
    schedule_partitions,
)
from kareus_fx.plan.plan_format import Plan
from kareus_fx.runtime.collectives import backends_for

__all__ = [
    "Codegen",
    "DeployedGraph",
    "compile_variant",
    "copy_graph",
    "deployed_graphs",
    "dispatcher",
    "group_rewrite",
    "point_schedules",
    "write_code",
]

Codegen = Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]
"""Compiles one aten graph into a boxed callable (Inductor's inner compile or op by op)."""


@dataclass(frozen=True)
class DeployedGraph:
    """One compiled variant: print ``gm.code`` (or ``gm.print_readable()``) to see the scheduled
    aten graph, ``output_code`` to see the code Inductor generated from it."""

    name: str
    stage: int
    microbatches: tuple[int, ...]
    gm: torch.fx.GraphModule
    partitions: tuple[ScheduledPartition, ...]
    nanobatched: bool = True
    """False: the un-split graph of the microbatches whose option is sequential."""
    output_code: str | None = None
    """Inductor's generated source of ``gm`` (None with ``options={"inductor": False}``)."""
    runs: tuple[tuple[int, int], ...] = ()
    """The (frontier point, microbatch) pairs that run this variant."""


_DEPLOYED: list[DeployedGraph] = []


def deployed_graphs() -> list[DeployedGraph]:
    """Every variant compiled from a plan in this process, oldest first."""
    return list(_DEPLOYED)


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """An independent copy of ``graph`` (node metadata copied shallowly)."""
    copy = torch.fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    return copy


def point_schedules(
    plan: Plan,
    name: str,
    option: Mapping[str, Any],
    partitioning: GraphPartitioning | None,
    plan_types: Mapping[str, str],
    point: int,
) -> dict[str, CommSchedule]:
    """Per local partition type: the schedule of ``option`` (a plan option of graph ``name`` at frontier
    point ``point``; every type sequential if the option is)."""
    if partitioning is None:
        return {}
    configs = option["configs"]
    result = {}
    for local in sorted(partitioning.types):
        if configs is None:
            result[local] = CommSchedule(comm_sms=None, launch_slot=None)
            continue
        config = configs.get(plan_types[local])
        if config is None:
            raise PlanMismatchError(
                f"the plan {plan.source} gives {name} type {plan_types[local]} no schedule at "
                f"point {point}; regenerate the plan with `kareus plan`"
            )
        result[local] = CommSchedule(comm_sms=config["comm_sms"], launch_slot=config["launch_slot"])
    return result


def compile_variant(
    name: str,
    gm: torch.fx.GraphModule,
    partitioning: GraphPartitioning | None,
    per_type: Mapping[str, CommSchedule],
    microbatches: tuple[int, ...],
    example_inputs: list[Any],
    codegen: Codegen,
    *,
    stage: int,
    nanobatched: bool,
    runs: tuple[tuple[int, int], ...],
    dump_dir: Path | None,
    per_point_names: bool,
) -> tuple[DeployedGraph, Callable[..., Any]]:
    """Schedule a copy of ``gm`` (``per_type`` per partition type), compile it with ``codegen`` and
    record it in :func:`deployed_graphs` (its code in ``dump_dir`` when given; ``per_point_names``:
    name the files by (point, microbatch) runs, as point switching compiles one variant per set)."""
    if partitioning is None:
        variant = torch.fx.GraphModule(gm, copy_graph(gm.graph))
        insert_clock_hook(variant, stage, name)
        summary: list[ScheduledPartition] = []
    else:
        variant, copied = copy_partitioned_graph(gm, partitioning)
        summary = schedule_partitions(
            variant, copied, per_type, stage=stage, instruction=name, group_for=group_rewrite()
        )
    compiled = codegen(variant, example_inputs)
    deployed = DeployedGraph(
        name=name,
        stage=stage,
        microbatches=microbatches,
        gm=variant,
        partitions=tuple(summary),
        nanobatched=nanobatched,
        output_code=getattr(compiled, "source_code", None),
        runs=runs,
    )
    _DEPLOYED.append(deployed)
    if dump_dir is not None:
        write_code(deployed, dump_dir, per_point_names=per_point_names)
    return deployed, compiled


def dispatcher(
    name: str,
    variants: Mapping[str, tuple[DeployedGraph, Callable[..., Any]]],
    variant_of: Mapping[tuple[int, int], str],
    cursor: MicrobatchCursor,
    clocks: Mapping[int, ClockBinding | None],
    running_point: Callable[[], int],
    running_candidate: Callable[[], int],
    run_log: RunLog | None = None,
    bucket: int | None = None,
) -> Callable[..., Any]:
    """The boxed callable of graph ``name``: per call, the variant of the running (point,
    microbatch) (``variant_of`` names its key in ``variants``), run under the running candidate's
    clock; a failed collective raises :class:`~kareus_fx.deploy.peer_failure.PeerFailureError`.
    ``run_log`` hears of every call (the iteration boundaries and clocks it records), naming
    ``bucket``, the sequence-length bucket of a bucketed plan these variants deploy."""

    def run(args: list[Any]) -> Any:
        node = cursor.next(name)
        point = running_point()
        key = variant_of.get((point, node.microbatch))
        if key is None:
            raise PlanMismatchError(
                f"{node} ran a graph the plan does not give that microbatch (split vs un-split): "
                f"its forward ran as another microbatch. Without a pipeline hook the deployment "
                f"counts calls and expects each microbatch's forward then its backward in order; "
                f"drive other orders with StepContext and next_instruction()"
            )
        if run_log is not None:
            run_log.called(node, point, bucket)
        clock = clocks[running_candidate()]
        set_running(node, clock)
        deployed, compiled = variants[key]
        try:
            return compiled(args)
        except RuntimeError as err:  # step 6 of kareus_fx.deploy.deployment
            if not is_collective_failure(err):
                raise
            raise peer_failure(err, node, name, deployed.gm, deployed.partitions, clock) from err

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def group_rewrite() -> GroupRewrite | None:
    """The runtime's SM-limited communicator per (group, SM count); None without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch._C._distributed_c10d import _resolve_process_group
    from torch.distributed.distributed_c10d import GroupName

    def group_for(group_name: str, comm_sms: int) -> str:
        return backends_for(_resolve_process_group(GroupName(group_name))).group_name_for(comm_sms)

    return group_for


def write_code(deployed: DeployedGraph, dump_dir: Path, *, per_point_names: bool) -> None:
    """Write the variant's scheduled code (and Inductor's, when there is one) into ``dump_dir``."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    mbs = "_mb" + "-".join(map(str, deployed.microbatches))
    if per_point_names:  # one variant per set of (point, microbatch) runs
        mbs = "_" + "-".join(f"p{point}mb{mb}" for point, mb in deployed.runs)
    split = "" if deployed.nanobatched else "_unsplit"
    path = dump_dir / f"kareus_code_stage{deployed.stage}_{deployed.name}{split}{mbs}_rank{rank}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(deployed.gm.code)
    if deployed.output_code is not None:
        path.with_name(path.stem + "_inductor.py").write_text(deployed.output_code)
