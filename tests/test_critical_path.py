"""The level-by-level event times (``compose.critical_path``) against the edge-by-edge passes."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest

import kareus_fx.compose.solver_loop as solver_loop
from kareus_fx.compose import InstructionOption, compose_iteration
from kareus_fx.compose.critical_path import LevelledDag, NodeWeightedDag
from kareus_fx.compose.iteration import _longest_path
from kareus_fx.compose.pipeline_schedule import build_pipeline_dag


def _event_times_by_edge(num_nodes, tails, heads, source, sink, durations):
    """The critical-path method's passes edge by edge in a topological order (the reference)."""
    graph = nx.DiGraph()
    graph.add_nodes_from(range(num_nodes))
    graph.add_edges_from(zip(tails.tolist(), heads.tolist()))
    rank = {node: i for i, node in enumerate(nx.topological_sort(graph))}
    edges = range(len(tails))
    earliest = [0] * num_nodes
    for e in sorted(edges, key=lambda e: rank[int(tails[e])]):
        earliest[heads[e]] = max(earliest[heads[e]], earliest[tails[e]] + int(durations[e]))
    latest = [earliest[sink]] * num_nodes
    for e in sorted(edges, key=lambda e: -rank[int(heads[e])]):
        latest[tails[e]] = min(latest[tails[e]], latest[heads[e]] - int(durations[e]))
    return np.array(earliest), np.array(latest)


def _options(num_stages, num_clocks=6, seed=0):
    rng = np.random.default_rng(seed)
    options = {}
    for stage in range(num_stages):
        for inst, base_s in (("forward", 0.04), ("backward", 0.08)):
            scale = rng.uniform(0.9, 1.1)
            clocks = np.linspace(1410, 900, num_clocks)
            times_s = base_s * scale * (1410 / clocks) ** 0.9
            options[(stage, inst)] = [
                InstructionOption(float(t), float(t * (150 + 320 * (c / 1410) ** 3)), int(c))
                for t, c in zip(times_s, clocks)
            ]
    return options


class _Checked(solver_loop._AOASchedule):
    """The solver's schedule, checking every step's critical edges against the edge-by-edge passes."""

    steps = 0

    def critical_edges(self):
        critical, total = super().critical_edges()
        n = len(self.node_ids)
        earliest, latest = _event_times_by_edge(
            n, self.tails, self.heads, self.source_position, self.sink_position, self.duration_array
        )
        assert self.duration_array.tolist() == self.durations
        zero_float = earliest[self.tails] + self.duration_array == latest[self.heads]
        assert critical == np.flatnonzero(zero_float).tolist()
        assert total == earliest[self.sink_position]
        _Checked.steps += 1
        return critical, total


@pytest.mark.parametrize(
    ("gpus", "microbatches", "virtual_stages"),
    [(2, 4, 1), (4, 16, 2)],  # small 1F1B; mid-size interleaved
)
def test_solver_steps_take_the_edge_by_edge_critical_edges(monkeypatch, gpus, microbatches, virtual_stages):
    # Every step of a whole solve: the same critical edges and length as the edge-by-edge passes,
    # so the solver walks the same plans.
    monkeypatch.setattr(solver_loop, "_AOASchedule", _Checked)
    _Checked.steps = 0
    options = _options(gpus * virtual_stages)
    frontier = compose_iteration(
        options, microbatches, blocking_power_w=80.0, virtual_stages=virtual_stages, max_solver_steps=60
    )
    assert _Checked.steps >= 20
    assert len(frontier.trace) >= 20


@pytest.mark.parametrize("seed", range(3))
def test_earliest_times_equal_edge_by_edge_on_random_dags(seed):
    # Random DAGs with several nodes per level, ties and zero durations, one source and sink.
    rng = np.random.default_rng(seed)
    n = 300
    pairs = {(int(u), int(v)) for u, v in rng.integers(1, n - 1, size=(1200, 2)) if u < v}
    pairs |= {(0, v) for v in range(1, n - 1)} | {(u, n - 1) for u in range(1, n - 1)}
    tails, heads = (np.array(x, dtype=np.int64) for x in zip(*sorted(pairs)))
    durations = rng.integers(0, 4, size=len(tails))
    earliest = LevelledDag(n, tails, heads, 0, n - 1).earliest(durations)
    want_earliest, _ = _event_times_by_edge(n, tails, heads, 0, n - 1, durations)
    assert earliest.tolist() == want_earliest.tolist()


@pytest.mark.parametrize(("gpus", "microbatches", "virtual_stages"), [(2, 4, 1), (4, 16, 2), (3, 9, 3)])
def test_plan_time_equals_the_node_by_node_longest_path(gpus, microbatches, virtual_stages):
    # A plan's iteration time (float instruction times): bit for bit the node-by-node pass.
    pipeline = build_pipeline_dag(gpus, microbatches, virtual_stages)
    nodes = list(nx.topological_sort(pipeline))
    index = {node: i for i, node in enumerate(nodes)}
    preds = [tuple(index[p] for p in pipeline.predecessors(node)) for node in nodes]
    dag = NodeWeightedDag(preds)
    rng = np.random.default_rng(gpus)
    for _ in range(5):
        times_s = rng.uniform(0.01, 0.1, size=len(nodes)) * rng.integers(1, 3, size=len(nodes)) / 3
        assert dag.longest_path(times_s) == _longest_path(preds, times_s.tolist())[0]


@pytest.mark.parametrize(("gpus", "microbatches", "virtual_stages"), [(3, 4, 1), (2, 4, 2)])
def test_solve_ends_without_lowtimes_min_cut_where_no_finite_cut_is_left(
    monkeypatch, gpus, microbatches, virtual_stages
):
    # The last step of a solve finds unbounded edges on every cut: the loop ends there without
    # asking lowtime's min-cut (which would take as long as all other steps on a 405B pipeline),
    # after the same steps and plans as where it asks lowtime's min-cut (the loop before).
    options = _options(gpus * virtual_stages)
    reaches, lowtime_min_cut = solver_loop._reaches, solver_loop._AOASchedule._lowtime_min_cut
    ended, asked = [], []
    monkeypatch.setattr(solver_loop, "_reaches", lambda *a: ended.append(reaches(*a)) or ended[-1])
    monkeypatch.setattr(
        solver_loop._AOASchedule, "_lowtime_min_cut", lambda self, *a: asked.append(1) or lowtime_min_cut(self, *a)
    )

    def solve():
        return compose_iteration(
            options, microbatches, blocking_power_w=80.0, virtual_stages=virtual_stages, max_solver_steps=60
        )

    fast = solve()
    assert ended == [True] and not asked
    monkeypatch.setattr(solver_loop, "_reaches", lambda *a: False)  # the loop before: ask lowtime
    before = solve()
    assert asked == [1]
    assert len(fast.trace) == len(before.trace) > 20
    for a, b in zip(fast.trace, before.trace):
        assert a.choices.tolist() == b.choices.tolist()
        assert (a.time_s, a.energy_j, a.solver_time_s, a.solver_energy_j) == (
            b.time_s,
            b.energy_j,
            b.solver_time_s,
            b.solver_energy_j,
        )


def test_a_max_flow_filling_every_imbalance_edge_certifies_the_bounds():
    """The Dinic min-cut skips the feasibility max-flow where its own max-flow fills every d(v)
    edge: on random bounded DAGs such a flow is only ever found where the feasibility max-flow
    finds a flow within the bounds, and infeasible cases occur (then it is not filled)."""
    rng = np.random.default_rng(0)
    certified = infeasible = 0
    for _ in range(300):
        n = int(rng.integers(4, 9))
        pairs = [(u, v) for u in range(n) for v in range(u + 1, n) if rng.random() < 0.5]
        pairs += [(0, 1), (n - 2, n - 1)]
        tails = np.array([u for u, _ in pairs], dtype=np.int64)
        heads = np.array([v for _, v in pairs], dtype=np.int64)
        lb = rng.integers(0, 6, len(pairs))
        spare = rng.integers(0, 6, len(pairs))
        excess = np.bincount(tails, lb, n).astype(np.int64) - np.bincount(heads, lb, n).astype(np.int64)
        source, sink = 0, n - 1
        inner = np.ones(n, dtype=bool)
        inner[[source, sink]] = False
        into, out = np.flatnonzero(inner & (excess < 0)), np.flatnonzero(inner & (excess > 0))
        aux_rows = np.concatenate([np.full(len(into), source), out])
        aux_cols = np.concatenate([into, np.full(len(out), sink)])
        aux_caps = np.concatenate([-excess[into], excess[out]])
        rows = np.concatenate([tails, aux_rows, [n]])
        cols = np.concatenate([heads, aux_cols, [source]])
        caps = np.concatenate([spare, aux_caps, [solver_loop._BIG_UNITS]])
        _, _, aux_flows = solver_loop._max_flow(n + 1, rows, cols, caps, n, sink, watched=(aux_rows, aux_cols))
        assert aux_flows is not None
        feasible = solver_loop._AOASchedule._feasible(n, source, sink, tails, heads, spare, excess)
        if bool(np.all(aux_flows >= aux_caps)):
            certified += 1
            assert feasible
        infeasible += not feasible
    assert certified > 10 and infeasible > 20, (certified, infeasible)
