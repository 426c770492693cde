"""Perseus's straggler response on 2 data-parallel replicas x TP2 (4 gloo ranks, dry-run clocks).

Ranks 0-1 are replica 0, ranks 2-3 replica 1; each replica is one TP2 pipeline of the plan of
tests/test_point_switching.py (four frontier points, relative times 1.0, 1.1, 1.25, 1.4, each
with its own options) and switches with its own :class:`PointSwitcher` over its TP group. Every
iteration each rank reports its iteration time through :class:`ReplicaTimes` (one all-reduce
of two floats over the four ranks) and the replica's first rank asks :class:`StragglerPolicy`.

Each rank stands in for its GPU's time: dry-run clocks do not slow the CPU, and on a shared
CPU the compute time is noise. So an iteration runs the compiled forward and backward of every
microbatch (untimed), then its "GPU time": a sleep of ``BASE_S x time(point) / time(fastest
point)``, what the plan predicts the point's clocks do, timed with the monotonic clock and
reported. Replica 1 sleeps a fixed ``STRAGGLE x BASE_S`` more in iterations 2 and 3: a straggler
26.5% slower than a healthy replica. The policy runs with ``tolerance=0.1`` (timing noise up
to 10% is not a straggler) and ``slack=0.03``.

What can fail: replica 0 does not reach, within 2 iterations of the slowdown, a slower and
lower-energy point whose predicted time is within 5% of the straggler's (1.265 x the fastest),
or does not come back to the fastest point within 2 iterations after the sleep stops; replica 1
leaves the fastest point; the two ranks of a replica run different points; a dry-run clock
request is not the running point's; a loss or gradient differs from eager (fp32, rtol=1e-5,
atol=1e-6) in any iteration.

That 4-rank run is in the slow run; by default the same policy and exchange run on 2 gloo ranks
(a replica each) with no model, each iteration taking its point's predicted time, under the same
expectations of each replica's points.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import TINY_TP2_WORKLOAD as WORKLOAD
from conftest import train_microbatches
from dist_harness import run_distributed
from test_point_switching import POINTS, TOL, switching_plan

BASE_S = 0.8
"""A healthy replica's stand-in GPU time per iteration at the fastest point."""
STRAGGLE = 0.265
"""Replica 1's extra sleep, in units of ``BASE_S``."""
STRAGGLING = range(2, 4)
"""Iterations in which replica 1 sleeps ``STRAGGLE x BASE_S`` more."""
ITERATIONS = 6
"""Timed iterations, after one untimed iteration that compiles."""


def _model(replica, tp_rank, tp_group):
    from kareus_fx.models import ParallelLayout, build_model

    torch.manual_seed(0)
    torch._dynamo.reset()
    layout = ParallelLayout(tp=2, tp_rank=tp_rank, tp_group=tp_group)
    model = build_model(WORKLOAD["model"], layout, num_layers=WORKLOAD["layers"], dtype=torch.float32)
    model.init_weights(seed=0)
    return model


def _iteration(model, compiled, iteration, replica):
    """Compiled forward and backward of every microbatch; then (untimed) the same eagerly."""
    batches = [
        model.example_batch(mbs=WORKLOAD["mbs"], seq=WORKLOAD["seq"], seed=1000 * replica + 10 * iteration + mb)
        for mb in range(WORKLOAD["microbatches"])
    ]
    losses, grads = train_microbatches(model, compiled, batches)
    return batches, losses, grads


def _check_parity(model, batches, losses, grads):
    eager_losses, eager_grads = train_microbatches(model, model, batches)
    for loss, eager in zip(losses, eager_losses):
        torch.testing.assert_close(loss, eager, **TOL)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")


def _straggler_worker(rank, world_size, plan_path):
    import torch.distributed as dist

    from kareus_fx.deploy.switching import PointSwitcher
    from kareus_fx.policies.straggler import ReplicaTimes, StragglerPolicy
    from kareus_fx.runtime.clock_controller import ClockController

    replica, tp_rank = divmod(rank, 2)
    tp_group = [dist.new_group([0, 1]), dist.new_group([2, 3])][replica]
    model = _model(replica, tp_rank, tp_group)
    switcher = PointSwitcher(plan_path, candidates=[0, 1, 2, 3], group=tp_group)
    switcher.prepare_collectives([tp_group])
    replica_times = ReplicaTimes(replicas=2, replica=replica)
    policy = StragglerPolicy(tolerance=0.1, slack=0.03)
    controller = ClockController.open("dry-run", handle_sigterm=False)
    options = {"switching": switcher, "clock_controller": controller, "inductor": False}
    compiled = torch.compile(model, backend="kareus", fullgraph=True, options=options)
    _check_parity(model, *_iteration(model, compiled, 0, replica))
    switcher.step(policy, switcher.observation())  # no time signal from the compiling iteration
    fastest = switcher.candidates[0]
    log = []
    for iteration in range(1, ITERATIONS + 1):
        point = switcher.current
        requested = len(controller.requests)
        compute_start = time.monotonic()
        batches, losses, grads = _iteration(model, compiled, iteration, replica)
        compute_s = time.monotonic() - compute_start
        gpu_s = BASE_S * (point.time_s / fastest.time_s + (STRAGGLE if replica == 1 and iteration in STRAGGLING else 0))
        start = time.monotonic()
        time.sleep(gpu_s)
        elapsed_s = time.monotonic() - start
        _check_parity(model, batches, losses, grads)
        signals = replica_times.exchange(elapsed_s, point, switcher.candidates)
        switcher.step(policy, switcher.observation(**signals))
        clocks = [r.clock_mhz for r in controller.requests[requested:]]
        log.append({"point": point.index, "compute_s": compute_s, "elapsed_s": elapsed_s, "clocks": clocks, **signals})
    controller.close()
    return {"replica": replica, "log": log}


def _exchange_worker(rank, world_size):
    """Replica ``rank`` (one rank each): the points its StragglerPolicy runs, iteration by
    iteration, when each iteration takes the time the plan predicts of its point (in units of
    ``BASE_S``; nothing compiles or sleeps) and replica 1 takes STRAGGLE more in STRAGGLING."""
    from kareus_fx.policies.base import FrontierPoint, Observation
    from kareus_fx.policies.straggler import ReplicaTimes, StragglerPolicy

    candidates = [FrontierPoint(index=i, time_s=t, energy_j=e) for i, (t, e) in enumerate(POINTS)]
    replica_times = ReplicaTimes(replicas=world_size, replica=rank)
    policy = StragglerPolicy(tolerance=0.1, slack=0.03)
    current, points = 0, []
    for iteration in range(1, ITERATIONS + 1):
        points.append(current)
        time_s = BASE_S * (POINTS[current][0] + (STRAGGLE if rank == 1 and iteration in STRAGGLING else 0))
        signals = replica_times.exchange(time_s, candidates[current], candidates)
        observation = Observation(iteration=iteration, elapsed_s=iteration * BASE_S, current_index=current, **signals)
        current = policy.choose(candidates, observation)
    return points


def test_replicas_exchange_their_times_over_gloo_and_the_healthy_one_follows_the_straggler():
    """The policy and ReplicaTimes' all-reduce of the test below on 2 gloo ranks, without the
    model: the same expectations of each replica's points."""
    healthy, straggler = run_distributed(_exchange_worker, 2)
    _check_points(healthy, straggler)


def _check_points(healthy: list[int], straggler: list[int]) -> None:
    """Replica 0 (healthy) follows replica 1 (straggling in STRAGGLING) down and back (module docstring)."""
    assert set(straggler) == {0}, straggler  # the straggler keeps the fastest point
    straggler_time = POINTS[0][0] * (1 + STRAGGLE)  # relative to the fastest point
    first, last = STRAGGLING[0], STRAGGLING[-1]
    by_iteration = dict(enumerate(healthy, start=1))
    assert all(by_iteration[i] == 0 for i in range(1, first + 1)), healthy
    for i in range(first + 2, last + 2):  # within 2 iterations, until the first healthy report
        time_rel, energy_rel = POINTS[by_iteration[i]]
        assert abs(time_rel - straggler_time) <= 0.05 * straggler_time, (i, healthy)
        assert energy_rel < POINTS[0][1], (i, healthy)
    assert all(by_iteration[i] == 0 for i in range(last + 3, ITERATIONS + 1)), healthy  # back within 2


# About 50 s on 2 cores (4 gloo ranks compile). Fast coverage: the exchange test above (the policy
# over ReplicaTimes' all-reduce between 2 replicas), tests/test_policies.py (the policy's choices)
# and tests/test_point_switching.py (switching deployed points, their clocks and variants).
@pytest.mark.slow
def test_a_straggler_replica_slows_the_other_down_and_back(tiny_tp2_plan_data, tmp_path):
    from kareus_fx.compose.pipeline_schedule import PipelineNode
    from kareus_fx.deploy.plan_clocks import clock_schedule
    from kareus_fx.plan.plan_format import load_plan

    plan_path = tmp_path / "plan.json"
    switching_plan(tiny_tp2_plan_data, plan_path)
    plan = load_plan(plan_path)
    results = run_distributed(_straggler_worker, 4, str(plan_path), timeout_s=900)
    points = [[entry["point"] for entry in result["log"]] for result in results]
    assert points[0] == points[1] and points[2] == points[3], points  # one decision per pipeline
    _check_points(points[0], points[2])
    # Every iteration's dry-run clock requests are its point's schedule.
    nodes = [PipelineNode(0, g, mb) for mb in range(WORKLOAD["microbatches"]) for g in ("forward", "backward")]
    for result in results:
        for entry in result["log"]:
            schedule = clock_schedule(plan, entry["point"])
            assert entry["clocks"] == [schedule.clock_mhz(n) for n in nodes]
