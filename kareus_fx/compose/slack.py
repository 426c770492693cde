"""Slack reclamation: the least energy of an iteration plan at its own time, node by node.

lowtime's solver (``iteration.py``) chooses options on quantized times through a convex cost
model, and the fast-end walk after a coarsened solve only speeds up critical instructions. So a
frontier point, re-evaluated exactly, can keep an instruction off the critical path on a faster
and costlier option than its real slack allows. At the fastest point (the one the max-throughput
metrics read) that is the whole story of the point's energy: on Qwen3-1.7B CP2 x TP4 mbs8 4K the
solver's fastest Kareus plan cost 0.4 % more than the least energy at its time (an exact MILP,
``tests/test_slack.py``), Megatron-LM + Perseus's 0.15 %.

:func:`reclaim_slack` fixes the iteration time ``T`` at the plan's measured critical path and
sweeps the nodes in reverse topological order: each node's window runs from its earliest start
(predecessors as they are) to its latest finish (successors as already reclaimed, the sink at
``T``), and it takes its least *effective* energy option (``energy - blocking_power x time``, the
energy above what waiting would cost: the only part a choice changes at a fixed ``T``) that fits
the window. The schedule that starts every node as late as its successors allow then keeps every
dependency and ends by ``T``, so the new plan is no slower. Sweeps repeat until none lowers the
energy. A greedy heuristic, exact only when the windows do not interact; the plan is re-evaluated
exactly, and it is kept only where it is cheaper.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kareus_fx.compose.iteration import IterationFrontier, IterationPoint
from kareus_fx.compose.microbatch import pareto_front
from kareus_fx.compose.pipeline_schedule import iteration_energy_j, pipeline_dag

__all__ = ["reclaim_slack", "with_reclaimed_fastest"]

_MAX_SWEEPS = 8
_REL_TOL = 1e-12
"""Relative slack on a window (floating-point sums of the same times)."""


@dataclasses.dataclass(frozen=True)
class _Cheapest:
    """Per (stage, instruction): options by time, and the least effective energy up to each."""

    times_s: list[float]
    best: list[int]
    """``best[k]``: the option of least effective energy among the ``k + 1`` fastest."""
    effective_j: list[float]

    @classmethod
    def of(cls, options: Sequence[Any], blocking_power_w: float) -> _Cheapest:
        order = sorted(range(len(options)), key=lambda i: (options[i].time_s, options[i].energy_j))
        effective = [float(o.energy_j) - blocking_power_w * float(o.time_s) for o in options]
        best: list[int] = []
        for i in order:
            best.append(i if not best or effective[i] < effective[best[-1]] else best[-1])
        return cls([float(options[i].time_s) for i in order], best, effective)

    def within(self, window_s: float) -> int | None:
        """The cheapest option no longer than ``window_s``; None if none is."""
        k = bisect.bisect_right(self.times_s, window_s * (1 + _REL_TOL) + 1e-15) - 1
        return None if k < 0 else self.best[k]


def reclaim_slack(frontier: IterationFrontier, point: IterationPoint) -> IterationPoint:
    """``point``'s plan with every instruction's slack spent on its cheapest fitting option
    (module docstring): no slower, no costlier, re-evaluated exactly. ``solver_*`` are NaN
    when it changed (it is no longer a solver plan); ``point`` itself when nothing fits better."""
    dag = pipeline_dag(frontier.num_gpus, frontier.num_microbatches, frontier.virtual_stages)
    nodes = frontier.nodes
    index = {node: i for i, node in enumerate(nodes)}
    preds = [[index[p] for p in dag.predecessors(node)] for node in nodes]
    succs = [[index[s] for s in dag.successors(node)] for node in nodes]
    power_w = frontier.blocking_power_w
    options = [frontier.options[(n.stage, n.instruction)] for n in nodes]
    cheapest = {key: _Cheapest.of(items, power_w) for key, items in frontier.options.items()}
    by_node = [cheapest[(n.stage, n.instruction)] for n in nodes]

    choices = [int(c) for c in point.choices]
    durations = [float(options[i][c].time_s) for i, c in enumerate(choices)]
    time_s = _finish_times(preds, durations)[1]
    for _ in range(_MAX_SWEEPS):
        earliest_start = [f - d for f, d in zip(_finish_times(preds, durations)[0], durations)]
        latest_start = [math.inf] * len(nodes)
        changed = False
        for i in reversed(range(len(nodes))):
            latest_finish = min((latest_start[s] for s in succs[i]), default=time_s)
            pick = by_node[i].within(latest_finish - earliest_start[i])
            if pick is not None and by_node[i].effective_j[pick] < by_node[i].effective_j[choices[i]] - 1e-12:
                choices[i], durations[i], changed = pick, float(options[i][pick].time_s), True
            latest_start[i] = latest_finish - durations[i]
        if not changed:
            break
    if choices == [int(c) for c in point.choices]:
        return point
    new_time_s = _finish_times(preds, durations)[1]
    energy_j = iteration_energy_j(
        frontier.num_gpus,
        new_time_s,
        sum(durations),
        sum(float(options[i][c].energy_j) for i, c in enumerate(choices)),
        power_w,
    )
    if new_time_s > point.time_s * (1 + 1e-9) or energy_j >= point.energy_j:
        return point
    array = np.array(choices, dtype=point.choices.dtype)
    array.setflags(write=False)
    return IterationPoint(new_time_s, energy_j, math.nan, math.nan, array)


def with_reclaimed_fastest(frontier: IterationFrontier) -> IterationFrontier:
    """``frontier`` with its fastest point's slack reclaimed (the point the max-throughput metrics
    read; the rest of the frontier as the solver left it)."""
    if not frontier.points:
        return frontier
    fastest = frontier.points[0]
    reclaimed = reclaim_slack(frontier, fastest)
    if reclaimed is fastest:
        return frontier
    return dataclasses.replace(frontier, points=tuple(pareto_front([*frontier.points, reclaimed])))


def _finish_times(preds: Sequence[Sequence[int]], durations: Sequence[float]) -> tuple[list[float], float]:
    """Earliest finish of every node (topological order) and the iteration time."""
    finish = [0.0] * len(preds)
    for i, ps in enumerate(preds):
        finish[i] = max((finish[p] for p in ps), default=0.0) + durations[i]
    return finish, max(finish, default=0.0)
