"""lowtime's Phillips-Dessouky iteration with its Python bookkeeping on index arrays, and a faster min-cut.

``lowtime.solver.PhillipsDessouky.run`` spends most of each step outside the max-flow: every
step it rebuilds the critical DAG with networkx (a DAG check, two topological sorts, attribute
writes through attrs setters on every operation, a full graph copy), annotates its edges and
converts it to the Rust solver's input; on a 10-stage x 128-microbatch 1F1B DAG that is more
than half of a step, and the graphs it allocates every step set off the garbage collector over
the caller's whole heap. This module drives the same iteration with no graph built per step:

- lowtime builds the activity-on-arc DAG once (``aon_dag_to_aoa_dag``);
- here, over the AOA edges in lowtime's order, fixed up front: the earliest and latest event
  times (integer durations, so exact) and the critical edges (zero total float); each critical
  edge's flow bounds by lowtime's rule (``PhillipsDessouky.annotate_capacities``: the cost of
  one unit faster and of one unit slower from the operation's own cost model, rounded down to
  ``FP_ERROR``), from a table of each operation's cost at every duration it can take; and the
  duration changes across the cut as ``PhillipsDessouky.reduce_durations`` makes them, with its
  stopping rule.

Minimum cut (``min_cut``):

- ``"dinic"`` (default): SciPy's Dinic max-flow (``scipy.sparse.csgraph.maximum_flow``) on one
  network without lower bounds. lowtime's cut minimizes, over node sets ``S`` holding the source
  and not the sink, ``sum(ub over edges S -> not S) - sum(lb over edges not S -> S)``; it gets
  there with two max-flows (a feasible flow within the bounds, then a max-flow on its residual)
  and takes ``S`` = the nodes its residual reaches from the source. The same function is
  ``sum(ub - lb over S -> not S) + sum(d(v) for v in S)`` with ``d(v)`` the lower bounds leaving
  ``v`` minus those entering it, i.e. a plain min cut with an edge ``v -> sink`` of capacity
  ``d(v)`` where ``d(v) > 0`` and ``source -> v`` of ``-d(v)`` where ``d(v) < 0`` (plus a
  constant). Its residual's reach from the source is the smallest minimizing ``S``, the set
  lowtime's residual reaches (both are the least minimizer of the same function) up to
  lowtime's float tolerance: lowtime walks only residual edges with more than ``FP_ERROR``
  left, and its float flows leave some edges at about exactly ``FP_ERROR`` (the ``+ FP_ERROR``
  room it gives ``ub``), so there its cut goes either way; here the arithmetic is exact (a
  walk that also skipped ``FP_ERROR`` residuals took cuts that are not minimal and stopped the
  8 x 24 sweep of ``bench/compose_scaling.py`` after 29 of 2352 steps). The bounds are
  multiples of ``FP_ERROR`` (lowtime rounds them so), so the capacities are integers in
  ``FP_ERROR`` units, coarsened by a power of two where the imbalances would not fit SciPy's
  int32; an unbounded edge (lowtime's 10000) gets ``2**30`` units and a super-source caps the
  flow there, so nothing overflows. Where the cut would be worth ``2**30`` units or more, a
  path of unbounded edges from the source to the sink means the solve ends there (every cut
  speeds up an operation that cannot go faster: ``_NoFiniteCut``; a solve's last step); without
  one (no finite cut that small) the step asks lowtime's own min-cut; where no flow meets the bounds
  (lowtime's first max-flow does not saturate: its ``LowtimeFlowError``) the solve ends, as
  lowtime's does. Measured (``bench/compose_scaling.py``): the frontier within 0.04 % of the
  exact one at 8 x 24 and 1 ms, identical at the planner's 500-step quantum.
- ``"lowtime"``: lowtime's Rust ``PhillipsDessouky.find_min_cut`` (Edmonds-Karp; the reference,
  and most of a step's time: about 0.35 s a step against about 10 ms on the 70B PP10 x 128
  critical DAGs of 500 to 6500 edges).

Assumption: an AOA edge is critical exactly when it has zero total float, i.e. when
``earliest(tail) + duration == latest(head)`` (the critical-path-method definition lowtime uses).
``tests/test_compose.py`` checks that every loop and min-cut walks the same plans step by step.

Uses ``lowtime._lowtime_rs`` (the min-cut lowtime's loop calls; written against lowtime 0.3.0).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import networkx as nx
import numpy as np
import scipy.sparse as sp
from lowtime import _lowtime_rs
from lowtime.exceptions import LowtimeFlowError
from lowtime.graph_utils import aon_dag_to_aoa_dag
from lowtime.operation import Operation
from lowtime.solver import FP_ERROR, PhillipsDessouky
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

from kareus_fx.compose.critical_path import LevelledDag

__all__ = ["MIN_CUTS", "MinCut", "SolverStep", "run_phillips_dessouky"]

MinCut = Literal["dinic", "lowtime"]
MIN_CUTS: tuple[MinCut, ...] = ("dinic", "lowtime")

_UNBOUNDED_FLOW = 10000.0
"""lowtime's flow bound for an edge that does not constrain the flow (``annotate_capacities``)."""
_BIG_UNITS = 2**30
"""An unbounded edge's capacity in ``FP_ERROR`` units, and the most flow a Dinic min-cut sends
(int32 holds twice that: no capacity, flow or residual overflows)."""


@dataclass(frozen=True)
class SolverStep:
    """State after one solver step (lowtime's ``IterationResult`` fields that are used)."""

    quant_time: int
    """Quantized iteration time (critical path in time units)."""
    cost: float
    """Sum of the cost model over all operations at their current durations."""


class _AOASchedule:
    """The AOA DAG's edges as index arrays, with each operation's current duration and cost."""

    def __init__(self, aoa: nx.DiGraph, attr_name: str) -> None:
        self.node_ids = list(aoa.nodes)
        self.position = position = {node: i for i, node in enumerate(self.node_ids)}
        edges = list(aoa.edges(data=attr_name))
        self.edge_ends = [(position[u], position[v]) for u, v, _ in edges]
        self.edge_ids = [(u, v) for u, v, _ in edges]
        self.tails = np.array([u for u, _ in self.edge_ends], dtype=np.int64)
        self.heads = np.array([v for _, v in self.edge_ends], dtype=np.int64)
        self.ops: list[Operation] = [op for _, _, op in edges]
        self.real = [e for e, op in enumerate(self.ops) if not op.is_dummy]
        self.source, self.sink = aoa.graph["source_node"], aoa.graph["sink_node"]
        self.source_position, self.sink_position = position[self.source], position[self.sink]
        self.levelled = LevelledDag(
            len(self.node_ids), self.tails, self.heads, self.source_position, self.sink_position
        )
        for e in self.real:
            self.ops[e].duration = self.ops[e].max_duration  # lowtime's start: every operation slowest
        self.durations = [0 if op.is_dummy else op.duration for op in self.ops]
        self.duration_array = np.asarray(self.durations, dtype=np.int64)
        """``durations`` as an array (kept equal)."""
        self.real_costs = [self.ops[e].get_cost() for e in self.real]
        """Each real operation's current cost, in ``real``'s order (summed in that order each step)."""
        self.real_slot = {e: k for k, e in enumerate(self.real)}
        # Per edge: its duration range and its cost at every duration in it (dummies: none).
        dummy = np.array([op.is_dummy for op in self.ops], dtype=bool)
        self.min_durations = np.array([0 if op.is_dummy else op.min_duration for op in self.ops], dtype=np.int64)
        self.max_durations = np.array([0 if op.is_dummy else op.max_duration for op in self.ops], dtype=np.int64)
        width = int((self.max_durations - self.min_durations).max(initial=0)) + 1
        self.cost_table = np.zeros((len(edges), width))
        for e in self.real:
            op = self.ops[e]
            for d in range(op.min_duration, op.max_duration + 1):
                self.cost_table[e, d - op.min_duration] = op.get_cost(d)
        self.fixed = dummy | (self.min_durations == self.max_durations)
        """Edges whose flow is unbounded whatever their duration: dummies and one-duration operations."""

    def total_cost(self) -> float:
        return sum(self.real_costs)

    def critical_edges(self) -> tuple[list[int], int]:
        """The zero-float edges (in graph order) and the critical path length."""
        earliest, latest = self.levelled.event_times(self.duration_array)
        zero_float = earliest[self.tails] + self.duration_array == latest[self.heads]
        return np.flatnonzero(zero_float).tolist(), int(earliest[self.sink_position])

    def flow_bounds(self, critical: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(lower, upper) flow bound of each critical edge (``annotate_capacities``'s rule and
        rounding, floats as lowtime computes them; an unbounded upper bound is
        ``_UNBOUNDED_FLOW``), and which upper bounds are unbounded."""
        duration = self.duration_array[critical]
        low, high = self.min_durations[critical], self.max_durations[critical]
        fixed = self.fixed[critical]
        at_min, at_max = ~fixed & (duration == low), ~fixed & (duration == high)
        table = self.cost_table[critical]
        rows = np.arange(len(critical))
        span = table.shape[1] - 1
        here = table[rows, duration - low]
        slower = table[rows, np.minimum(duration - low + 1, span)]
        faster = table[rows, np.maximum(duration - low - 1, 0)]
        lb = np.where(fixed | at_max, 0.0, np.abs(here - slower))
        unbounded = fixed | at_min
        ub = np.where(unbounded, _UNBOUNDED_FLOW, np.abs(faster - here) + np.where(at_max, 0.0, FP_ERROR))
        return lb // FP_ERROR * FP_ERROR, ub // FP_ERROR * FP_ERROR, unbounded

    def min_cut(self, critical: list[int], method: MinCut) -> tuple[set[int], set[int]]:
        """The minimum cut of the critical edges under their flow bounds (raises
        ``LowtimeFlowError`` where no flow meets them): the source side and the other nodes the
        critical edges touch."""
        edges = np.asarray(critical, dtype=np.int64)
        lb, ub, unbounded = self.flow_bounds(edges)
        if method == "dinic":
            cut = self._dinic_min_cut(edges, lb, ub, unbounded)
            if cut is not None:
                return cut
        return self._lowtime_min_cut(edges, lb, ub)

    def _lowtime_min_cut(self, edges: np.ndarray, lb: np.ndarray, ub: np.ndarray) -> tuple[set[int], set[int]]:
        """lowtime's Rust min-cut. It gets only the nodes the critical edges touch (lowtime
        passes every AOA node): a node without a critical edge carries no flow and is on no
        residual path, so the cut over the critical edges is the same (``reduce_durations``
        reads only those), and the solver's per-node work shrinks."""
        rust_edges = [
            (self.edge_ids[e], (0.0, 0.0, upper, lower))
            for e, lower, upper in zip(edges.tolist(), lb.tolist(), ub.tolist())
        ]
        touched = {self.source, self.sink}
        for e in edges.tolist():
            touched.update(self.edge_ids[e])
        nodes = [node for node in self.node_ids if node in touched]
        return _lowtime_rs.PhillipsDessouky(FP_ERROR, nodes, self.source, self.sink, rust_edges).find_min_cut()

    def _dinic_min_cut(
        self, edges: np.ndarray, lb: np.ndarray, ub: np.ndarray, unbounded: np.ndarray
    ) -> tuple[set[int], set[int]] | None:
        """The min-cut by SciPy's Dinic (module docstring); None where it cannot decide within
        int32 (the caller asks lowtime's min-cut instead)."""
        touched, local = np.unique(
            np.concatenate([[self.source_position, self.sink_position], self.tails[edges], self.heads[edges]]),
            return_inverse=True,
        )
        n = len(touched)
        source, sink = int(local[0]), int(local[1])
        tails, heads = local[2 : 2 + len(edges)], local[2 + len(edges) :]
        # The finest unit (FP_ERROR x a power of 2) in which the lower bounds' imbalances fit.
        lb_fine = np.rint(lb / FP_ERROR).astype(np.int64)
        ub_fine = np.where(unbounded, 0, np.rint(ub / FP_ERROR).astype(np.int64))
        imbalance = np.abs(np.bincount(tails, lb_fine, n) - np.bincount(heads, lb_fine, n)).sum()
        scale = 1 << max(0, math.ceil(math.log2(max(1.0, 4.0 * imbalance / _BIG_UNITS))))
        lb_units, ub_units = lb_fine // scale, ub_fine // scale
        spare = np.where(unbounded, _BIG_UNITS, ub_units - lb_units)
        # d(v): lower bounds leaving v minus those entering it.
        excess = np.bincount(tails, lb_units, n).astype(np.int64) - np.bincount(heads, lb_units, n).astype(np.int64)
        if spare.min(initial=0) < 0 or np.abs(excess).sum() >= _BIG_UNITS // 2:
            return None
        if not self._feasible(n, source, sink, tails, heads, spare, excess):
            raise LowtimeFlowError("no flow meets the critical edges' bounds")
        inner = np.ones(n, dtype=bool)
        inner[[source, sink]] = False
        into = np.flatnonzero(inner & (excess < 0))
        out = np.flatnonzero(inner & (excess > 0))
        # A super-source (node n) caps the flow at _BIG_UNITS.
        rows = np.concatenate([tails, np.full(len(into), source), out, [n]])
        cols = np.concatenate([heads, into, np.full(len(out), sink), [source]])
        caps = np.concatenate([spare, -excess[into], excess[out], [_BIG_UNITS]])
        flow, residual = _max_flow(n + 1, rows, cols, caps, n, sink)
        if flow >= _BIG_UNITS:
            if _reaches(n, source, sink, tails[unbounded], heads[unbounded]):
                raise _NoFiniteCut
            return None  # a finite cut, but not below the unbounded edges' stand-in: let lowtime decide
        reach = breadth_first_order(residual, source, directed=True, return_predecessors=False)
        in_s = np.zeros(n + 1, dtype=bool)
        in_s[reach] = True
        nodes = [self.node_ids[p] for p in touched.tolist()]
        s_set = {node for node, inside in zip(nodes, in_s[:n].tolist()) if inside}
        return s_set, {node for node in nodes if node not in s_set}

    @staticmethod
    def _feasible(
        n: int,
        source: int,
        sink: int,
        tails: np.ndarray,
        heads: np.ndarray,
        spare: np.ndarray,
        excess: np.ndarray,
    ) -> bool:
        """Whether a flow within the bounds exists (lowtime's first max-flow): with the sink
        feeding back to the source, the lower bounds' imbalances ``-excess`` as supplies from a
        new source (node n) and demands to a new sink (n + 1) must saturate."""
        supply, demand = np.flatnonzero(excess < 0), np.flatnonzero(excess > 0)
        needed = int(excess[demand].sum())
        if needed == 0:
            return True
        rows = np.concatenate([tails, [sink], np.full(len(supply), n), demand])
        cols = np.concatenate([heads, [source], supply, np.full(len(demand), n + 1)])
        caps = np.concatenate([spare, [_BIG_UNITS], -excess[supply], excess[demand]])
        flow, _ = _max_flow(n + 2, rows, cols, caps, n, n + 1)
        return flow == needed

    def reduce_durations(self, critical: list[int], s_set: set[int], t_set: set[int]) -> float:
        """Speed up the critical edges from ``s_set`` to ``t_set`` and slow down those back by one
        unit (``reduce_durations``); the cost change, inf where an operation is at its limit."""
        edges = np.asarray(critical, dtype=np.int64)
        in_s, in_t = self._membership(s_set), self._membership(t_set)
        tails, heads = self.tails[edges], self.heads[edges]
        forward = in_s[tails] & in_t[heads]
        speed_up = edges[forward].tolist()  # in ``critical``'s order, as lowtime walks them
        slow_down = edges[~forward & in_t[tails] & in_s[heads]].tolist()
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
        self.duration_array[e] = duration
        self.real_costs[self.real_slot[e]] = op.get_cost()

    def _membership(self, nodes: set[int]) -> np.ndarray:
        """Per node position, whether the node is in ``nodes``."""
        inside = np.zeros(len(self.node_ids), dtype=bool)
        inside[[self.position[node] for node in nodes]] = True
        return inside


class _NoFiniteCut(Exception):
    """Every cut has an unbounded edge from the source side to the sink side: a path of
    unbounded critical edges (dummies, one-duration operations, operations at their fastest)
    joins the source to the sink. Whichever cut lowtime's min-cut then takes, it speeds up such
    an edge, so ``reduce_durations`` returns inf and the solve ends there (lowtime's min-cut
    would take as long as all the other steps together on a 405B pipeline's last step)."""


def _reaches(n: int, source: int, sink: int, tails: np.ndarray, heads: np.ndarray) -> bool:
    """Whether the edges ``tails -> heads`` over nodes ``0..n-1`` lead from ``source`` to ``sink``."""
    graph = sp.csr_array((np.ones(len(tails), dtype=np.int8), (tails, heads)), shape=(n, n))
    return bool(np.isin(sink, breadth_first_order(graph, source, directed=True, return_predecessors=False)))


def _max_flow(
    n: int, rows: np.ndarray, cols: np.ndarray, caps: np.ndarray, source: int, sink: int
) -> tuple[int, sp.csr_array]:
    """SciPy's Dinic max-flow on ``n`` nodes (parallel edges' capacities add up): the flow value
    and the residual graph (an entry where capacity is left)."""
    both_rows, both_cols = np.concatenate([rows, cols]), np.concatenate([cols, rows])
    capacity = sp.csr_array(
        (np.concatenate([caps, np.zeros(len(caps), dtype=np.int64)]).astype(np.int32), (both_rows, both_cols)),
        shape=(n, n),
    )
    capacity.sum_duplicates()
    result = maximum_flow(capacity, source, sink, method="dinic")
    residual = capacity.astype(np.int64) - result.flow.astype(np.int64)
    residual.data = (residual.data > 0).astype(np.int8)
    residual.eliminate_zeros()
    return int(result.flow_value), residual


def run_phillips_dessouky(
    aon_dag: nx.DiGraph, attr_name: str = "op", min_cut: MinCut = "dinic"
) -> Iterator[SolverStep]:
    """Shorten the DAG one time unit per step, yielding after each step (lowtime's iteration).

    Same input contract as ``lowtime.solver.PhillipsDessouky`` (one annotated source and sink,
    operations on nodes under ``attr_name``, one ``unit_time``), and, like it, it changes the
    operations' ``duration`` (hence ``assigned_knob``) in place. Stops when no further
    shortening is possible. ``min_cut``: ``"dinic"`` or ``"lowtime"`` (module docstring).
    """
    PhillipsDessouky(aon_dag, attr_name=attr_name)  # checks the input contract
    schedule = _AOASchedule(aon_dag_to_aoa_dag(aon_dag, attr_name=attr_name), attr_name)
    critical, _ = schedule.critical_edges()
    while True:
        try:
            s_set, t_set = schedule.min_cut(critical, min_cut)
        except (LowtimeFlowError, _NoFiniteCut):
            return
        cost_change = schedule.reduce_durations(critical, s_set, t_set)
        if cost_change == float("inf") or abs(cost_change) < FP_ERROR:
            return
        critical, total = schedule.critical_edges()
        yield SolverStep(quant_time=total, cost=schedule.total_cost())
