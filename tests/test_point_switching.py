"""Switching frontier points between iterations without recompiling, on gloo.

The plan is made once per session by the real planner for tiny-llama, TP=2, 2 microbatches of
[2, 256] tokens, 1 layer, fp32 (the parity dtype; ``tiny_tp2_plan_data`` in conftest.py). At
this size the model is launch-bound and the planner's frontier is one point, so the module
gives the plan a frontier of four points
(:data:`POINTS`: time and energy in the shape of a frontier, faster costs more energy) and
gives each point its own microbatch options: point 0 runs both microbatches un-split, points 1
and 2 run them nanobatched with other SM counts and launch slots, point 3 runs microbatch 0
un-split and microbatch 1 nanobatched; every point and microbatch has its own clock.

What can fail: a point's iteration dispatches another point's variant (its collectives' SM
counts and launch slots) or split; the dry-run controller does not receive exactly the point's
clock schedule in each iteration; anything is compiled after the first iteration; loss or a
gradient differs from eager (fp32, rtol=1e-5, atol=1e-6: the nanobatch split sums each weight
gradient from two halves); a point outside the candidates or a switch mid-iteration is not refused.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TINY_TP2_WORKLOAD as WORKLOAD
from conftest import train_microbatches
from dist_harness import run_distributed

from kareus_fx.plan.plan_format import instruction_key, write_plan

TOL = {"rtol": 1e-5, "atol": 1e-6}
POINTS = ((1.00, 1.30), (1.10, 1.18), (1.25, 1.08), (1.40, 1.02))
"""Per frontier point: (time, energy) relative to the planner's one point."""
SPLITS = ({0: None, 1: None}, {0: 0, 1: 0}, {0: 1, 1: 2}, {0: None, 1: 3})
"""Per point, per microbatch: None runs it un-split, an int is its variant of per-type schedules."""
CLOCKS_MHZ = (1410, 1290, 1170, 1050)
"""Per point; microbatch 1 runs 30 MHz and the backward 60 MHz lower."""
ORDER = (0, 3, 1, 2, 3, 0)
"""The point of each of the 6 iterations (every iteration switches)."""


def _configs(data, graph, variant):
    """Per partition type of ``graph``: launch slots and SM counts that differ with ``variant``."""
    configs = {}
    types = sorted(tid for tid, t in data["partition_types"].items() if t["graph"] == graph)
    for i, tid in enumerate(types):
        choices = [*range(len(data["partition_types"][tid]["slots"])), None]
        configs[tid] = {"comm_sms": 4 * (1 + variant), "launch_slot": choices[(i + variant) % len(choices)]}
    return configs


def switching_plan(data, path):
    """``data`` with the frontier of :data:`POINTS`, each point on options of its own (module docstring)."""
    data = copy.deepcopy(data)
    (base,) = data["iteration_frontier"]
    frontier = [{"time_s": base["time_s"] * t, "energy_j": base["energy_j"] * e, "choices": {}} for t, e in POINTS]
    for graph in ("forward", "backward"):
        key = instruction_key(0, graph)
        options = data["microbatch_options"][key]
        template = options[0]
        for point, (splits, clock_mhz) in enumerate(zip(SPLITS, CLOCKS_MHZ)):
            chosen = []
            for mb, variant in splits.items():
                chosen.append(len(options))
                options.append(
                    {
                        **template,
                        "clock_mhz": clock_mhz - 30 * mb - (60 if graph == "backward" else 0),
                        "sequential": variant is None,
                        "configs": None if variant is None else _configs(data, graph, variant),
                    }
                )
            frontier[point]["choices"][key] = chosen
    data["iteration_frontier"] = frontier
    write_plan(path, data)
    return data


def _tiny_model():
    from kareus_fx.models import ParallelLayout, build_model

    torch.manual_seed(0)
    torch._dynamo.reset()
    layout = ParallelLayout.from_default_group(tp=2, cp=1)
    model = build_model(WORKLOAD["model"], layout, num_layers=WORKLOAD["layers"], dtype=torch.float32)
    model.init_weights(seed=0)
    return model, layout


def _batches(model, iteration):
    return [
        model.example_batch(mbs=WORKLOAD["mbs"], seq=WORKLOAD["seq"], seed=100 * iteration + mb)
        for mb in range(WORKLOAD["microbatches"])
    ]


def _check_parity(model, compiled, batches):
    eager_losses, eager_grads = train_microbatches(model, model, batches)
    losses, grads = train_microbatches(model, compiled, batches)
    for loss, eager in zip(losses, eager_losses):
        torch.testing.assert_close(loss, eager, **TOL)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")


def _switch_worker(rank, world_size, plan_path):
    from kareus_fx.deploy.hook_ops import recording_hooks
    from kareus_fx.deploy.switching import PointSwitcher, PointSwitchError
    from kareus_fx.deploy.variants import deployed_graphs
    from kareus_fx.runtime.clock_controller import ClockController

    model, layout = _tiny_model()
    switcher = PointSwitcher(plan_path, candidates=[0, 1, 2, 3])
    switcher.prepare_collectives([layout.tp_group])
    controller = ClockController.open("dry-run", handle_sigterm=False)
    compiled = torch.compile(
        model,
        backend="kareus",
        fullgraph=True,
        options={"switching": switcher, "clock_controller": controller, "inductor": False},
    )
    per_iteration = []
    for iteration, point in enumerate(ORDER):
        if iteration:
            assert switcher.switch_to(point) == point
        before = len(controller.requests)
        with recording_hooks() as log:
            _check_parity(model, compiled, _batches(model, iteration))
        if iteration == 0:
            compiled_after_first = len(deployed_graphs())
        per_iteration.append(
            {
                "point": switcher.current_index,
                "requests": [(r.clock_mhz, r.instruction) for r in controller.requests[before:]],
                "launches": sorted({(entry[2], entry[3]) for entry in log if entry[0] == "comm_launch"}),
            }
        )
    refusals = []
    try:
        switcher.switch_to(7)
    except PointSwitchError as err:
        refusals.append(str(err))
    batch = _batches(model, 99)[0]
    loss = compiled(**batch)  # microbatch 0's forward: the iteration is under way
    try:
        switcher.switch_to(1)
    except PointSwitchError as err:
        refusals.append(str(err))
    loss.backward()
    controller.close()
    return {
        "iterations": per_iteration,
        "compiled_after_first": compiled_after_first,
        "compiled_at_end": len(deployed_graphs()),
        "refusals": refusals,
        "switches": [(s.iteration, s.from_index, s.to_index) for s in switcher.switches],
    }


def _expected_launches(data, point):
    """(comm_sms, launch_slot) of every partition the point's nanobatched microbatches launch."""
    launches = set()
    for graph in ("forward", "backward"):
        for variant in SPLITS[point].values():
            if variant is not None:
                launches |= {
                    (c["comm_sms"], -1 if c["launch_slot"] is None else c["launch_slot"])
                    for c in _configs(data, graph, variant).values()
                }
    return sorted(launches)


def test_switching_points_every_iteration_follows_each_points_clocks_and_variants(tiny_tp2_plan_data, tmp_path):
    from kareus_fx.compose.pipeline_schedule import PipelineNode
    from kareus_fx.deploy.plan_clocks import clock_schedule
    from kareus_fx.plan.plan_format import load_plan

    plan_path = tmp_path / "plan.json"
    data = switching_plan(tiny_tp2_plan_data, plan_path)
    plan = load_plan(plan_path)
    results = run_distributed(_switch_worker, 2, str(plan_path), timeout_s=900)
    for result in results:
        for iteration, (point, got) in enumerate(zip(ORDER, result["iterations"])):
            assert got["point"] == point
            schedule = clock_schedule(plan, point)
            nodes = [PipelineNode(0, g, mb) for mb in range(WORKLOAD["microbatches"]) for g in ("forward", "backward")]
            expected = [(schedule.clock_mhz(n), str(n)) for n in nodes]
            assert got["requests"] == expected, f"iteration {iteration} (point {point})"
            assert got["launches"] == _expected_launches(data, point), f"iteration {iteration} (point {point})"
        # Every candidate's variants were compiled before the first iteration ended; none after.
        assert result["compiled_at_end"] == result["compiled_after_first"]
        assert result["switches"] == [(i, ORDER[i - 1], ORDER[i]) for i in range(1, len(ORDER))]
        outside, mid_iteration = result["refusals"]
        assert "frontier point 7" in outside and "not a candidate" in outside and "[0, 1, 2, 3]" in outside
        assert "middle of an iteration" in mid_iteration


def test_candidates_spread_over_the_frontier_and_include_the_target(tiny_tp2_plan_data, tmp_path):
    from kareus_fx.deploy.switching import PointSwitcher, PointSwitchError, spread_candidates
    from kareus_fx.plan.plan_format import load_plan

    data = copy.deepcopy(tiny_tp2_plan_data)
    (base,) = data["iteration_frontier"]
    data["iteration_frontier"] = [
        {**base, "time_s": base["time_s"] * (1 + k / 10), "energy_j": base["energy_j"] * (1 - k / 40)}
        for k in range(11)
    ]
    write_plan(tmp_path / "plan.json", data)
    plan = load_plan(tmp_path / "plan.json")
    assert spread_candidates(plan, 3) == (0, 5, 10)
    assert spread_candidates(plan, 6) == (0, 2, 4, 6, 8, 10)
    deadline = {"deadline_s": base["time_s"] * 1.36}
    assert spread_candidates(plan, 2, deadline) == (0, 3, 10)
    switcher = PointSwitcher(plan, candidates=2, target=deadline)
    assert switcher.current_index == 3 and switcher.candidate_indices == (0, 3, 10)
    assert [p.time_s for p in switcher.candidates] == sorted(p.time_s for p in switcher.candidates)
    with pytest.raises(PointSwitchError, match=r"frontier point 4 .* not a candidate"):
        switcher.switch_to(4)
    with pytest.raises(PointSwitchError, match=r"frontier index \(int >= 0\), got -3"):
        switcher.switch_to(-3)
    with pytest.raises(PointSwitchError, match="frontier indices"):
        PointSwitcher(plan, candidates=[0, 11])
    # One process, no torch.distributed: the switch is local.
    assert switcher.switch_to(10) == 10 and switcher.current.index == 10
