"""Follow a plan under ``torch.distributed.pipelining``: the schedule's own calls drive it.

PyTorch's pipeline engine runs the microbatch loop itself (``schedule.step(...)``), so there is no
place in user code for :func:`~kareus_fx.runtime.step_context.next_instruction`. Its extension
point is the stage: every schedule (``Schedule1F1B``, ``ScheduleGPipe``,
``ScheduleInterleaved1F1B``) runs a microbatch through ``PipelineStage.forward_one_chunk`` and
``PipelineStage.backward_one_chunk``. :class:`KareusPipelineStage` overrides those two and, around
the engine's own code (``super()``), marks (stage_index, instruction, microbatch) as running in
the active :class:`~kareus_fx.runtime.step_context.StepContext`: that requests the plan's clock,
and the deployed graphs read it to pick the microbatch's variant (split or un-split, per-type
SM counts and launch slots). Nothing of the schedule is copied.

Usage (one rank of a TP x PP job; the last stage's module returns its loss)::

    stage = kareus_stage(model, stage_index, num_stages, device, plan="plan.json", group=pp_group)
    schedule = Schedule1F1B(stage, n_microbatches=plan_microbatches, loss_fn=stage_loss)
    with follow_plan(schedule, "plan.json", target, controller):
        for batch in batches:
            schedule.step(...)  # last stage: schedule.step(labels=labels, target=labels)

Assumptions and limits:

- ``stage_index`` is the global stage index (``PipelineNode.stage``): with V stages per rank
  (interleaved), rank r holds stages r, r + pp, ... and the plan must have ``pp * V`` stages
  (``workload.virtual_stages``); :func:`follow_plan` refuses another count with a clear error.
- The plan prices forward and full backward instructions only: schedules that split the
  backward into input and weight parts or overlap a forward with a backward (zero bubble,
  DualPipeV) are refused.
- A plan is composed for 1F1B (interleaved 1F1B with virtual stages). Another order (GPipe)
  runs each instruction's planned clock and variant, but the plan's predicted iteration time and
  energy do not hold for it: :func:`follow_plan` warns once (:class:`PlanDeviationWarning`).
- The engine's shape inference (``PipelineStage`` without ``input_args``: one forward and backward
  at the first ``step``) runs the un-compiled module (blocks compiled on their own run eagerly), so
  it is not an instruction of the plan.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from kareus_fx.compose.pipeline_schedule import Instruction
from kareus_fx.deploy.plan_checks import PlanDeviationWarning, PlanMismatchError
from kareus_fx.deploy.plan_clocks import clock_schedule
from kareus_fx.deploy.run_log import close_run_logs
from kareus_fx.errors import KareusError
from kareus_fx.models.parallel import ParallelLayout
from kareus_fx.plan.plan_format import Plan, Target, load_plan
from kareus_fx.runtime.clock_controller import ClockController
from kareus_fx.runtime.step_context import StepContext, active_step_context

__all__ = [
    "KareusPipelineStage",
    "UnsupportedScheduleError",
    "follow_plan",
    "kareus_stage",
    "pipeline_group",
    "stage_loss",
]

_SPLIT_BACKWARD = (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV)


class UnsupportedScheduleError(KareusError, ValueError):
    """A pipeline schedule whose instructions the plan cannot follow."""


class KareusPipelineStage(PipelineStage):
    """A ``PipelineStage`` that marks each chunk's (stage, instruction, microbatch) as running.

    Same constructor as ``torch.distributed.pipelining.PipelineStage``; ``submodule`` is usually
    compiled with ``backend="kareus"`` and the plan (see :func:`kareus_stage`). Needs an active
    :class:`StepContext` (:func:`follow_plan`) when a schedule runs it.
    """

    def forward_one_chunk(
        self,
        fwd_chunk_id: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        save_forward_output: bool = True,
    ) -> Any:
        with self._running("forward", fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

    def backward_one_chunk(
        self,
        bwd_chunk_id: int,
        loss: torch.Tensor | None = None,
        full_backward: bool = True,
        last_backward: bool = False,
    ) -> None:
        if not full_backward:
            raise UnsupportedScheduleError(
                f"stage {self.stage_index}: the schedule splits the backward of microbatch {bwd_chunk_id} into "
                f"input and weight parts, but a plan prices whole backward instructions; use Schedule1F1B, "
                f"ScheduleGPipe or ScheduleInterleaved1F1B"
            )
        if not self.has_backward:
            return  # the engine skips it too (eval / no loss_fn): no instruction runs
        with self._running("backward", bwd_chunk_id):
            super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)

    def _compute_outputs(self, *args: torch.Tensor, module: torch.nn.Module, **kwargs: Any) -> Any:
        """The engine's shape inference: run the un-compiled module (see the module docstring):
        a stage compiled whole runs its original module, and parts compiled on their own inside it
        (blocks compiled per layer, ``integrations.torchtitan.compile_blocks``) run eagerly."""
        with torch.compiler.set_stance("force_eager"):
            return super()._compute_outputs(*args, module=getattr(module, "_orig_mod", module), **kwargs)

    @contextmanager
    def _running(self, instruction: Instruction, microbatch: int) -> Iterator[None]:
        context = active_step_context()
        if context is None:
            raise KareusError(
                f"KareusPipelineStage {self.stage_index} ran the {instruction} of microbatch {microbatch} "
                f"outside a plan: wrap schedule.step(...) in `with follow_plan(schedule, plan, target, "
                f"controller):` (or an active StepContext)"
            )
        with context.step(instruction, microbatch, stage=self.stage_index):
            yield


def kareus_stage(
    module: torch.nn.Module,
    stage_index: int,
    num_stages: int,
    device: torch.device | str,
    *,
    plan: str | Path,
    target: Target = "max-throughput",
    options: Mapping[str, Any] | None = None,
    **stage_kwargs: Any,
) -> KareusPipelineStage:
    """``module`` compiled with the kareus backend to deploy ``plan`` as global stage
    ``stage_index``, wrapped in a :class:`KareusPipelineStage` (``stage_kwargs``: the engine's
    other ``PipelineStage`` arguments, e.g. ``group``, ``input_args``). ``options`` adds backend
    options (``gpu``, ``inductor``, ``clock_controller``, ...); ``plan``, ``target`` and ``stage``
    are set here."""
    compile_options = {**(options or {}), "plan": str(plan), "target": target, "stage": stage_index}
    compiled = cast(torch.nn.Module, torch.compile(module, backend="kareus", fullgraph=True, options=compile_options))
    return KareusPipelineStage(compiled, stage_index, num_stages, torch.device(device), **stage_kwargs)


def pipeline_group(layout: ParallelLayout) -> dist.ProcessGroup:
    """The process group of this rank's pipeline: the ranks at its TP and CP position, one per
    stage in stage order (the ``group`` of its ``PipelineStage``). Collective over the default
    group: every rank creates every pipeline's group, in the same order."""
    stage_size = layout.tp * layout.cp
    groups: list[dist.ProcessGroup] = [
        dist.new_group([stage * stage_size + position for stage in range(layout.pp)]) for position in range(stage_size)
    ]
    own: dist.ProcessGroup = groups[layout.cp_rank * layout.tp + layout.tp_rank]  # a member: not NON_GROUP_MEMBER
    return own


def stage_loss(output: torch.Tensor, target: Any = None) -> torch.Tensor:
    """The schedule's ``loss_fn`` for a last stage whose module returns its own loss (the plan's
    last-stage graph includes the loss): passes it through; ``target`` is unused."""
    if not isinstance(output, torch.Tensor) or output.dim() != 0:
        raise KareusError(
            f"stage_loss expects the last stage to return its scalar loss, got "
            f"{type(output).__name__} of shape {tuple(getattr(output, 'shape', ()))}; give the schedule "
            f"your own loss_fn when the last stage returns logits"
        )
    return output


@contextmanager
def follow_plan(
    schedule: Any,
    plan: str | Path | Plan,
    target: Target = "max-throughput",
    controller: ClockController | None = None,
) -> Iterator[StepContext]:
    """Run ``schedule.step`` calls inside the block on ``plan``'s point ``target``: checks the
    schedule against the plan (stage count, microbatches, supported schedule, stages that
    announce) and opens the :class:`StepContext` the stages announce to. ``controller`` receives
    the planned clock of every instruction (None: no clock requests). On exit the run logs
    (backend option ``run_log``) record their last iteration."""
    plan = plan if isinstance(plan, Plan) else load_plan(plan)
    _check_schedule(schedule, plan)
    point = plan.point_index(target)
    try:
        with StepContext(clock_schedule(plan, point), controller) as context:
            yield context
    finally:
        close_run_logs()


def _schedule_stages(schedule: Any) -> list[Any]:
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    if not stages or stages[0] is None:
        raise UnsupportedScheduleError(
            f"{type(schedule).__name__} is not a torch.distributed.pipelining schedule with stages; "
            f"pass Schedule1F1B, ScheduleGPipe or ScheduleInterleaved1F1B"
        )
    return list(stages)


def _check_schedule(schedule: Any, plan: Plan) -> None:
    """Step by step: what the plan can follow (module docstring)."""
    name = type(schedule).__name__
    if isinstance(schedule, _SPLIT_BACKWARD):
        raise UnsupportedScheduleError(
            f"{name} splits backwards into input and weight parts (or overlaps them with forwards), but "
            f"a plan prices whole forward and backward instructions; use Schedule1F1B, ScheduleGPipe or "
            f"ScheduleInterleaved1F1B"
        )
    stages = _schedule_stages(schedule)
    plain = [s.stage_index for s in stages if not isinstance(s, KareusPipelineStage)]
    if plain:
        raise UnsupportedScheduleError(
            f"{name} runs stage(s) {plain} as plain PipelineStage, which do not tell the plan which "
            f"microbatch runs; build them with kareus_stage(...) or KareusPipelineStage(...)"
        )
    workload = plan.workload
    virtual = int(workload.get("virtual_stages", 1))
    planned = workload["pp"] * virtual
    num_stages = stages[0].num_stages
    if num_stages != planned or len(stages) != virtual:
        raise PlanMismatchError(
            f"{name} runs {num_stages} pipeline stages, {len(stages)} on this rank, but the plan "
            f"{plan.source} has {planned} (pp={workload['pp']} x virtual_stages={virtual} per rank); "
            f"re-plan for this layout (`kareus plan --pp {num_stages // len(stages)}` with "
            f"{len(stages)} virtual stage(s) per rank) or run a schedule with {virtual} stage(s) per rank"
        )
    microbatches = getattr(schedule, "_n_microbatches", None)
    if microbatches != workload["microbatches"]:
        raise PlanMismatchError(
            f"{name} runs {microbatches} microbatches per step but the plan {plan.source} was made for "
            f"{workload['microbatches']}; pass n_microbatches={workload['microbatches']} or re-plan"
        )
    composed_for = Schedule1F1B if virtual == 1 else ScheduleInterleaved1F1B
    if type(schedule) is not composed_for:
        warnings.warn(
            f"{name} runs the plan's clock and variant of every instruction, but the plan {plan.source} "
            f"was composed for {composed_for.__name__}: its predicted iteration time and energy do not "
            f"hold for this order",
            PlanDeviationWarning,
            stacklevel=3,
        )
