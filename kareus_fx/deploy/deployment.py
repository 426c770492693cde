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

Compile-time tuning: ``options={"tune": "simulated" | "cuda", "plan_out": PATH}`` tunes the live
graph (:mod:`kareus_fx.plan.live_tuning`, one stage). With ``"tune_request": {...}`` it instead runs
:func:`kareus_fx.plan.planner.make_plan` on that :class:`~kareus_fx.plan.planner.PlanRequest` (model, tp,
cp, pp, microbatches, mbs, seq, layers, ...): the planner traces the reference model at full size
on the meta device under the fake process group, so it runs in a spawned process (rank 0 only;
the other ranks wait at a barrier); this is the way for pipelines. Either way the plan is
written to ``plan_out`` and then deployed like ``options["plan"]``.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.fx

from kareus_fx.capture.dump import graph_record
from kareus_fx.compose.pipeline_schedule import INSTRUCTIONS, PipelineNode
from kareus_fx.config import KareusOptions
from kareus_fx.cost_models.hardware import DEFAULT_GPU
from kareus_fx.deploy.hook_ops import ClockBinding, set_running
from kareus_fx.deploy.peer_failure import is_collective_failure, peer_failure
from kareus_fx.deploy.plan_clocks import clock_schedule, plan_num_stages
from kareus_fx.errors import KareusError, OptionsError
from kareus_fx.models.recompute import checkpoint_regions
from kareus_fx.passes.analysis import META_KEY
from kareus_fx.passes.partitions import GraphPartitioning
from kareus_fx.passes.stream_schedule import (
    CommSchedule,
    GroupRewrite,
    ScheduledPartition,
    copy_partitioned_graph,
    insert_clock_hook,
    schedule_partitions,
)
from kareus_fx.plan.graph_workload import graph_fingerprint
from kareus_fx.plan.plan_format import Plan, Target, load_plan, write_plan
from kareus_fx.runtime.clock_controller import ClockController
from kareus_fx.runtime.collectives import backends_for, prepare_comm_groups
from kareus_fx.runtime.step_context import active_step_context

if TYPE_CHECKING:
    from kareus_fx.deploy.switching import PointSwitcher

Codegen = Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]
"""Compiles one aten graph into a boxed callable (Inductor's inner compile or op by op)."""

__all__ = [
    "DeployedGraph",
    "Deployment",
    "PlanDeviationWarning",
    "PlanMismatchError",
    "clock_schedule",
    "copy_graph",
    "deployed_graphs",
    "prepare_collectives",
]


class PlanMismatchError(KareusError, ValueError):
    """A valid plan made for another graph, world size, rank layout, GPU or pipeline stage."""


class PlanDeviationWarning(UserWarning):
    """The deployment runs part of the plan otherwise than priced (the message says what)."""


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


class MicrobatchCursor:
    """Which microbatch of this stage runs an instruction (see the module docstring, step 3)."""

    def __init__(self, stage: int, microbatches: int, *, per_block: bool = False) -> None:
        self.stage = stage
        self.microbatches = microbatches
        self.per_block = per_block
        """The graph is one block of the stage (a ``--compile-unit block`` plan): it runs once per
        layer in every instruction, so counting its calls does not give the microbatch."""
        self._calls: dict[str, int] = dict.fromkeys(INSTRUCTIONS, 0)

    def next(self, instruction: str) -> PipelineNode:
        """The instruction that runs now; a counted one advances the count."""
        node = self.peek(instruction)
        if not self._from_hook(instruction):
            self._calls[instruction] += 1
        return node

    def peek(self, instruction: str) -> PipelineNode:
        """The instruction :meth:`next` would return, without counting it."""
        context = active_step_context()
        current = None if context is None else context.current
        if current is not None and current.instruction == instruction:  # what _from_hook checks
            if current.stage != self.stage or current.microbatch >= self.microbatches:
                raise PlanMismatchError(
                    f"the pipeline hook runs {current} but this graph was compiled for stage "
                    f"{self.stage} of a plan with {self.microbatches} microbatches; pass "
                    f"options={{'stage': {current.stage}}} or re-plan for this pipeline"
                )
            return current
        if self.per_block and self.microbatches > 1:
            raise PlanMismatchError(
                f"a per-block plan (--compile-unit block) of {self.microbatches} microbatches ran a block's "
                f"{instruction} outside a pipeline step: each block runs once per layer, so the deployment cannot "
                f"count microbatches; run the step under a StepContext (steps.step('{instruction}', mb)) or a "
                f"torch.distributed.pipelining schedule (follow_plan), or plan --microbatches 1"
            )
        microbatch = self._calls[instruction] % self.microbatches
        return PipelineNode(self.stage, instruction, microbatch)  # type: ignore[arg-type]

    def at_iteration_boundary(self) -> bool:
        """True when every counted instruction has run a whole number of iterations."""
        return all(count % self.microbatches == 0 for count in self._calls.values())

    @staticmethod
    def _from_hook(instruction: str) -> bool:
        context = active_step_context()
        return context is not None and context.current is not None and context.current.instruction == instruction


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
            p: frozenset(mb for mb in range(microbatches) if self._option("forward", mb, p)["sequential"])
            for p in points
        }
        self.unsplit = frozenset().union(*self.unsplit_at.values())
        for point, unsplit in self.unsplit_at.items():
            disagree = [
                mb for mb in range(microbatches) if self._option("backward", mb, point)["sequential"] != (mb in unsplit)
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

    def _option(self, name: str, microbatch: int, point: int | None = None) -> Mapping[str, Any]:
        return self.plan.option(self.point_index if point is None else point, self.stage, name, microbatch)

    @classmethod
    def from_options(cls, opts: KareusOptions) -> Deployment | None:
        """The deployment ``opts`` ask for (tuning first when asked), or None without a plan."""
        path = _tuned_plan(opts) if opts.tune is not None else opts.plan
        if opts.switching is not None:
            plan = opts.switching.plan_for(path)
        elif path is None:
            return None
        else:
            plan = load_plan(path)
        _check_plan_fits(plan, opts)
        point = plan.point_index(opts.target)
        clock = clock_binding(plan, point, opts.clock_controller)
        return cls(
            plan=plan,
            point_index=point,
            stage=opts.stage,
            clock=clock,
            dump_dir=opts.dump_dir,
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
        self._check_layout(name, gm)
        self._check_fingerprint(name, gm, partitioning, stage_graph, unsplit=bool(unsplit))
        variant_of: dict[tuple[int, int], str] = {}  # (point, microbatch) -> its variant's key
        schedules: dict[str, dict[str, CommSchedule]] = {}
        for point, point_unsplit in self.unsplit_at.items():
            for mb in range(self.cursor.microbatches):
                if unsplit is not None and (mb in point_unsplit) != unsplit:
                    continue
                option = self._option(name, mb, point)
                per_type = self._schedules(name, option, partitioning, stage_graph["partition_types"], point)
                key = json.dumps({t: dataclasses.astuple(s) for t, s in sorted(per_type.items())})
                schedules.setdefault(key, per_type)
                variant_of[(point, mb)] = key
        variants = {}
        for key, per_type in schedules.items():
            runs = tuple(sorted(run for run, k in variant_of.items() if k == key))
            variants[key] = self._compile_variant(
                name,
                gm,
                partitioning,
                per_type,
                tuple(sorted({mb for _, mb in runs})),
                example_inputs,
                codegen,
                nanobatched=partitioning is not None,
                runs=runs,
            )
        return self._dispatcher(name, variants, variant_of)

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

    # ----- checks ------------------------------------------------------------------------------
    def _check_layout(self, name: str, gm: torch.fx.GraphModule) -> None:
        workload = self.plan.workload
        planned = {workload["tp"], workload["cp"]} - {1}
        live = {
            node.meta[META_KEY].collective.group_size
            for node in gm.graph.nodes
            if META_KEY in node.meta and node.meta[META_KEY].kind == "collective"
        }
        unexpected = sorted(size for size in live if size is not None and size not in planned)
        if unexpected:
            raise PlanMismatchError(
                f"rank layout differs from the plan {self.plan.source}: the {name} graph communicates "
                f"over groups of {unexpected} ranks, but the plan was made for tp={workload['tp']}, "
                f"cp={workload['cp']} (groups of {sorted(planned) or 'no'} ranks); build the model "
                f"with that layout or re-plan with `kareus plan` for this one"
            )

    def _check_fingerprint(
        self,
        name: str,
        gm: torch.fx.GraphModule,
        partitioning: GraphPartitioning | None,
        stage_graph: Mapping[str, Any],
        *,
        unsplit: bool = False,
    ) -> None:
        record = graph_record(name, gm, partitioning)
        live = graph_fingerprint(record)
        planned = stage_graph["sequential_fingerprint" if unsplit else "fingerprint"]
        if live == planned:
            return
        workload = self.plan.workload
        what = ", ".join(f"{k}={workload[k]}" for k in ("model", "tp", "cp", "pp", "mbs", "seq", "layers"))
        if not unsplit and partitioning is None and live == stage_graph.get("sequential_fingerprint"):
            raise PlanMismatchError(
                f"the {name} graph ran un-split (options nanobatch=False, or the nanobatch split fell "
                f"back with a warning) but the plan {self.plan.source} was made for the nanobatched "
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
        if self.plan.compile_unit == "block":
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
            f"the {name} graph of stage {self.stage} is not the graph the plan {self.plan.source} was "
            f"made for (fingerprint {live} vs the plan's {planned}): it has {len(ops) - collectives} "
            f"compute ops, {collectives} collectives and {types_note}. The plan is for {what} with "
            f"the reference model's dtype, its graph {unit}; another model, microbatch size, sequence "
            f"length, layer count or dtype gives another graph: re-plan with `kareus plan` for this workload"
        )

    def _schedules(
        self,
        name: str,
        option: Mapping[str, Any],
        partitioning: GraphPartitioning | None,
        plan_types: Mapping[str, str],
        point: int | None = None,
    ) -> dict[str, CommSchedule]:
        """Per local partition type: the option's schedule (every type sequential if it is)."""
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
                    f"the plan {self.plan.source} gives {name} type {plan_types[local]} no schedule at "
                    f"point {self.point_index if point is None else point}; regenerate the plan with `kareus plan`"
                )
            result[local] = CommSchedule(comm_sms=config["comm_sms"], launch_slot=config["launch_slot"])
        return result

    # ----- compile and dispatch -------------------------------------------------------------------
    def _compile_variant(
        self,
        name: str,
        gm: torch.fx.GraphModule,
        partitioning: GraphPartitioning | None,
        per_type: Mapping[str, CommSchedule],
        microbatches: tuple[int, ...],
        example_inputs: list[Any],
        codegen: Codegen,
        *,
        nanobatched: bool,
        runs: tuple[tuple[int, int], ...],
    ) -> tuple[DeployedGraph, Callable[..., Any]]:
        if partitioning is None:
            variant = torch.fx.GraphModule(gm, copy_graph(gm.graph))
            insert_clock_hook(variant, self.stage, name)
            summary: list[ScheduledPartition] = []
        else:
            variant, copied = copy_partitioned_graph(gm, partitioning)
            summary = schedule_partitions(
                variant, copied, per_type, stage=self.stage, instruction=name, group_for=self._group_rewrite()
            )
        compiled = codegen(variant, example_inputs)
        deployed = DeployedGraph(
            name=name,
            stage=self.stage,
            microbatches=microbatches,
            gm=variant,
            partitions=tuple(summary),
            nanobatched=nanobatched,
            output_code=getattr(compiled, "source_code", None),
            runs=runs,
        )
        _DEPLOYED.append(deployed)
        if self.dump_dir is not None:
            self._write_code(deployed, self.dump_dir)
        return deployed, compiled

    def _dispatcher(
        self,
        name: str,
        variants: Mapping[str, tuple[DeployedGraph, Callable[..., Any]]],
        variant_of: Mapping[tuple[int, int], str],
    ) -> Callable[..., Any]:
        cursor, clocks = self.cursor, self.clocks

        def run(args: list[Any]) -> Any:
            node = cursor.next(name)
            point = self.running_point()
            key = variant_of.get((point, node.microbatch))
            if key is None:
                raise PlanMismatchError(
                    f"{node} ran a graph the plan does not give that microbatch (split vs un-split): "
                    f"its forward ran as another microbatch. Without a pipeline hook the deployment "
                    f"counts calls and expects each microbatch's forward then its backward in order; "
                    f"drive other orders with StepContext and next_instruction()"
                )
            clock = clocks[self.running_candidate()]
            set_running(node, clock)
            deployed, compiled = variants[key]
            try:
                return compiled(args)
            except RuntimeError as err:  # step 6 of the module docstring
                if not is_collective_failure(err):
                    raise
                raise peer_failure(err, node, name, deployed.gm, deployed.partitions, clock) from err

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def _group_rewrite(self) -> GroupRewrite | None:
        """The runtime's SM-limited communicator per (group, SM count); None without a process group."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        from torch._C._distributed_c10d import _resolve_process_group
        from torch.distributed.distributed_c10d import GroupName

        def group_for(group_name: str, comm_sms: int) -> str:
            return backends_for(_resolve_process_group(GroupName(group_name))).group_name_for(comm_sms)

        return group_for

    def _write_code(self, deployed: DeployedGraph, dump_dir: Path) -> None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        mbs = "_mb" + "-".join(map(str, deployed.microbatches))
        if self.switching is not None:  # one variant per set of (point, microbatch) runs
            mbs = "_" + "-".join(f"p{point}mb{mb}" for point, mb in deployed.runs)
        split = "" if deployed.nanobatched else "_unsplit"
        path = dump_dir / f"kareus_code_stage{self.stage}_{deployed.name}{split}{mbs}_rank{rank}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(deployed.gm.code)
        if deployed.output_code is not None:
            path.with_name(path.stem + "_inductor.py").write_text(deployed.output_code)


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """An independent copy of ``graph`` (node metadata copied shallowly)."""
    copy = torch.fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    return copy


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


def _check_plan_fits(plan: Plan, opts: KareusOptions) -> None:
    """GPU, world size and stage (step 1 of the module docstring)."""
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


# ----- compile-time tuning ----------------------------------------------------------------------
_TUNED: set[Path] = set()


def _tuned_plan(opts: KareusOptions) -> Path:
    """Plan ``opts.tune_request`` once per process into ``opts.plan_out`` (module docstring)."""
    from kareus_fx.plan.request import PlanRequest, validate_plan_request

    if opts.plan_out is None:
        raise OptionsError(
            "option 'tune' needs 'plan_out' (where to write the plan); with 'tune_request' the tuner plans "
            "that reference model at full size, without it the live graph"
        )
    tune_request, profiler = opts.tune_request, opts.tune
    if tune_request is None or profiler is None:  # the backend sends 'tune' alone to LiveTuning
        raise OptionsError("option 'tune_request' plans a reference model and needs 'tune' (the profiler)")
    known = {f.name for f in dataclasses.fields(PlanRequest)} - {"gpu", "profiler"}
    unknown = sorted(set(tune_request) - known)
    if unknown:
        raise OptionsError(f"option 'tune_request': unknown field(s) {unknown}; valid: {sorted(known)}")
    try:
        request = PlanRequest(**tune_request, gpu=opts.gpu, profiler=profiler)
    except TypeError as err:
        raise OptionsError(f"option 'tune_request': {err}") from None
    validate_plan_request(request)
    path = opts.plan_out
    if path in _TUNED:
        return path
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        _plan_in_child(request, path)
    if distributed:
        dist.barrier()
    _TUNED.add(path)
    return path


def _plan_in_child(request: Any, path: Path) -> None:
    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_plan_worker, args=(request, str(path), send), name="kareus-tune")
    child.start()
    send.close()
    try:
        error = receive.recv()
    except EOFError:
        error = "the tuning process ended without a result (killed?)"
    child.join()
    if error is not None:
        raise KareusError(f"compile-time tuning failed: {error}")


def _plan_worker(request: Any, path: str, send: Any) -> None:
    from kareus_fx.plan.planner import make_plan

    try:
        write_plan(path, make_plan(request, Path(path).parent / (Path(path).stem + "-work"), progress=False).data)
        send.send(None)
    except BaseException as err:  # noqa: BLE001 - sent to the compiling process
        send.send(f"{type(err).__name__}: {err}")
