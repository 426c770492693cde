"""Earliest event times of a DAG with integer edge durations, level by level in numpy.

The solver loop (``solver_loop.py``) needs, every step, the earliest time of each node of the
activity-on-arc DAG (the longest path from the source; with the edges that are tight under it,
the critical edges: ``solver_loop._AOASchedule.critical_edges``). Done edge by edge in Python
the critical-path method's passes took about 33 ms a step on the Llama 3.1 405B v4 pipeline (16
GPUs x 4 chunks x 128 microbatches: 49k AOA edges); the graph is fixed and only the durations
change, so this module sorts the edges once by the level of their head (the most edges on a
path from the source to it) and then computes a whole level with a few numpy calls:
``earliest[v] = max(earliest[u] + d)`` over a level's edges grouped by head
(``np.maximum.reduceat``); every tail of a level's edges lies on an earlier level, so one sweep
over the levels in order is exact. The cost is a few microseconds per level (a pipeline's DAG is
deep and narrow: about 2,100 levels there).

Assumptions: the graph is a DAG with one source (no in-edges) and one sink (no out-edges), every
node reachable from the source and reaching the sink; durations are integers (the times are
exact; ``tests/test_critical_path.py`` checks them against the edge-by-edge pass). Float
durations (a plan's measured times, :class:`NodeWeightedDag`) give the edge-by-edge pass's sums.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["LevelledDag", "NodeWeightedDag"]


class _Sweep:
    """One pass: edges sorted by (level of the node they set, that node), with each level's
    slice of edges, the nodes it sets and where each node's edges start within the slice."""

    def __init__(self, level: np.ndarray, setting: np.ndarray, reading: np.ndarray) -> None:
        self.edges = np.lexsort((setting, level[setting]))
        self.reading = reading[self.edges]
        sorted_setting = setting[self.edges]
        bounds = np.searchsorted(level[sorted_setting], np.arange(1, int(level.max(initial=0)) + 2))
        self.levels: list[tuple[slice, np.ndarray, np.ndarray]] = []
        for start, stop in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            nodes = sorted_setting[start:stop]
            first = np.flatnonzero(np.r_[True, nodes[1:] != nodes[:-1]])
            self.levels.append((slice(start, stop), nodes[first], first))


class LevelledDag:
    """A DAG's edges (``tails[e] -> heads[e]`` over nodes ``0..num_nodes-1``), levelled once."""

    def __init__(self, num_nodes: int, tails: np.ndarray, heads: np.ndarray, source: int, sink: int) -> None:
        self.num_nodes, self.source, self.sink = num_nodes, source, sink
        self._forward = _Sweep(_levels(num_nodes, tails, heads), heads, tails)

    def earliest(self, durations: np.ndarray) -> np.ndarray:
        """Each node's earliest time (longest path from the source) under edge ``durations``
        (integer: int64, exact; float: the same sums, in the same order, as an edge-by-edge pass)."""
        earliest = np.zeros(self.num_nodes, dtype=durations.dtype)
        sweep = self._forward
        along = durations[sweep.edges]
        for edges, nodes, first in sweep.levels:
            earliest[nodes] = np.maximum.reduceat(earliest[sweep.reading[edges]] + along[edges], first)
        return earliest


def _levels(num_nodes: int, tails: np.ndarray, heads: np.ndarray) -> np.ndarray:
    """Each node's level: the most edges on a path to it from a node without in-edges (Kahn's
    order; every node must lie on no cycle)."""
    out_edges: list[list[int]] = [[] for _ in range(num_nodes)]
    for u, v in zip(tails.tolist(), heads.tolist()):
        out_edges[u].append(v)
    waiting = np.bincount(heads, minlength=num_nodes).tolist()
    level = [0] * num_nodes
    ready: Sequence[int] = [v for v in range(num_nodes) if waiting[v] == 0]
    while ready:
        following: list[int] = []
        for u in ready:
            for v in out_edges[u]:
                level[v] = max(level[v], level[u] + 1)
                waiting[v] -= 1
                if waiting[v] == 0:
                    following.append(v)
        ready = following
    return np.asarray(level, dtype=np.int64)


class NodeWeightedDag:
    """The longest path of a DAG whose durations are on its nodes (a plan's iteration time over
    measured instruction times), through a :class:`LevelledDag` with a virtual source before
    every node and a virtual sink after it: node ``u``'s duration sits on its out-edges, so each
    node's earliest time is its start and the sums are the ones an edge-by-edge pass makes."""

    def __init__(self, preds: Sequence[Sequence[int]]) -> None:
        n = len(preds)
        self.num_nodes = n
        pred_tails = np.fromiter((p for ps in preds for p in ps), dtype=np.int64)
        pred_heads = np.repeat(np.arange(n, dtype=np.int64), [len(ps) for ps in preds])
        nodes = np.arange(n, dtype=np.int64)
        self._duration_of_edge = np.concatenate([pred_tails, np.full(n, n), nodes])
        """Per edge, the node whose duration it carries (``n``: none, the source's edges)."""
        tails = np.concatenate([pred_tails, np.full(n, n), nodes])
        heads = np.concatenate([pred_heads, nodes, np.full(n, n + 1)])
        self._dag = LevelledDag(n + 2, tails, heads, n, n + 1)

    def longest_path(self, durations: np.ndarray) -> float:
        """The longest path's length under per-node float ``durations``."""
        padded = np.append(np.asarray(durations, dtype=np.float64), 0.0)
        return float(self._dag.earliest(padded[self._duration_of_edge])[self.num_nodes + 1])
