"""Deploy a plan through the backend: pick the point, check the plan fits, compile, dispatch.

``torch.compile(model, backend="kareus", options={"plan": PATH, "target": ..., "stage": s})``:

1. At the first graph: load the plan (:func:`~kareus_fx.plan.plan_format.load_plan`: a corrupt file
   raises :class:`~kareus_fx.plan.plan_format.PlanFormatError` as is), pick the frontier point of
   ``target``, and refuse (:class:`PlanMismatchError`, saying what differs) a plan made for
   another GPU (``options["gpu"]`` against the plan's), another world size (the initialised
   process group against ``workload.world_size`` = tp x cp x pp, one pipeline, or ``workload.dp``
   times that: a job whose default group spans the plan's data-parallel replicas, each of which
   follows the same schedule over its own TP and CP groups, e.g. from a DeviceMesh's ``tp``
   dimension given to :func:`prepare_collectives`), or a stage the pipeline does not have.
   At the Dynamo graph: refuse a model checkpointed otherwise than the plan's ``workload.recompute``
   (:func:`check_plan_recompute`: checkpointed regions in the graph against ``none`` or not).
2. Per aten graph (forward, backward): refuse another rank layout (the group sizes of the
   graph's collectives against the plan's tp and cp) and another graph (fingerprint of the
   nanobatched graph, its ops as a multiset, as ``kareus plan`` computes it from a layer slice
   or a full trace, against the plan's stage graph: another model, microbatch size, sequence
   length, dtype or layer count).
3. Variants: the chosen point gives every microbatch of this stage's forward and backward an
   option: a clock, and either per partition type a comm SM count and launch slot, or
   ``sequential`` (the un-split Megatron-LM microbatch the plan priced). A microbatch whose
   forward option is sequential runs the un-split Dynamo graph (compiled through its own
   aot_autograd, so its backward is the un-split backward); every other microbatch runs the
   nanobatched graph. Per graph, one stream-scheduled GraphModule
   (``passes/stream_schedule.py``) is compiled per distinct set of per-type schedules; at run
   time a dispatcher picks the split or un-split graph (at the Dynamo level, before the forward)
   and the variant of the running microbatch.
   The running microbatch comes from the active
   :class:`~kareus_fx.runtime.step_context.StepContext` (a pipeline schedule or a loop that
   calls ``next_instruction``) when it runs this instruction, otherwise from a count of this
   graph's forward (backward) calls modulo the plan's microbatches (a plain training loop
   running forward and backward of each microbatch in order).
4. Clocks: with ``options["clock_controller"]`` (a
   :class:`~kareus_fx.runtime.clock_controller.ClockController`, any mode) the graphs' clock hooks
   request the plan's clock of the running instruction; without one they do nothing. A plan made
   with ``--max-clock-only`` requests no clock even with a controller (:func:`clock_binding`).
5. Collectives: each scheduled collective's group argument becomes the runtime's communicator
   for its SM count (:mod:`kareus_fx.runtime.collectives`). Those are created at startup by
   :func:`~kareus_fx.runtime.collectives.prepare_comm_groups` (required when the job has more
   than one TP or CP group, e.g. with pipeline stages); a job whose collectives all run over the
   whole world may leave them to the first compile.

6. Peers fail fast: the SM-limited communicators get a process-group timeout
   (:func:`prepare_collectives`' ``timeout_s``); a collective of a deployed graph that fails (a
   peer died, or did not answer within the timeout) raises
   :class:`~kareus_fx.deploy.peer_failure.PeerFailureError` naming this rank, the instruction and
   the collective, after restoring this rank's clock. Un-split graphs communicate over the
   model's own groups, whose timeout is the one given to ``init_process_group`` / ``new_group``.

7. Point switching: with ``options["switching"]`` (a
   :class:`~kareus_fx.deploy.switching.PointSwitcher`, which names the plan, the target and the
   candidate points) step 3 compiles the variants of every candidate point once (a variant two
   points share is compiled once), and every call dispatches to the variant, clock and split of
   the switcher's current point; the switcher changes the point at iteration boundaries, on all
   ranks of the pipeline at once. With the switcher's ``group`` (one data-parallel replica's
   ranks), step 1 checks the plan's world size against that group.

Known limitations: the forward and backward of one microbatch come from the same graph (split
or not), but the plan chooses their options independently; where they disagree the backward
follows its forward (an un-split forward's backward runs un-split at its planned clock; a split
forward's sequential backward runs the nanobatched backward with every partition sequential),
with one warning at deployment naming the microbatches. Inference graphs (``torch.no_grad``) run
the nanobatching order without the plan.

Compile-time tuning (``options['tune']``): :mod:`kareus_fx.deploy.compile_time_tuning`.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.fx

from kareus_fx.config import KareusOptions
from kareus_fx.deploy.compile_time_tuning import tuned_plan
from kareus_fx.deploy.hook_ops import ClockBinding
from kareus_fx.deploy.microbatch_cursor import MicrobatchCursor
from kareus_fx.deploy.plan_checks import PlanDeviationWarning, check_fingerprint, check_layout, check_plan_fits
from kareus_fx.deploy.plan_clocks import clock_schedule
from kareus_fx.deploy.run_log import RunLog, run_log_for
from kareus_fx.deploy.variants import Codegen, compile_variant, dispatcher, point_schedules
from kareus_fx.passes.partitions import GraphPartitioning
from kareus_fx.passes.stream_schedule import CommSchedule
from kareus_fx.plan.plan_format import Plan, Target, load_plan
from kareus_fx.runtime.clock_controller import ClockController
from kareus_fx.runtime.collectives import prepare_comm_groups

if TYPE_CHECKING:
    from kareus_fx.deploy.switching import PointSwitcher

__all__ = ["Deployment", "clock_binding", "prepare_collectives"]


def prepare_collectives(
    plan: str | Path | Plan,
    target: Target = "max-throughput",
    groups: Iterable[dist.ProcessGroup | None] = (),
    *,
    timeout_s: float | None = None,
) -> frozenset[int]:
    """Create this job's SM-limited communicators at startup (step 5 of the module docstring).

    Call on every rank after ``init_process_group`` and before the first compiled step, with the
    plan and target the compile options will name and this rank's TP and CP groups. Returns the
    SM counts prepared: every count at the target's point, over all stages. ``timeout_s`` is
    their process-group timeout (default
    :data:`~kareus_fx.runtime.collectives.DEFAULT_TIMEOUT_S`): step 6 of the module docstring.
    """
    plan = plan if isinstance(plan, Plan) else load_plan(plan)
    sm_counts = plan.comm_sm_counts(plan.point_index(target))
    prepare_comm_groups(sm_counts, groups, timeout_s)
    return sm_counts


def clock_binding(plan: Plan, point_index: int, controller: ClockController | None) -> ClockBinding | None:
    """What the clock hooks request from: None without a controller or for a plan that locks no clock."""
    if controller is None or not plan.locks_clocks:
        return None
    return ClockBinding(controller, clock_schedule(plan, point_index))


@dataclass
class Deployment:
    """A plan deployed on one Dynamo graph of this rank's pipeline stage."""

    plan: Plan
    point_index: int
    stage: int
    clock: ClockBinding | None
    dump_dir: Path | None = None
    sizes: Mapping[Any, int] | None = None
    """Shape symbol -> value at which a symbolic graph is analysed and checked (a bucket's
    sequence length, ``deploy/bucket_dispatch.py``); None: at the hints of the compiled call."""
    run_log: RunLog | None = None
    """Where each iteration's record goes (``deploy/run_log.py``); None: no run log."""
    bucket: int | None = None
    """The sequence-length bucket ``plan`` is of a bucketed plan (``deploy/bucket_dispatch.py``),
    named in the run log; None: ``plan`` is a one-length plan."""
    switching: PointSwitcher | None = None
    """Run-time point switching (``deploy/switching.py``): variants are compiled for each of its
    candidate points and every call runs its current point; None: ``point_index`` only."""
    cursor: MicrobatchCursor = field(init=False)
    unsplit: frozenset[int] = field(init=False)
    """Microbatches whose forward option is sequential at some point compiled: the un-split graph
    is compiled for them."""
    unsplit_at: Mapping[int, frozenset[int]] = field(init=False)
    """Per compiled point: the microbatches that run the un-split graph there."""
    clocks: Mapping[int, ClockBinding | None] = field(init=False)
    """Per candidate point (``point_index`` without switching): what its clock hooks request from
    (``clock``'s controller)."""

    def __post_init__(self) -> None:
        microbatches = self.plan.workload["microbatches"]
        self.cursor = MicrobatchCursor(self.stage, microbatches, per_block=self.plan.compile_unit == "block")
        points = (self.point_index,) if self.switching is None else self.switching.compiled_points
        controller = None if self.clock is None else self.clock.controller
        if self.switching is None:
            self.clocks = {self.point_index: clock_binding(self.plan, self.point_index, controller)}
        else:  # per candidate: a power-limit point runs another point's variants on its own clocks
            switching = self.switching
            self.clocks = {
                c: None if controller is None or not self.plan.locks_clocks else ClockBinding(controller, schedule)
                for c in switching.candidate_indices
                for schedule in (switching.clock_schedule(c),)
            }
        self.unsplit_at = {
            p: frozenset(mb for mb in range(microbatches) if self.option("forward", mb, p)["sequential"])
            for p in points
        }
        self.unsplit = frozenset().union(*self.unsplit_at.values())
        for point, unsplit in self.unsplit_at.items():
            disagree = [
                mb for mb in range(microbatches) if self.option("backward", mb, point)["sequential"] != (mb in unsplit)
            ]
            if disagree:
                warnings.warn(
                    f"the plan {self.plan.source} runs the forward and backward of microbatch(es) {disagree} "
                    f"of stage {self.stage} one split and one un-split at point {point}; a backward "
                    f"comes from its forward's graph, so each runs at its planned clock, un-split after an "
                    f"un-split forward and nanobatched with every partition sequential otherwise, not as priced",
                    PlanDeviationWarning,
                    stacklevel=2,
                )
        if self.switching is not None:
            self.switching.attach(self)

    def running_point(self) -> int:
        """The frontier point whose variants the running iteration runs."""
        return self.point_index if self.switching is None else self.switching.variant_point(self.running_candidate())

    def running_candidate(self) -> int:
        """The candidate the running iteration follows (a frontier index, or a switcher's
        power-limit point, which runs :meth:`running_point`'s variants)."""
        return self.point_index if self.switching is None else self.switching.current_index

    def option(self, name: str, microbatch: int, point: int | None = None) -> Mapping[str, Any]:
        """The plan's option for graph ``name`` of ``microbatch`` on this stage at ``point`` (default the deployed point)."""
        return self.plan.option(self.point_index if point is None else point, self.stage, name, microbatch)

    @classmethod
    def from_options(cls, opts: KareusOptions) -> Deployment | None:
        """The deployment ``opts`` ask for (tuning first when asked), or None without a plan."""
        path = tuned_plan(opts) if opts.tune is not None else opts.plan
        if opts.switching is not None:
            plan = opts.switching.plan_for(path)
        elif path is None:
            return None
        else:
            plan = load_plan(path)
        check_plan_fits(plan, opts)
        point = plan.point_index(opts.target)
        clock = clock_binding(plan, point, opts.clock_controller)
        return cls(
            plan=plan,
            point_index=point,
            stage=opts.stage,
            clock=clock,
            dump_dir=opts.dump_dir,
            run_log=None
            if opts.run_log is None
            else run_log_for(opts.run_log, plan, clocks_requested=clock is not None),
            switching=opts.switching,
        )

    def compile(
        self,
        name: str,
        gm: torch.fx.GraphModule,
        partitioning: GraphPartitioning | None,
        example_inputs: list[Any],
        codegen: Codegen,
        *,
        unsplit: bool | None = None,
    ) -> Callable[..., Any]:
        """Check ``gm`` against the plan and compile its variants behind a microbatch dispatcher;
        ``codegen`` compiles each variant (``kareus_fx.capture.codegen.GraphCodegen``).

        ``unsplit``: True, ``gm`` is the un-split graph compiled for the microbatches in
        :attr:`unsplit`; False, the nanobatched graph of the others; None, the only graph (no
        split was made: the graph does not communicate, or the split fell back), run by all.
        """
        stage_graph = self.plan.data["stages"][self.stage]["graphs"][name]
        check_layout(self.plan, name, gm)
        check_fingerprint(self.plan, self.stage, name, gm, partitioning, stage_graph, unsplit=bool(unsplit))
        variant_of: dict[tuple[int, int], str] = {}  # (point, microbatch) -> its variant's key
        schedules: dict[str, dict[str, CommSchedule]] = {}
        for point, point_unsplit in self.unsplit_at.items():
            for mb in range(self.cursor.microbatches):
                if unsplit is not None and (mb in point_unsplit) != unsplit:
                    continue
                option = self.option(name, mb, point)
                per_type = point_schedules(self.plan, name, option, partitioning, stage_graph["partition_types"], point)
                key = json.dumps({t: dataclasses.astuple(s) for t, s in sorted(per_type.items())})
                schedules.setdefault(key, per_type)
                variant_of[(point, mb)] = key
        variants = {}
        for key, per_type in schedules.items():
            runs = tuple(sorted(run for run, k in variant_of.items() if k == key))
            variants[key] = compile_variant(
                name,
                gm,
                partitioning,
                per_type,
                tuple(sorted({mb for _, mb in runs})),
                example_inputs,
                codegen,
                stage=self.stage,
                nanobatched=partitioning is not None,
                runs=runs,
                dump_dir=self.dump_dir,
                per_point_names=self.switching is not None,
            )
        return dispatcher(
            name,
            variants,
            variant_of,
            self.cursor,
            self.clocks,
            self.running_point,
            self.running_candidate,
            self.run_log,
            self.bucket,
        )

    def select_graph(self, nanobatched: Callable[..., Any], unsplit: Callable[..., Any]) -> Callable[..., Any]:
        """The Dynamo-level callable: per call, the un-split graph for the microbatches whose
        forward runs un-split, the nanobatched graph otherwise (and under ``torch.no_grad``).
        Both take the graph's inputs as positional arguments (what aot_autograd returns)."""
        cursor, unsplit_at = self.cursor, self.unsplit_at

        def run(*args: Any) -> Any:
            if torch.is_grad_enabled() and cursor.peek("forward").microbatch in unsplit_at[self.running_point()]:
                return unsplit(*args)
            return nanobatched(*args)

        return run
