"""lowtime's Phillips-Dessouky iteration with its Python bookkeeping on index lists.

``lowtime.solver.PhillipsDessouky.run`` spends most of each step outside the max-flow: every
step it rebuilds the critical DAG with networkx (a DAG check, two topological sorts, attribute
writes through attrs setters on every operation, a full graph copy), annotates its edges and
converts it to the Rust solver's input; on a 10-stage x 128-microbatch 1F1B DAG that is more
than half of a step, and the graphs it allocates every step set off the garbage collector over
the caller's whole heap. This module drives the same iteration with no graph built per step:

- lowtime builds the activity-on-arc DAG once (``aon_dag_to_aoa_dag``) and finds each step's
  minimum cut (its Rust ``PhillipsDessouky.find_min_cut``);
- here, over the AOA edges in lowtime's order, fixed up front: the earliest and latest event
  times (integer durations, so exact) and the critical edges (zero total float); each critical
  edge's flow bounds by lowtime's rule (``PhillipsDessouky.annotate_capacities``: the cost of
  one unit faster and of one unit slower from the operation's own cost model, rounded down to
  ``FP_ERROR``); the Rust input as ``format_rust_inputs`` writes it (every AOA node in order,
  the critical edges in order, no capacity or flow); and the duration changes across the cut
  as ``PhillipsDessouky.reduce_durations`` makes them (the operations' ``duration`` set in
  place, cut nodes visited in the order the min-cut returns them, edges in graph order), with
  its stopping rule.

The min-cut sees the input lowtime's loop would give it, so it returns the same cut.
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

_UNBOUNDED_FLOW = 10000.0
"""lowtime's flow bound for an edge that does not constrain the flow (``annotate_capacities``)."""


@dataclass(frozen=True)
class SolverStep:
    """State after one solver step (lowtime's ``IterationResult`` fields that are used)."""

    quant_time: int
    """Quantized iteration time (critical path in time units)."""
    cost: float
    """Sum of the cost model over all operations at their current durations."""


class _AOASchedule:
    """The AOA DAG's edges as index lists, with each operation's current duration and cost."""

    def __init__(self, aoa: nx.DiGraph, attr_name: str) -> None:
        self.node_ids = list(aoa.nodes)
        position = {node: i for i, node in enumerate(self.node_ids)}
        edges = list(aoa.edges(data=attr_name))
        self.edge_ends = [(position[u], position[v]) for u, v, _ in edges]
        self.edge_ids = [(u, v) for u, v, _ in edges]
        self.ops: list[Operation] = [op for _, _, op in edges]
        self.real = [e for e, op in enumerate(self.ops) if not op.is_dummy]
        order = {position[node]: rank for rank, node in enumerate(nx.topological_sort(aoa))}
        indices = range(len(edges))
        self.forward_order = sorted(indices, key=lambda e: order[self.edge_ends[e][0]])
        self.backward_order = sorted(indices, key=lambda e: -order[self.edge_ends[e][1]])
        self.source, self.sink = aoa.graph["source_node"], aoa.graph["sink_node"]
        self.sink_position = position[self.sink]
        for e in self.real:
            self.ops[e].duration = self.ops[e].max_duration  # lowtime's start: every operation slowest
        self.durations = [0 if op.is_dummy else op.duration for op in self.ops]
        self.costs = {e: self.ops[e].get_cost() for e in self.real}

    def total_cost(self) -> float:
        return sum(self.costs[e] for e in self.real)

    def critical_edges(self) -> tuple[list[int], int]:
        """The zero-float edges (in graph order) and the critical path length."""
        durations, ends = self.durations, self.edge_ends
        earliest = [0] * len(self.node_ids)
        for e in self.forward_order:
            u, v = ends[e]
            finish = earliest[u] + durations[e]
            if finish > earliest[v]:
                earliest[v] = finish
        total = earliest[self.sink_position]
        latest = [total] * len(self.node_ids)
        for e in self.backward_order:
            u, v = ends[e]
            start = latest[v] - durations[e]
            if start < latest[u]:
                latest[u] = start
        return [e for e, ((u, v), d) in enumerate(zip(ends, durations)) if earliest[u] + d == latest[v]], total

    def flow_bounds(self, e: int) -> tuple[float, float]:
        """(lower, upper) flow bound of edge ``e`` (``annotate_capacities``'s rule)."""
        op = self.ops[e]
        if op.is_dummy:
            lb, ub = 0.0, _UNBOUNDED_FLOW
        else:
            duration = self.durations[e]
            if duration == op.min_duration == op.max_duration:
                lb, ub = 0.0, _UNBOUNDED_FLOW
            elif duration - 1 < op.min_duration:
                lb, ub = abs(op.get_cost(duration) - op.get_cost(duration + 1)), _UNBOUNDED_FLOW
            elif duration + 1 > op.max_duration:
                lb, ub = 0.0, abs(op.get_cost(duration - 1) - op.get_cost(duration))
            else:
                lb = abs(op.get_cost(duration) - op.get_cost(duration + 1))
                ub = abs(op.get_cost(duration - 1) - op.get_cost(duration)) + FP_ERROR
        return lb // FP_ERROR * FP_ERROR, ub // FP_ERROR * FP_ERROR

    def min_cut(self, critical: list[int]) -> tuple[set[int], set[int]]:
        """lowtime's Rust min-cut of the critical edges (raises ``LowtimeFlowError``).

        The Rust solver gets only the nodes the critical edges touch (lowtime passes every AOA
        node): a node without a critical edge carries no flow and is on no residual path, so the
        cut over the critical edges is the same (``reduce_durations`` reads only those), and
        the solver's per-node work shrinks (about 7 % of a 10-stage x 128-microbatch solve)."""
        edges = []
        touched = {self.source, self.sink}
        for e in critical:
            lb, ub = self.flow_bounds(e)
            edges.append((self.edge_ids[e], (0.0, 0.0, ub, lb)))
            touched.update(self.edge_ids[e])
        nodes = [node for node in self.node_ids if node in touched]
        return _lowtime_rs.PhillipsDessouky(FP_ERROR, nodes, self.source, self.sink, edges).find_min_cut()

    def reduce_durations(self, critical: list[int], s_set: set[int], t_set: set[int]) -> float:
        """Speed up the critical edges from ``s_set`` to ``t_set`` and slow down those back by one
        unit (``reduce_durations``); the cost change, inf where an operation is at its limit."""
        out_edges: dict[int, list[int]] = {}
        for e in critical:
            out_edges.setdefault(self.edge_ids[e][0], []).append(e)
        speed_up = [e for u in s_set for e in out_edges.get(u, ()) if self.edge_ids[e][1] in t_set]
        slow_down = [e for u in t_set for e in out_edges.get(u, ()) if self.edge_ids[e][1] in s_set]
        if not speed_up:
            return 0.0
        cost_change = 0.0
        for e in speed_up:
            op = self.ops[e]
            if op.is_dummy or self.durations[e] - 1 < op.min_duration:
                return float("inf")
            cost_change += abs(op.get_cost(self.durations[e] - 1) - op.get_cost(self.durations[e]))
            self._set_duration(e, self.durations[e] - 1)
        for e in slow_down:
            op = self.ops[e]
            if op.is_dummy:
                continue
            if self.durations[e] + 1 > op.max_duration:
                return float("inf")
            cost_change -= abs(op.get_cost(self.durations[e]) - op.get_cost(self.durations[e] + 1))
            self._set_duration(e, self.durations[e] + 1)
        return cost_change

    def _set_duration(self, e: int, duration: int) -> None:
        op = self.ops[e]
        op.duration = duration  # lowtime's setter also picks the knob (assigned_knob)
        self.durations[e] = duration
        self.costs[e] = op.get_cost()


def run_phillips_dessouky(aon_dag: nx.DiGraph, attr_name: str = "op") -> Iterator[SolverStep]:
    """Shorten the DAG one time unit per step, yielding after each step (lowtime's iteration).

    Same input contract as ``lowtime.solver.PhillipsDessouky`` (one annotated source and sink,
    operations on nodes under ``attr_name``, one ``unit_time``), and, like it, it changes the
    operations' ``duration`` (hence ``assigned_knob``) in place. Stops when no further
    shortening is possible.
    """
    PhillipsDessouky(aon_dag, attr_name=attr_name)  # checks the input contract
    schedule = _AOASchedule(aon_dag_to_aoa_dag(aon_dag, attr_name=attr_name), attr_name)
    critical, _ = schedule.critical_edges()
    while True:
        try:
            s_set, t_set = schedule.min_cut(critical)
        except LowtimeFlowError:
            return
        cost_change = schedule.reduce_durations(critical, s_set, t_set)
        if cost_change == float("inf") or abs(cost_change) < FP_ERROR:
            return
        critical, total = schedule.critical_edges()
        yield SolverStep(quant_time=total, cost=schedule.total_cost())
