"""Pipeline schedules as DAGs of (stage, instruction, microbatch) nodes: 1F1B and interleaved 1F1B.

Every stage runs its microbatches' forward and backward instructions in 1F1B order: stage ``s`` of
``S`` first runs ``min(S - s, N)`` forwards, then alternates one backward and one forward, then
drains the remaining backwards. This is the order of DeepSpeed's ``TrainSchedule`` and of
``lowtime.perseus.schedule.Synchronous1F1B`` (what Perseus plans on), and the same sequence as
Megatron-LM's 1F1B with ``S - s - 1`` warm-up forwards; ``tests/test_compose.py`` checks it
against lowtime's.

Edges (the dependencies Perseus uses): consecutive instructions of one stage;
forward ``(s, m) -> (s + 1, m)``; backward ``(s + 1, m) -> (s, m)``. The last stage's forward of
``m`` precedes its backward of ``m`` through the stage order.

Interleaved 1F1B (virtual pipeline stages, Narayanan et al. 2021, section 2.2; Megatron-LM's
``--num-layers-per-virtual-pipeline-stage``, ``torch.distributed.pipelining.ScheduleInterleaved1F1B``):
``R`` ranks each hold ``V`` model chunks; the ``R x V`` stages are numbered globally (PyTorch's
``stage_index``) and rank ``r`` holds stages ``r, r + R, ..., r + (V - 1) R`` (the looping placement).
Microbatches go through in rounds of ``G = M / max(1, M // R)`` (``R`` when ``M`` is a multiple of
``R``); the ``k``-th forward a rank runs is on its chunk ``(k // G) mod V``, the ``k``-th backward on
chunk ``V - 1 - (k // G) mod V``, each chunk taking its microbatches in order. Rank ``r`` first runs
``min(M V, (V - 1) G + 2 (R - 1 - r))`` forwards (the warm-up), then alternates one forward and one
backward, then drains the backwards. ``tests/test_interleaved.py`` checks the per-rank order against
the action lists ``ScheduleInterleaved1F1B`` executes. The edges are the same as 1F1B's over global
stages: the rank's consecutive instructions, forward ``(g, m) -> (g + 1, m)`` and backward
``(g + 1, m) -> (g, m)``; ``V = 1`` is plain 1F1B (:func:`build_1f1b_dag`).

The DAG here is plain data (networkx with :class:`PipelineNode` nodes); ``iteration.py`` puts
lowtime operations on it. The planner asks for the same pipeline's DAG and critical path many
times (each method's quantum search, each solve, each power limit: building the 70B PP10 x 128
DAG takes about 0.3 s and a networkx longest path about 0.1 s), so :func:`pipeline_dag` keeps
each size's DAG, frozen, and :func:`pipeline_makespan_s` its longest path levelled in numpy
(``critical_path.NodeWeightedDag``: the same float sums as :func:`makespan_s`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import networkx as nx
import numpy as np

from kareus_fx.compose.critical_path import NodeWeightedDag
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


def check_interleaving(num_ranks: int, virtual_stages: int, num_microbatches: int) -> int:
    """Check the interleaved schedule's sizes; the microbatches per round (``virtual_stages=1``:
    1F1B, one round of any count)."""
    _check_sizes(num_ranks, num_microbatches)
    if not isinstance(virtual_stages, int) or isinstance(virtual_stages, bool) or virtual_stages < 1:
        raise CompositionError(f"virtual_stages must be a positive integer, got {virtual_stages!r}")
    if virtual_stages == 1:  # plain 1F1B: any count
        return num_microbatches
    if num_microbatches < num_ranks:
        raise CompositionError(
            f"interleaved 1F1B over {num_ranks} ranks needs at least {num_ranks} microbatches, got "
            f"{num_microbatches}; use more microbatches or virtual_stages=1"
        )
    rounds = max(1, num_microbatches // num_ranks)
    if num_microbatches % rounds:
        raise CompositionError(
            f"interleaved 1F1B runs microbatches in {rounds} equal rounds, but {num_microbatches} microbatches "
            f"do not divide into {rounds}; use a multiple of {num_ranks} microbatches"
        )
    return num_microbatches // rounds


def interleaved_order(
    num_ranks: int, virtual_stages: int, num_microbatches: int, rank: int
) -> list[tuple[int, Instruction, int]]:
    """The (global stage, instruction, microbatch) sequence that ``rank`` runs under interleaved
    1F1B with ``virtual_stages`` chunks per rank (module docstring). ``virtual_stages=1`` gives
    :func:`one_f_one_b_order`'s sequence."""
    if virtual_stages == 1:
        return [(rank, inst, mb) for inst, mb in one_f_one_b_order(num_ranks, num_microbatches, rank)]
    per_round = check_interleaving(num_ranks, virtual_stages, num_microbatches)
    if not 0 <= rank < num_ranks:
        raise CompositionError(f"rank {rank} is outside 0..{num_ranks - 1}")
    total = virtual_stages * num_microbatches
    warmup = min(total, (virtual_stages - 1) * per_round + 2 * (num_ranks - 1 - rank))
    next_microbatch: dict[tuple[Instruction, int], int] = {}

    def run(instruction: Instruction, k: int) -> tuple[int, Instruction, int]:
        chunk = (k // per_round) % virtual_stages
        if instruction == "backward":
            chunk = virtual_stages - 1 - chunk
        microbatch = next_microbatch.get((instruction, chunk), 0)
        next_microbatch[(instruction, chunk)] = microbatch + 1
        return chunk * num_ranks + rank, instruction, microbatch

    order = [run("forward", k) for k in range(warmup)]
    for k in range(total - warmup):
        order.append(run("forward", warmup + k))
        order.append(run("backward", k))
    order.extend(run("backward", k) for k in range(total - warmup, total))
    return order


def build_pipeline_dag(num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> nx.DiGraph:
    """The dependency DAG of 1F1B (``virtual_stages=1``: :func:`build_1f1b_dag`) or interleaved
    1F1B over ``num_ranks x virtual_stages`` global stages (nodes are :class:`PipelineNode`)."""
    if virtual_stages == 1:
        return build_1f1b_dag(num_ranks, num_microbatches)
    check_interleaving(num_ranks, virtual_stages, num_microbatches)
    dag = nx.DiGraph()
    for rank in range(num_ranks):
        nodes = [
            PipelineNode(*action) for action in interleaved_order(num_ranks, virtual_stages, num_microbatches, rank)
        ]
        dag.add_nodes_from(nodes)
        dag.add_edges_from(itertools.pairwise(nodes))
    for stage in range(num_ranks * virtual_stages - 1):
        for mb in range(num_microbatches):
            dag.add_edge(PipelineNode(stage, "forward", mb), PipelineNode(stage + 1, "forward", mb))
            dag.add_edge(PipelineNode(stage + 1, "backward", mb), PipelineNode(stage, "backward", mb))
    if not nx.is_directed_acyclic_graph(dag):  # a schedule that would deadlock: a bug here, not bad input
        raise AssertionError(f"interleaved 1F1B order for {num_ranks} ranks x {virtual_stages} chunks deadlocks")
    return dag


@functools.lru_cache(maxsize=8)
def pipeline_dag(num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> nx.DiGraph:
    """:func:`build_pipeline_dag`'s DAG, built once per size and frozen (``nx.freeze``: callers
    share it, so none may change it; its node order is a fresh build's)."""
    return nx.freeze(build_pipeline_dag(num_ranks, num_microbatches, virtual_stages))


@functools.lru_cache(maxsize=8)
def _levelled(num_ranks: int, num_microbatches: int, virtual_stages: int) -> tuple[list[PipelineNode], NodeWeightedDag]:
    """The pipeline's nodes (topological order) and its node-weighted DAG over their indices."""
    dag = pipeline_dag(num_ranks, num_microbatches, virtual_stages)
    nodes = list(nx.topological_sort(dag))
    index = {node: i for i, node in enumerate(nodes)}
    return nodes, NodeWeightedDag([[index[p] for p in dag.predecessors(node)] for node in nodes])


def pipeline_makespan_s(
    num_ranks: int,
    num_microbatches: int,
    virtual_stages: int,
    duration_s: Callable[[PipelineNode], float],
) -> float:
    """:func:`makespan_s` of the pipeline's DAG when each node takes ``duration_s(node)``; the
    same sums and maxima, so the same float (``tests/test_compose.py`` compares them)."""
    nodes, levelled = _levelled(num_ranks, num_microbatches, virtual_stages)
    durations = np.fromiter((duration_s(node) for node in nodes), dtype=np.float64, count=len(nodes))
    return levelled.longest_path(durations) if nodes else 0.0


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
    num_gpus: int,
    time_s: float,
    busy_time_s: float,
    busy_energy_j: float,
    blocking_power_w: float,
) -> float:
    """Energy of one iteration on ``num_gpus`` GPUs (one per rank: a rank with several virtual
    stages is one GPU).

    Each GPU is busy running instructions (``busy_*`` summed over every instruction of every
    stage) or blocked waiting on pipeline communication for the rest of the iteration, at
    ``blocking_power_w`` (Perseus's accounting: the idle time of bubbles counts at the GPU's
    communication-blocking power).
    """
    idle_s = num_gpus * time_s - busy_time_s
    return busy_energy_j + blocking_power_w * idle_s
