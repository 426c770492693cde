"""The sixth method, Megatron-LM + power limit: priced by the simulated GPU's power cap, chosen
by Zeus's own selector."""

from __future__ import annotations

import json

import pytest

from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.cost_models.simulated_profiler import SimulatedProfiler
from kareus_fx.plan.metrics import frontier_metrics
from kareus_fx.plan.plan_format import load_plan
from kareus_fx.plan.power_limit_baseline import POWER_LIMIT_METHOD, ZEUS_POWER_LIMIT_STEP_W


@pytest.fixture(scope="module")
def plan(small_real_plan):
    return load_plan(small_real_plan[0])


def test_the_unlimited_step_is_megatron_and_limits_step_down_as_zeus_does(plan):
    method = plan.data["methods"][POWER_LIMIT_METHOD]
    limits = method["power_limits"]
    tdp_w = gpu_spec(plan.gpu).tdp_w
    assert [row[0] for row in limits] == [int(tdp_w) - ZEUS_POWER_LIMIT_STEP_W * i for i in range(len(limits))]
    assert len(limits) >= 3
    # At the TDP no limit binds beyond the card's own: the same iteration as Megatron-LM's, composed
    # here by a direct 1F1B longest path rather than the lowtime composer.
    ((megatron_t, megatron_e),) = plan.data["methods"]["megatron"]["frontier"]
    assert limits[0][1] == pytest.approx(megatron_t, rel=1e-9)
    assert limits[0][2] == pytest.approx(megatron_e, rel=1e-9)
    times = [row[1] for row in limits]
    assert times == sorted(times) and times[-1] > times[0]  # a lower limit never runs faster


def test_the_chosen_limit_is_zeus_cost_with_eta_half_over_the_job(plan):
    method = plan.data["methods"][POWER_LIMIT_METHOD]
    w = plan.workload
    gpus = w["tp"] * w["cp"] * w["pp"] * w.get("dp", 1)
    by_hand = min(
        method["power_limits"],
        key=lambda row: 0.5 * row[2] + 0.5 * max(r[0] for r in method["power_limits"]) * gpus * row[1],
    )
    assert method["chosen_power_limit_w"] == by_hand[0]
    assert method["frontier"] == [[by_hand[1], by_hand[2]]]
    mp = plan.data["methods"]["megatron+perseus"]["frontier"]
    expected = frontier_metrics(
        [tuple(method["frontier"][0])], tuple(plan.data["methods"]["megatron"]["frontier"][0]), mp
    )
    assert method["metrics"] == pytest.approx(expected)


def test_the_plan_file_round_trips_with_the_curve(plan, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.data))
    assert load_plan(path).data["methods"][POWER_LIMIT_METHOD] == plan.data["methods"][POWER_LIMIT_METHOD]


def test_a_power_limit_slows_the_simulated_gpu_and_keys_its_own_cache():
    spec = gpu_spec("a100")
    free, capped = SimulatedProfiler("a100"), SimulatedProfiler("a100", power_limit_w=spec.tdp_w / 2)
    assert free.kind != capped.kind
    from kareus_fx.workload import OpCost

    ops = [OpCost(name="mm", target="aten.mm", flops=4e12, bytes=3e8)]
    assert (
        capped.measure_sequence(ops, [], spec.clock_max_mhz).time_s
        > free.measure_sequence(ops, [], spec.clock_max_mhz).time_s
    )
    with pytest.raises(ValueError, match="power_limit_w"):
        SimulatedProfiler("a100", power_limit_w=spec.tdp_w + 1)


# ----- Kareus's own power-limit frontier (kareus_fx/plan/kareus_power_limit_curves.py) -------------------------
def _partition(type_id: str, flops: float, nbytes: float, count: int):
    from kareus_fx.workload import CollectiveSpec, OpCost, PartitionType, SlotSpec

    op = OpCost(name=type_id, target="aten.mm.default", flops=flops, bytes=nbytes)
    return PartitionType(
        type_id=type_id,
        graph="forward",
        slots=(SlotSpec((op,)), SlotSpec((op,))),
        collective=CollectiveSpec("all_reduce", 32e6, 8),
        count=count,
        launch_slots=(0, 1),
    )


def test_under_a_limit_each_partition_throttles_on_its_own():
    """The mechanism: a limit slows the partition drawing more than it (compute-bound) and leaves
    the one under it (memory-bound) at its clock, where a clock lock slows both."""
    from kareus_fx.compose.microbatch import MicrobatchPoint
    from kareus_fx.plan.graph_workload import PartitionedGraph, SequentialGraph
    from kareus_fx.plan.kareus_power_limit_curves import NodeWork, price_option
    from kareus_fx.workload import PartitionConfig

    spec = gpu_spec("a100")
    compute, memory = _partition("C", 2e12, 5e7, 3), _partition("M", 1e7, 1e8, 3)
    free = SimulatedProfiler("a100")
    config = PartitionConfig(clock_mhz=spec.clock_max_mhz, comm_sms=8, launch_slot=0)
    power = {t.type_id: free.measure(t, config).energy_j / free.measure(t, config).time_s for t in (compute, memory)}
    assert power["C"] > power["M"]
    limit_w = int(0.5 * (power["C"] + power["M"]))
    capped = SimulatedProfiler("a100", power_limit_w=limit_w)
    assert capped.measure(compute, config).time_s > 1.01 * free.measure(compute, config).time_s
    assert capped.measure(memory, config).time_s == pytest.approx(free.measure(memory, config).time_s, rel=1e-12)
    # price_option adds the partitions (count times), the outside work and the link wait as the planner does.
    empty = SequentialGraph("forward", (), (), "")
    option = MicrobatchPoint(0.0, 0.0, 0.0, 0.0, spec.clock_max_mhz, (("C", config), ("M", config)))
    work = NodeWork(option, empty, PartitionedGraph("forward", (compute, memory), empty, ""), wait_s=0.01)
    priced = price_option(capped, work, spec.clock_max_mhz, blocking_power_w=spec.blocking_power_w)
    parts = [capped.measure(t, config) for t in (compute, memory)]
    assert priced.time_s == pytest.approx(3 * sum(m.time_s for m in parts) + 0.01, rel=1e-12)
    assert priced.energy_j == pytest.approx(
        3 * sum(m.energy_j for m in parts) + 0.01 * spec.blocking_power_w, rel=1e-12
    )


def test_kareus_limits_price_its_fastest_point_locked_and_unlocked(plan):
    """Locked at the planned clocks, the curve's TDP point is Kareus's max-throughput point
    (the same iteration composed by a direct longest path); unlocked (every request at the
    maximum clock, the power-limit deploy mode) it is no slower; both step down as Zeus does."""
    method = plan.data["methods"]["kareus"]
    tdp_w = gpu_spec(plan.gpu).tdp_w
    fastest = min(plan.frontier, key=lambda p: (p["time_s"], p["energy_j"]))
    locked, unlocked = method["locked_power_limits"], method["power_limits"]
    assert locked[0][1] == pytest.approx(fastest["time_s"], rel=1e-9)
    assert locked[0][2] == pytest.approx(fastest["energy_j"], rel=1e-9)
    assert unlocked[0][1] <= fastest["time_s"] * (1 + 1e-9)
    for curve in (locked, unlocked):
        assert [row[0] for row in curve] == [int(tdp_w) - ZEUS_POWER_LIMIT_STEP_W * i for i in range(len(curve))]
        times = [row[1] for row in curve]
        assert times == sorted(times) and len(curve) >= 2 and times[-1] > times[0]


def test_kareus_limit_curve_prices_shared_stage_graphs_once_with_each_stages_wait():
    """Stages that share their graphs are priced once per limit, option and clock, each with its own
    link wait: the curve equals pricing every instruction on its own over the networkx DAG."""
    from kareus_fx.compose.microbatch import MicrobatchPoint
    from kareus_fx.compose.pipeline_schedule import build_pipeline_dag, iteration_energy_j, makespan_s
    from kareus_fx.plan.graph_workload import PartitionedGraph, SequentialGraph
    from kareus_fx.plan.kareus_power_limit_curves import NodeWork, kareus_power_limit_curves, price_option
    from kareus_fx.plan.power_limit_baseline import limit_grid
    from kareus_fx.workload import PartitionConfig

    spec = gpu_spec("a100")
    config = PartitionConfig(clock_mhz=spec.clock_max_mhz, comm_sms=8, launch_slot=0)
    empty = SequentialGraph("forward", (), (), "")
    shared = PartitionedGraph("forward", (_partition("C", 2e12, 5e7, 3),), empty, "")
    option = MicrobatchPoint(0.0, 0.0, 0.0, 0.0, spec.clock_max_mhz, (("C", config),))
    pp, microbatches, scale = 3, 4, 8.0
    dag = build_pipeline_dag(pp, microbatches)
    schedule = {node: NodeWork(option, empty, shared, wait_s=0.001 * (1 + node.stage)) for node in dag}
    curve = kareus_power_limit_curves(
        schedule,
        lambda limit_w: SimulatedProfiler("a100", power_limit_w=limit_w),
        lock_modes=(False,),
        tdp_w=spec.tdp_w,
        max_clock_mhz=spec.clock_max_mhz,
        lowest_clock_mhz=spec.tuning_clock_min_mhz,
        pp=pp,
        microbatches=microbatches,
        blocking_power_w=spec.blocking_power_w,
        energy_scale=scale,
    )[False]

    def direct(limit_w, clock_mhz):
        profiler = SimulatedProfiler("a100", power_limit_w=limit_w)
        costs = {n: price_option(profiler, work, clock_mhz, spec.blocking_power_w) for n, work in schedule.items()}
        time_s = makespan_s(dag, {n: c.time_s for n, c in costs.items()})
        busy_s, busy_j = sum(costs[n].time_s for n in dag), sum(costs[n].energy_j for n in dag)
        return time_s, scale * iteration_energy_j(pp, time_s, busy_s, busy_j, spec.blocking_power_w)

    floor_s, _ = direct(None, spec.tuning_clock_min_mhz)
    expected = limit_grid(lambda limit_w: direct(limit_w, spec.clock_max_mhz), tdp_w=spec.tdp_w, floor_time_s=floor_s)
    assert curve == expected
    assert len(curve) >= 2


def test_kareus_limit_curves_together_equal_separate_curves():
    """Both curves in one call (the floor priced once) equal one call per curve, locked clocks
    included: each curve prices on profilers of its own."""
    from kareus_fx.compose.microbatch import MicrobatchPoint
    from kareus_fx.compose.pipeline_schedule import build_pipeline_dag
    from kareus_fx.plan.graph_workload import PartitionedGraph, SequentialGraph
    from kareus_fx.plan.kareus_power_limit_curves import NodeWork, kareus_power_limit_curves
    from kareus_fx.workload import PartitionConfig

    spec = gpu_spec("a100")
    empty = SequentialGraph("forward", (), (), "")
    shared = PartitionedGraph("forward", (_partition("C", 2e12, 5e7, 3),), empty, "")

    def option(clock_mhz: int) -> MicrobatchPoint:
        config = PartitionConfig(clock_mhz=clock_mhz, comm_sms=8, launch_slot=0)
        return MicrobatchPoint(0.0, 0.0, 0.0, 0.0, clock_mhz, (("C", config),))

    pp, microbatches = 3, 4
    # The last stage's options at a lower clock: locked and unlocked curves differ.
    schedule = {
        node: NodeWork(option(spec.clock_max_mhz - (300 if node.stage == pp - 1 else 0)), empty, shared, wait_s=0.001)
        for node in build_pipeline_dag(pp, microbatches)
    }
    common = {
        "tdp_w": spec.tdp_w,
        "max_clock_mhz": spec.clock_max_mhz,
        "lowest_clock_mhz": spec.tuning_clock_min_mhz,
        "pp": pp,
        "microbatches": microbatches,
        "blocking_power_w": spec.blocking_power_w,
        "energy_scale": 8.0,
    }

    def profiler_at(limit_w):
        return SimulatedProfiler("a100", power_limit_w=limit_w)

    together = kareus_power_limit_curves(schedule, profiler_at, lock_modes=(False, True), **common)
    separate = {
        lock: kareus_power_limit_curves(schedule, profiler_at, lock_modes=(lock,), **common)[lock]
        for lock in (False, True)
    }
    assert together == separate
    assert together[False] != together[True]
