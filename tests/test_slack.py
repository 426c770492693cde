"""Slack reclamation (compose/slack.py) against the exact least energy at the fastest time.

The reference is an exact MILP (scipy's HiGHS): one binary per (node, option), a start time per
node, every 1F1B dependency, every node finished by the plan's time; minimise the effective
energy. The solver's fastest plan is measurably above it (what made Kareus's max-throughput
energy 0.4 pp worse than it had to be on Qwen CP2 x TP4 mbs8 4K); the reclaimed plan is at it.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import lil_matrix

from kareus_fx.compose.iteration import InstructionOption, IterationFrontier, compose_iteration
from kareus_fx.compose.pipeline_schedule import build_pipeline_dag
from kareus_fx.compose.slack import reclaim_slack, with_reclaimed_fastest

BLOCKING_W = 80.0


def _clock_sweep(rng: np.random.Generator, base_s: float, steps: int = 12) -> list[InstructionOption]:
    """A Perseus-like profile: time ~ 1 / clock, dynamic power ~ clock^2.2 above a floor."""
    out = []
    for k in range(steps):
        f = 1.0 - 0.04 * k
        time_s = base_s / f * (1 + 0.01 * rng.random())
        energy_j = base_s * 300 * (0.35 + 0.65 * f**2.2) / f * (1 + 0.01 * rng.random())
        out.append(InstructionOption(time_s, energy_j, k))
    return out


def _options(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    # Stage 1 is faster: its instructions have slack at the fastest iteration time.
    return {
        (0, "forward"): _clock_sweep(rng, 0.050),
        (0, "backward"): _clock_sweep(rng, 0.100),
        (1, "forward"): _clock_sweep(rng, 0.040),
        (1, "backward"): _clock_sweep(rng, 0.080),
    }


def _least_energy_at(frontier: IterationFrontier, time_s: float) -> float:
    """Exact least iteration energy of a plan finishing by ``time_s`` (MILP)."""
    dag = build_pipeline_dag(frontier.num_gpus, frontier.num_microbatches, frontier.virtual_stages)
    nodes = frontier.nodes
    index = {n: i for i, n in enumerate(nodes)}
    power = frontier.blocking_power_w
    opts = [frontier.options[(n.stage, n.instruction)] for n in nodes]
    offsets = np.cumsum([0] + [len(o) for o in opts])
    n_x = int(offsets[-1])
    n_vars = n_x + len(nodes)
    cost = np.zeros(n_vars)
    rows = lil_matrix((len(nodes) * 2 + dag.number_of_edges(), n_vars))
    lower, upper = [], []
    r = 0
    for i, o in enumerate(opts):
        cost[offsets[i] : offsets[i + 1]] = [x.energy_j - power * x.time_s for x in o]
        rows[r, offsets[i] : offsets[i + 1]] = 1  # one option per node
        lower.append(1)
        upper.append(1)
        r += 1
        rows[r, n_x + i] = 1  # start + duration <= time_s
        rows[r, offsets[i] : offsets[i + 1]] = [x.time_s for x in o]
        lower.append(0)
        upper.append(time_s)
        r += 1
    for u, v in dag.edges:  # start_v >= start_u + duration_u
        iu, iv = index[u], index[v]
        rows[r, n_x + iv] = 1
        rows[r, n_x + iu] = -1
        rows[r, offsets[iu] : offsets[iu + 1]] = [-x.time_s for x in opts[iu]]
        lower.append(0)
        upper.append(np.inf)
        r += 1
    res = milp(
        cost,
        constraints=LinearConstraint(rows.tocsr(), lower, upper),
        integrality=np.r_[np.ones(n_x), np.zeros(len(nodes))],
        bounds=Bounds(np.zeros(n_vars), np.r_[np.ones(n_x), np.full(len(nodes), time_s)]),
    )
    assert res.status == 0, res.message
    return float(res.fun) + frontier.num_gpus * time_s * power


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("max_solver_steps", [None, 20])
def test_reclaimed_fastest_point_reaches_the_least_energy_at_its_time(seed, max_solver_steps):
    frontier = compose_iteration(_options(seed), 4, blocking_power_w=BLOCKING_W, max_solver_steps=max_solver_steps)
    fastest = frontier.points[0]
    optimum_j = _least_energy_at(frontier, fastest.time_s)
    reclaimed = reclaim_slack(frontier, fastest)
    # The defect this catches: the solver's fastest plan leaves slack unspent (0.15-0.4 % above
    # the optimum at the 1 ms quantum, 1.2-2.1 % with a coarse one on these instances).
    assert fastest.energy_j > optimum_j * 1.001
    assert reclaimed.time_s <= fastest.time_s * (1 + 1e-12)
    assert reclaimed.energy_j <= optimum_j * 1.005  # greedy: within 0.5 % of the exact optimum
    assert reclaimed.energy_j >= optimum_j * (1 - 1e-9)  # and never below it (the MILP is exact)
    assert np.isnan(reclaimed.solver_time_s)


def test_reclaimed_plan_is_a_real_plan_evaluated_exactly():
    frontier = compose_iteration(_options(0), 4, blocking_power_w=BLOCKING_W)
    updated = with_reclaimed_fastest(frontier)
    point = updated.points[0]
    plan = updated.plan(point)
    busy_s = sum(o.time_s for o in plan.values())
    busy_j = sum(o.energy_j for o in plan.values())
    assert point.energy_j == pytest.approx(busy_j + BLOCKING_W * (updated.num_gpus * point.time_s - busy_s))
    assert point.time_s == frontier.points[0].time_s
    # The rest of the frontier is the solver's, still Pareto-sorted.
    times = [p.time_s for p in updated.points]
    energies = [p.energy_j for p in updated.points]
    assert times == sorted(times) and energies == sorted(energies, reverse=True)


def test_nothing_to_reclaim_keeps_the_point():
    # One option per instruction: the plan is the only plan.
    options = {(s, n): [InstructionOption(0.1 + 0.01 * s, 10.0)] for s in range(2) for n in ("forward", "backward")}
    frontier = compose_iteration(options, 4, blocking_power_w=BLOCKING_W)
    assert reclaim_slack(frontier, frontier.points[0]) is frontier.points[0]
    assert with_reclaimed_fastest(frontier) is frontier
