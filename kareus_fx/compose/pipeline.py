"""The synchronous 1F1B pipeline schedule as a DAG of (stage, instruction, microbatch) nodes.

Every stage runs its microbatches' forward and backward instructions in 1F1B order: stage ``s`` of
``S`` first runs ``min(S - s, N)`` forwards, then alternates one backward and one forward, then
drains the remaining backwards. This is the order of DeepSpeed's ``TrainSchedule`` and of
``lowtime.perseus.schedule.Synchronous1F1B`` (what Perseus plans on), and the same sequence as
Megatron-LM's 1F1B with ``S - s - 1`` warm-up forwards; ``tests/test_compose.py`` checks it
against lowtime's.

Edges (the dependencies Perseus uses): consecutive instructions of one stage;
forward ``(s, m) -> (s + 1, m)``; backward ``(s + 1, m) -> (s, m)``. The last stage's forward of
``m`` precedes its backward of ``m`` through the stage order.

The DAG here is plain data (networkx with :class:`PipelineNode` nodes); ``iteration.py`` puts
lowtime operations on it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import networkx as nx

from kareus_fx.errors import KareusError

Instruction = Literal["forward", "backward"]
INSTRUCTIONS: tuple[Instruction, ...] = ("forward", "backward")


class CompositionError(KareusError, ValueError):
    """Inputs from which no microbatch or iteration frontier can be composed."""


@dataclass(frozen=True, order=True)
class PipelineNode:
    """One instruction of one microbatch on one pipeline stage."""

    stage: int
    instruction: Instruction
    microbatch: int

    def __str__(self) -> str:
        return f"{self.instruction[0].upper()}{self.microbatch}@S{self.stage}"


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise CompositionError(f"num_stages must be a positive integer, got {num_stages!r}")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise CompositionError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")


def one_f_one_b_order(num_stages: int, num_microbatches: int, stage: int) -> list[tuple[Instruction, int]]:
    """The (instruction, microbatch) sequence that ``stage`` runs under 1F1B."""
    _check_sizes(num_stages, num_microbatches)
    if not 0 <= stage < num_stages:
        raise CompositionError(f"stage {stage} is outside 0..{num_stages - 1}")
    warmup = min(num_stages - stage, num_microbatches)
    order: list[tuple[Instruction, int]] = [("forward", m) for m in range(warmup)]
    next_forward = warmup
    for m in range(num_microbatches):
        order.append(("backward", m))
        if next_forward < num_microbatches:
            order.append(("forward", next_forward))
            next_forward += 1
    return order


def build_1f1b_dag(num_stages: int, num_microbatches: int) -> nx.DiGraph:
    """The 1F1B dependency DAG (no source or sink node; nodes are :class:`PipelineNode`)."""
    _check_sizes(num_stages, num_microbatches)
    dag = nx.DiGraph()
    for stage in range(num_stages):
        nodes = [PipelineNode(stage, inst, mb) for inst, mb in one_f_one_b_order(num_stages, num_microbatches, stage)]
        dag.add_nodes_from(nodes)
        dag.add_edges_from(itertools.pairwise(nodes))
    for stage in range(num_stages - 1):
        for mb in range(num_microbatches):
            dag.add_edge(PipelineNode(stage, "forward", mb), PipelineNode(stage + 1, "forward", mb))
            dag.add_edge(PipelineNode(stage + 1, "backward", mb), PipelineNode(stage, "backward", mb))
    return dag


def makespan_s(dag: nx.DiGraph, durations_s: Mapping[PipelineNode, float]) -> float:
    """Length of the longest path through ``dag`` when each node takes ``durations_s[node]``.

    Every instruction starts as soon as its predecessors finish (the critical path of the plan).
    """
    finish: dict[PipelineNode, float] = {}
    for node in nx.topological_sort(dag):
        start = max((finish[p] for p in dag.predecessors(node)), default=0.0)
        finish[node] = start + durations_s[node]
    return max(finish.values(), default=0.0)


def iteration_energy_j(
    num_stages: int,
    time_s: float,
    busy_time_s: float,
    busy_energy_j: float,
    blocking_power_w: float,
) -> float:
    """Energy of one iteration on ``num_stages`` GPUs (one per stage).

    Each GPU is busy running instructions (``busy_*`` summed over every instruction of every
    stage) or blocked waiting on pipeline communication for the rest of the iteration, at
    ``blocking_power_w`` (Perseus's accounting: the idle time of bubbles counts at the GPU's
    communication-blocking power).
    """
    idle_s = num_stages * time_s - busy_time_s
    return busy_energy_j + blocking_power_w * idle_s
