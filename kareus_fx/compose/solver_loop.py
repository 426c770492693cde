"""lowtime's Phillips-Dessouky iteration with the critical-path bookkeeping on index lists.

``lowtime.solver.PhillipsDessouky.run`` spends most of each step outside the max-flow: every
step it rebuilds the critical DAG with networkx (a DAG check, two topological sorts, attribute
writes through attrs setters on every operation, a full graph copy). On the 1F1B DAG that is
60-80% of a step. This module drives the same iteration with that one part replaced:

- lowtime builds the activity-on-arc DAG (``aon_dag_to_aoa_dag``), annotates the flow bounds
  (``PhillipsDessouky.annotate_capacities``), finds the minimum cut (its Rust
  ``find_min_cut``, fed by ``format_rust_inputs``) and changes the durations
  (``PhillipsDessouky.reduce_durations``), exactly as in its own loop;
- here: the earliest and latest event times of the AOA DAG, computed once per step over a
  topological order fixed up front (integer durations, so exact), and the critical DAG built
  from the zero-float edges in lowtime's own node and edge order (the max-flow sees the same
  input, so it returns the same cut).

Assumption: an AOA edge is critical exactly when it has zero total float, i.e. when
``earliest(tail) + duration == latest(head)`` (the critical-path-method definition lowtime uses).
``tests/test_compose.py`` checks that both loops walk the same plans step by step.

Uses ``lowtime._lowtime_rs`` (the min-cut lowtime's loop calls; written against lowtime 0.3.0).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import networkx as nx
from lowtime import _lowtime_rs
from lowtime.exceptions import LowtimeFlowError
from lowtime.graph_utils import aon_dag_to_aoa_dag
from lowtime.operation import Operation
from lowtime.solver import FP_ERROR, PhillipsDessouky

__all__ = ["SolverStep", "run_phillips_dessouky"]


@dataclass(frozen=True)
class SolverStep:
    """State after one solver step (lowtime's ``IterationResult`` fields that are used)."""

    quant_time: int
    """Quantized iteration time (critical path in time units)."""
    cost: float
    """Sum of the cost model over all operations at their current durations."""


class _CriticalPath:
    """Earliest/latest event times and zero-float edges of a fixed AOA DAG."""

    def __init__(self, aoa: nx.DiGraph, attr_name: str) -> None:
        self.nodes = list(aoa.nodes)
        position = {node: i for i, node in enumerate(self.nodes)}
        edges = list(aoa.edges(data=attr_name))
        self.edge_ends = [(position[u], position[v]) for u, v, _ in edges]
        self.edge_nodes = [(u, v) for u, v, _ in edges]
        self.edge_ops: list[Operation] = [op for _, _, op in edges]
        self.real_ops = [op for op in self.edge_ops if not op.is_dummy]
        order = {position[node]: rank for rank, node in enumerate(nx.topological_sort(aoa))}
        indices = range(len(edges))
        self.forward_order = sorted(indices, key=lambda e: order[self.edge_ends[e][0]])
        self.backward_order = sorted(indices, key=lambda e: -order[self.edge_ends[e][1]])
        self.sink = position[aoa.graph["sink_node"]]
        self.graph_attrs = dict(aoa.graph)
        self.attr_name = attr_name

    def durations(self) -> list[int]:
        return [0 if op.is_dummy else op.duration for op in self.edge_ops]

    def total_cost(self) -> float:
        return sum(op.get_cost() for op in self.real_ops)

    def _earliest(self, durations: list[int]) -> list[int]:
        earliest = [0] * len(self.nodes)
        ends = self.edge_ends
        for e in self.forward_order:
            u, v = ends[e]
            finish = earliest[u] + durations[e]
            if finish > earliest[v]:
                earliest[v] = finish
        return earliest

    def critical_dag(self) -> tuple[nx.DiGraph, int]:
        """The DAG of zero-float edges (all nodes kept, lowtime's order) and the total time."""
        durations = self.durations()
        earliest = self._earliest(durations)
        total = earliest[self.sink]
        latest = [total] * len(self.nodes)
        ends = self.edge_ends
        for e in self.backward_order:
            u, v = ends[e]
            start = latest[v] - durations[e]
            if start < latest[u]:
                latest[u] = start
        dag = nx.DiGraph()
        dag.graph.update(self.graph_attrs)
        dag.add_nodes_from(self.nodes)
        name = self.attr_name
        dag.add_edges_from(
            (u, v, {name: op})
            for (u, v), (iu, iv), d, op in zip(self.edge_nodes, ends, durations, self.edge_ops)
            if earliest[iu] + d == latest[iv]
        )
        return dag, total


def run_phillips_dessouky(aon_dag: nx.DiGraph, attr_name: str = "op") -> Iterator[SolverStep]:
    """Shorten the DAG one time unit per step, yielding after each step (lowtime's iteration).

    Same input contract as ``lowtime.solver.PhillipsDessouky`` (one annotated source and sink,
    operations on nodes under ``attr_name``, one ``unit_time``), and, like it, it changes the
    operations' ``duration`` (hence ``assigned_knob``) in place. Stops when no further
    shortening is possible.
    """
    solver = PhillipsDessouky(aon_dag, attr_name=attr_name)  # checks the input contract
    aoa = aon_dag_to_aoa_dag(aon_dag, attr_name=attr_name)
    path = _CriticalPath(aoa, attr_name)
    for op in path.real_ops:
        op.duration = op.max_duration  # lowtime's starting point: every operation slowest
    critical, _ = path.critical_dag()
    while True:
        solver.annotate_capacities(critical)
        nodes, edges = solver.format_rust_inputs(critical)
        try:
            s_set, t_set = _lowtime_rs.PhillipsDessouky(
                FP_ERROR,
                nodes,
                critical.graph["source_node"],
                critical.graph["sink_node"],
                edges,
            ).find_min_cut()
        except LowtimeFlowError:
            return
        cost_change = solver.reduce_durations(critical, s_set, t_set)
        if cost_change == float("inf") or abs(cost_change) < FP_ERROR:
            return
        critical, total = path.critical_dag()
        yield SolverStep(quant_time=total, cost=path.total_cost())
