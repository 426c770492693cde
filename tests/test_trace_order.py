"""The planner's trace step: traces handed to the pool longest first (``stage_tracing.pool_order``),
and each dump read once (``stage_tracing.LoadedDumps``) giving the graphs a fresh read gives."""

from __future__ import annotations

import heapq
import json

import pytest

from kareus_fx.plan import stage_tracing
from kareus_fx.plan.request import PlanRequest


def _makespan(costs: list[float], order: list[int], processes: int) -> float:
    """When the last process finishes if ``capture.trace_pool`` hands out ``order``: this process
    (0) takes calls from the back, the workers from the front, each when it comes free."""
    calls = [costs[i] for i in order]
    free = [(0.0, p) for p in range(processes)]
    heapq.heapify(free)
    while calls:
        at, process = heapq.heappop(free)
        heapq.heappush(free, (at + (calls.pop() if process == 0 else calls.pop(0)), process))
    return max(at for at, _ in free)


def test_pool_order_is_a_permutation_that_starts_the_costliest_first():
    costs = [2.4, 3.4, 2.0, 3.0, 2.8, 3.8]  # the 70B PP10 slice traces in stage order, in layers
    order = stage_tracing.pool_order(costs, 2)
    assert sorted(order) == list(range(len(costs)))
    assert order[-1] == costs.index(max(costs))  # this process starts the costliest
    assert order[0] == costs.index(3.4)  # the worker the next
    # the stage order leaves one process 1.8 layers of work alone at the end (7.8 and 9.6); this one 0.2
    assert _makespan(costs, order, 2) == pytest.approx(8.8)
    assert _makespan(costs, list(range(len(costs))), 2) == pytest.approx(9.6)
    assert stage_tracing.pool_order([], 2) == []
    assert sorted(stage_tracing.pool_order([5, 1, 1, 1, 1, 1], 3)) == list(range(6))
    assert _makespan([5, 1, 1, 1, 1, 1], stage_tracing.pool_order([5, 1, 1, 1, 1, 1], 3), 3) == pytest.approx(5)


def test_trace_cost_counts_the_stages_layers_and_role():
    spec = PlanRequest(
        model="tiny-llama", tp=2, cp=1, pp=3, microbatches=3, mbs=1, seq=128, layers=9, stage_layers=(2, 3, 4)
    ).trace_spec
    costs = [stage_tracing.trace_cost(spec(stage)) for stage in range(3)]
    assert costs == pytest.approx([2.4, 3.0, 4.8])


def test_loaded_dumps_read_each_path_once(tmp_path, monkeypatch):
    """The fast sibling of the traced test below: one read per path, the same dump after it."""
    reads = []
    monkeypatch.setattr(
        stage_tracing, "load_dump", lambda path: reads.append(path) or {"graphs": [], "path": str(path)}
    )
    load = stage_tracing.LoadedDumps()
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert load(a) is load(a)
    assert load(b) == {"graphs": [], "path": str(b)}
    assert reads == [a, b]


@pytest.mark.slow
def test_loaded_dumps_read_each_file_once_and_give_what_load_dump_gives(tmp_path, monkeypatch):
    """Two traced stages (20-25 s under load): each dump read once, the graphs a fresh read gives."""
    reads = []
    real = stage_tracing.load_dump

    def counting(path):
        reads.append(path)
        return real(path)

    monkeypatch.setattr(stage_tracing, "load_dump", counting)
    req = PlanRequest(model="tiny-llama", tp=2, cp=1, pp=2, microbatches=2, mbs=2, seq=512, layers=2)
    load = stage_tracing.LoadedDumps()
    traced = stage_tracing.trace_stages(req, tmp_path / "dumps", load=load)
    assert len(reads) == len(set(reads)) == 4  # 2 stages x 2 splits, read once each
    assert load(reads[0]) is load(reads[0]) and len(reads) == 4
    for stage in traced:
        fresh = stage_tracing.stage_graphs_from_dumps(
            stage.stages,
            stage.dump_paths["nanobatched"],
            stage.dump_paths["sequential"],
            stage.dump_paths["sequential"],
        )
        assert fresh == stage
        assert json.loads(stage.dump_paths["sequential"].read_text())["graphs"]
