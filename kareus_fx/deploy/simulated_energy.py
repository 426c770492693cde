"""The simulated GPU's estimate of an iteration that ran on CPU: what the plan's ranks ran, priced.

On CPU no counter measures GPU energy (``runtime/energy.py`` reports None), so a run that follows
a plan cannot compare its energy with the plan's prediction. This prices the iteration that
actually ran on the plan's simulated GPU, from what each pipeline rank's clock controller received
(:class:`~kareus_fx.runtime.clock_controller.ClockRequest`: which (stage, instruction, microbatch), at
which clock, in which order):

- each instruction costs the time and energy of the plan's microbatch option it ran: the option
  the frontier point gives it when the requested clock is that option's, otherwise the option of
  the same kernel schedule at the requested clock (the fastest at that clock if none has it);
- the iteration's time is the critical path of the ranks' orders as run (one chain per GPU) and
  the pipeline's dependencies (a stage's forward after the previous stage's, its backward after
  the next stage's), as the planner composes 1F1B (``compose/pipeline_schedule.py``);
- every GPU waits at the blocking power when it runs nothing (Perseus's accounting), and the
  energy counts every GPU of the job: ``tp x cp x dp`` times each pipeline rank's.

The numbers are the cost model's, not a measurement: a run that follows the plan exactly
reproduces the plan's prediction; another order (GPipe), another clock or a missing instruction
gives another estimate. Assumes the requests come from a plan's deployment (``StepContext`` names
each instruction ``str(PipelineNode)``, e.g. ``F0@S1``) and that one entry per pipeline rank
(GPU) is given, its TP and CP peers running the same.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import networkx as nx

from kareus_fx.compose.pipeline_schedule import Instruction, PipelineNode, iteration_energy_j, makespan_s
from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.errors import KareusError
from kareus_fx.plan.plan_format import Plan, instruction_key
from kareus_fx.runtime.clock_controller import ClockRequest

__all__ = ["SimulatedIteration", "SimulationError", "parse_node", "simulated_iteration"]

_NODE = re.compile(r"([FB])(\d+)@S(\d+)")
_INSTRUCTIONS: dict[str, Instruction] = {"F": "forward", "B": "backward"}


class SimulationError(KareusError, ValueError):
    """Requests that do not describe instructions of the plan's pipeline."""


@dataclass(frozen=True)
class SimulatedIteration:
    """One iteration as the plan's simulated GPU prices what ran (module docstring)."""

    time_s: float
    energy_j: float
    instructions: int
    """Instructions priced, over every pipeline rank."""


def parse_node(text: str | None) -> PipelineNode:
    """The instruction a request names (``str(PipelineNode)``: ``F0@S1`` is the forward of
    microbatch 0 on stage 1)."""
    match = _NODE.fullmatch(text or "")
    if match is None:
        raise SimulationError(
            f"clock request for {text!r} names no pipeline instruction (expected e.g. 'F0@S1'); price the "
            f"requests of a plan's deployment (StepContext / follow_plan record each instruction)"
        )
    kind, microbatch, stage = match.groups()
    return PipelineNode(int(stage), _INSTRUCTIONS[kind], int(microbatch))


def simulated_iteration(plan: Plan, point_index: int, ranks: Sequence[Sequence[ClockRequest]]) -> SimulatedIteration:
    """Price one iteration: ``ranks[r]`` holds pipeline rank ``r``'s clock requests of the
    iteration, in the order it ran them (one rank per GPU of one pipeline, ``workload.pp`` of them)."""
    workload = plan.workload
    if len(ranks) != workload["pp"]:
        raise SimulationError(
            f"the plan {plan.source} has {workload['pp']} pipeline ranks but requests of {len(ranks)} were given; "
            f"give one rank's requests per pipeline stage rank (its TP and CP peers run the same)"
        )
    durations_s: dict[PipelineNode, float] = {}
    energies_j: dict[PipelineNode, float] = {}
    dag: nx.DiGraph = nx.DiGraph()
    for rank, requests in enumerate(ranks):
        nodes = [parse_node(request.instruction) for request in requests]
        for node, request in zip(nodes, requests):
            if node in durations_s:
                raise SimulationError(f"{node} ran twice in one iteration (rank {rank}); price one iteration at a time")
            if node.stage % workload["pp"] != rank:
                raise SimulationError(f"rank {rank} ran {node}, a stage of rank {node.stage % workload['pp']}")
            option = _option_run(plan, point_index, node, request.clock_mhz)
            durations_s[node], energies_j[node] = float(option["time_s"]), float(option["energy_j"])
        dag.add_nodes_from(nodes)
        dag.add_edges_from(itertools.pairwise(nodes))
    for node in list(dag.nodes):
        after = PipelineNode(node.stage + 1, node.instruction, node.microbatch)
        if after in durations_s:  # forward flows down the pipeline, backward up
            dag.add_edge(*((node, after) if node.instruction == "forward" else (after, node)))
    if not nx.is_directed_acyclic_graph(dag):
        raise SimulationError("the ranks' orders and the pipeline's dependencies form a cycle: not a run that ended")
    time_s = makespan_s(dag, durations_s)
    busy_s, busy_j = sum(durations_s.values()), sum(energies_j.values())
    blocking_w = gpu_spec(plan.gpu).blocking_power_w
    scale = workload["tp"] * workload["cp"] * workload.get("dp", 1)
    energy_j = scale * iteration_energy_j(workload["pp"], time_s, busy_s, busy_j, blocking_w)
    tail = plan.data.get("step_tail")  # the gradient sync and optimizer step after the last microbatch
    if tail is not None:
        time_s, energy_j = time_s + float(tail["time_s"]), energy_j + float(tail["energy_j"])
    return SimulatedIteration(time_s=time_s, energy_j=energy_j, instructions=len(durations_s))


def _option_run(plan: Plan, point_index: int, node: PipelineNode, clock_mhz: int) -> Mapping[str, Any]:
    """The microbatch option ``node`` ran at ``clock_mhz`` (module docstring)."""
    try:
        planned = plan.option(point_index, node.stage, node.instruction, node.microbatch)
    except (KeyError, IndexError):
        raise SimulationError(f"{node} is not an instruction of the plan {plan.source}'s pipeline") from None
    if planned["clock_mhz"] == clock_mhz:
        return planned
    options = cast(
        Sequence[Mapping[str, Any]], plan.data["microbatch_options"][instruction_key(node.stage, node.instruction)]
    )
    at_clock = [o for o in options if o["clock_mhz"] == clock_mhz]
    if not at_clock:
        raise SimulationError(
            f"{node} ran at {clock_mhz} MHz, a clock the plan {plan.source} has no option of; the simulated "
            f"GPU prices the clocks the plan tuned ({sorted({o['clock_mhz'] for o in options})})"
        )
    same = [o for o in at_clock if (o["sequential"], o["configs"]) == (planned["sequential"], planned["configs"])]
    return min(same or at_clock, key=lambda o: float(o["time_s"]))
