"""Frontier composition: microbatch composer, 1F1B DAG, iteration composer, Perseus CSVs."""

from __future__ import annotations

import io
import itertools
import random
from pathlib import Path

import networkx as nx
import pytest

from kareus_fx.compose import (
    CompositionError,
    InstructionOption,
    MicrobatchPoint,
    PipelineNode,
    build_1f1b_dag,
    choose_unit_time_s,
    compose_iteration,
    compose_microbatch,
    count_solver_steps,
    one_f_one_b_order,
    pareto_front,
    plan_frequencies,
    read_perseus_plan,
    read_perseus_profile,
    write_perseus_plan,
    write_perseus_profile,
)
from kareus_fx.compose.pipeline_schedule import (
    build_pipeline_dag,
    iteration_energy_j,
    makespan_s,
    pipeline_dag,
    pipeline_makespan_s,
)
from kareus_fx.workload import Measurement, PartitionConfig

DATA = Path(__file__).parent / "data"
PROFILE_CSV = DATA / "perseus_gpt3-175b_a100_sxm_stage_profile.csv"
A100_BLOCKING_POWER_W = 83.64  # Perseus artifact notebook (zeus commit 38cb3f90)


# ----------------------------------------------------------------------------- helpers


def _m(time_s: float, energy_j: float) -> Measurement:
    # Split energy into dynamic/static so the sums of both can be checked too.
    return Measurement(time_s, energy_j, energy_j * 0.75, energy_j * 0.25)


def _dyadic(rng: random.Random, lo: int, hi: int) -> float:
    """A random multiple of 1/64: sums of these are exact in floating point."""
    return rng.randint(lo * 64, hi * 64) / 64


def _random_microbatch_problem(rng: random.Random):
    clocks = rng.sample([1410, 1350, 1290, 1230, 1170], rng.randint(1, 4))
    types = [f"t{i}" for i in range(rng.randint(1, 3))]
    points = {}
    for tid in types:
        pts = []
        for clock in clocks:
            if rng.random() < 0.15:  # some type lacks this clock
                continue
            for k in range(rng.randint(1, 4)):
                slot = None if k == 0 else k - 1  # distinct configs per clock
                config = PartitionConfig(clock_mhz=clock, comm_sms=rng.choice([4, 8, 16]), launch_slot=slot)
                pts.append((config, _m(_dyadic(rng, 1, 8), _dyadic(rng, 10, 80))))
        points[tid] = pts
    counts = {tid: rng.randint(1, 4) for tid in types}
    outside = None
    if rng.random() < 0.7:
        outside = {c: _m(_dyadic(rng, 0, 3), _dyadic(rng, 0, 20)) for c in clocks if rng.random() < 0.9}
    sequential = {c: _m(_dyadic(rng, 5, 40), _dyadic(rng, 50, 500)) for c in clocks if rng.random() < 0.6}
    return points, counts, outside, sequential


def _brute_force_microbatch(points, counts, outside, sequential):
    candidates = [(m.time_s, m.energy_j) for m in sequential.values()]
    clocks = {cfg.clock_mhz for pts in points.values() for cfg, _ in pts}
    for clock in clocks:
        if outside is not None and clock not in outside:
            continue
        per_type = [
            [(counts[tid] * m.time_s, counts[tid] * m.energy_j) for cfg, m in points[tid] if cfg.clock_mhz == clock]
            for tid in sorted(points)
        ]
        if any(not options for options in per_type):
            continue
        base_t = 0.0 if outside is None else outside[clock].time_s
        base_e = 0.0 if outside is None else outside[clock].energy_j
        for combo in itertools.product(*per_type):
            candidates.append((base_t + sum(t for t, _ in combo), base_e + sum(e for _, e in combo)))
    return sorted(set(pareto_front(candidates, key=lambda c: c)))


# ----------------------------------------------------------------------------- microbatch


def test_pareto_front_drops_dominated_and_sorts():
    pts = [(3.0, 1.0), (1.0, 5.0), (2.0, 5.0), (2.0, 2.0), (1.0, 5.0), (4.0, 1.0)]
    assert pareto_front(pts, key=lambda p: p) == [(1.0, 5.0), (2.0, 2.0), (3.0, 1.0)]


@pytest.mark.parametrize("seed", range(60))
def test_microbatch_frontier_equals_brute_force(seed):
    rng = random.Random(seed)
    points, counts, outside, sequential = _random_microbatch_problem(rng)
    expected = _brute_force_microbatch(points, counts, outside, sequential)
    if not expected:
        with pytest.raises(CompositionError):
            compose_microbatch(points, counts, outside=outside, sequential=sequential)
        return
    frontier = compose_microbatch(points, counts, outside=outside, sequential=sequential)
    got = [(p.time_s, p.energy_j) for p in frontier.points]
    assert got == expected
    assert got == sorted(got)
    # Every point is what its clock and configs add up to.
    for p in frontier.points:
        if p.sequential:
            m = sequential[p.clock_mhz]
            assert (p.time_s, p.energy_j) == (m.time_s, m.energy_j)
            continue
        t = 0.0 if outside is None else outside[p.clock_mhz].time_s
        e = 0.0 if outside is None else outside[p.clock_mhz].energy_j
        dyn = 0.0 if outside is None else outside[p.clock_mhz].dynamic_energy_j
        assert [tid for tid, _ in p.configs] == sorted(points)
        for tid, cfg in p.configs:
            assert cfg.clock_mhz == p.clock_mhz  # one clock for the whole microbatch
            (m,) = [m for c, m in points[tid] if c == cfg]
            t += counts[tid] * m.time_s
            e += counts[tid] * m.energy_j
            dyn += counts[tid] * m.dynamic_energy_j
        assert (p.time_s, p.energy_j) == (t, e)
        assert p.dynamic_energy_j == pytest.approx(dyn)
        assert p.config_for(p.configs[0][0]) == p.configs[0][1]


def test_microbatch_many_types_stays_tractable():
    # 12 types x 20 points per clock x 18 clocks: full enumeration would be 20**12 per clock.
    rng = random.Random(7)
    clocks = list(range(900, 1411, 30))
    points = {
        f"t{i}": [
            (PartitionConfig(c, sms, slot), _m(rng.uniform(1e-4, 1e-3), rng.uniform(0.05, 0.5)))
            for c in clocks
            for sms in (3, 6, 9, 12)
            for slot in (None, 0, 1, 2, 3)
        ]
        for i in range(12)
    }
    counts = dict.fromkeys(points, 28)
    sequential = {c: _m(0.2, 90.0) for c in clocks}
    frontier = compose_microbatch(points, counts, outside=None, sequential=sequential)
    times = [p.time_s for p in frontier.points]
    energies = [p.energy_j for p in frontier.points]
    assert times == sorted(times) and energies == sorted(energies, reverse=True)


def _two_type_problem(seq_time, seq_energy):
    points = {
        "attn": [
            (PartitionConfig(1410, 8, 1), _m(1.0, 10.0)),
            (PartitionConfig(1410, 8, None), _m(1.5, 9.0)),
            (PartitionConfig(1200, 8, 1), _m(1.3, 8.0)),
        ],
        "mlp": [
            (PartitionConfig(1410, 4, 0), _m(2.0, 20.0)),
            (PartitionConfig(1200, 4, 0), _m(2.6, 16.0)),
        ],
    }
    counts = {"attn": 2, "mlp": 2}
    outside = {1410: _m(0.5, 5.0), 1200: _m(0.6, 4.5)}
    sequential = {1410: _m(seq_time, seq_energy)}
    return points, counts, outside, sequential


def test_sequential_candidate_used_when_better():
    # Best partitioned at 1410: 0.5 + 2*1 + 2*2 = 6.5 s, 5 + 20 + 40 = 65 J.
    points, counts, outside, sequential = _two_type_problem(6.0, 60.0)
    frontier = compose_microbatch(points, counts, outside=outside, sequential=sequential)
    fastest = frontier.points[0]
    assert fastest.sequential and fastest.clock_mhz == 1410 and fastest.configs is None
    assert (fastest.time_s, fastest.energy_j) == (6.0, 60.0)
    with pytest.raises(KeyError):
        fastest.config_for("attn")
    assert all(not p.sequential for p in frontier.points[1:])


def test_sequential_candidate_dropped_when_dominated():
    points, counts, outside, sequential = _two_type_problem(9.0, 200.0)
    frontier = compose_microbatch(points, counts, outside=outside, sequential=sequential)
    assert not any(p.sequential for p in frontier.points)
    assert (frontier.points[0].time_s, frontier.points[0].energy_j) == (6.5, 65.0)


def test_sequential_candidate_wins_exact_tie():
    points, counts, outside, sequential = _two_type_problem(6.5, 65.0)
    frontier = compose_microbatch(points, counts, outside=outside, sequential=sequential)
    assert frontier.points[0].sequential


def test_sequential_only_when_no_common_clock():
    points = {
        "a": [(PartitionConfig(1410, 4, 0), _m(1.0, 1.0))],
        "b": [(PartitionConfig(1200, 4, 0), _m(1.0, 1.0))],
    }
    frontier = compose_microbatch(
        points, {"a": 1, "b": 1}, outside=None, sequential={1410: _m(3.0, 3.0), 1200: _m(4.0, 2.0)}
    )
    assert all(p.sequential for p in frontier.points)
    assert frontier.skipped_clocks_mhz == (1200, 1410)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"counts": {"a": 1, "b": 1}}, "same partition types"),
        ({"counts": {"a": 0}}, "must be >= 1"),
        ({"sequential": {1410: Measurement(-1.0, 1.0, 1.0, 0.0)}}, "finite number >= 0"),
        ({"outside": {1410: Measurement(float("nan"), 1.0, 1.0, 0.0)}}, "finite number >= 0"),
        ({"outside": {1200: _m(1.0, 1.0)}, "sequential": {}}, "no microbatch candidate"),
    ],
)
def test_microbatch_bad_inputs(kwargs, match):
    args = {
        "partition_points": {"a": [(PartitionConfig(1410, 4, 0), _m(1.0, 1.0))]},
        "counts": {"a": 1},
        "outside": None,
        "sequential": {},
    }
    args.update(kwargs)
    with pytest.raises(CompositionError, match=match):
        compose_microbatch(args.pop("partition_points"), args.pop("counts"), **args)


# ----------------------------------------------------------------------------- 1F1B DAG


@pytest.mark.parametrize("num_stages, num_microbatches", [(1, 1), (2, 3), (4, 2), (4, 6), (8, 12)])
def test_1f1b_order_matches_lowtime(num_stages, num_microbatches):
    from lowtime.cost_model import CostModel
    from lowtime.operation import CandidateExecutionOptions, ExecutionOption, OperationSpec
    from lowtime.perseus.instruction import Backward, Forward
    from lowtime.perseus.schedule import Synchronous1F1B

    class _Zero(CostModel):
        def __init__(self) -> None:
            pass

        def __call__(self, quant_time: int) -> float:
            return 0.0

    spec = OperationSpec(
        options=CandidateExecutionOptions(options=[ExecutionOption(real_time=1.0, unit_time=1.0, cost=1.0, knob=0)]),
        cost_model=_Zero(),
    )
    for stage in range(num_stages):
        theirs = [
            ("forward" if isinstance(inst, Forward) else "backward", inst.micro_batch_id)
            for inst in Synchronous1F1B(
                num_stages=num_stages,
                num_micro_batches=num_microbatches,
                stage_id=stage,
                operation_spec_map={Forward: spec, Backward: spec},
            )
        ]
        assert one_f_one_b_order(num_stages, num_microbatches, stage) == theirs


def test_1f1b_dag_shape_and_makespan():
    dag = build_1f1b_dag(3, 4)
    assert dag.number_of_nodes() == 3 * 4 * 2
    assert PipelineNode(1, "forward", 2) in dag.predecessors(PipelineNode(2, "forward", 2))
    assert PipelineNode(2, "backward", 2) in dag.predecessors(PipelineNode(1, "backward", 2))
    # Uniform F = 1, B = 2: makespan is (N + S - 1) * (F + B).
    durations = {n: 1.0 if n.instruction == "forward" else 2.0 for n in dag.nodes}
    assert makespan_s(dag, durations) == (4 + 3 - 1) * 3.0
    with pytest.raises(CompositionError):
        build_1f1b_dag(0, 4)
    with pytest.raises(CompositionError):
        one_f_one_b_order(2, 2, 5)


@pytest.mark.parametrize(("ranks", "microbatches", "chunks"), [(3, 4, 1), (4, 8, 2), (2, 1, 1)])
def test_levelled_makespan_is_networkx_makespan_to_the_bit(ranks, microbatches, chunks):
    rng = random.Random(ranks * 100 + microbatches)
    per_key = {(s, i): rng.uniform(0.01, 0.3) for s in range(ranks * chunks) for i in ("forward", "backward")}
    dag = build_pipeline_dag(ranks, microbatches, chunks)
    expected = makespan_s(dag, {n: per_key[(n.stage, n.instruction)] for n in dag})
    assert pipeline_makespan_s(ranks, microbatches, chunks, lambda n: per_key[(n.stage, n.instruction)]) == expected
    shared = pipeline_dag(ranks, microbatches, chunks)
    assert shared is pipeline_dag(ranks, microbatches, chunks)  # built once
    assert list(shared.nodes) == list(dag.nodes) and list(shared.edges) == list(dag.edges)
    with pytest.raises(nx.NetworkXError):  # frozen: callers share it
        shared.add_edge(PipelineNode(0, "forward", 0), PipelineNode(0, "backward", 0))


# ----------------------------------------------------------------------------- iteration


def _brute_force_iteration(options, num_stages, num_microbatches, blocking_power_w):
    dag = build_1f1b_dag(num_stages, num_microbatches)
    nodes = list(dag.nodes)
    results = []
    for combo in itertools.product(*[range(len(options[(n.stage, n.instruction)])) for n in nodes]):
        chosen = {n: options[(n.stage, n.instruction)][c] for n, c in zip(nodes, combo)}
        time_s = makespan_s(dag, {n: o.time_s for n, o in chosen.items()})
        energy_j = iteration_energy_j(
            num_stages,
            time_s,
            sum(o.time_s for o in chosen.values()),
            sum(o.energy_j for o in chosen.values()),
            blocking_power_w,
        )
        results.append((time_s, energy_j))
    return pareto_front(results, key=lambda r: r)


def _flat(pairs):
    return [x for pair in pairs for x in pair]


def _random_toy_options(rng, num_stages, num_options):
    """Options one time unit apart with convex energies (what the solver is exact on)."""
    options = {}
    for stage in range(num_stages):
        for inst in ("forward", "backward"):
            q = rng.randint(2, 5)
            steps = sorted((rng.randint(1, 6) for _ in range(num_options - 1)), reverse=True)
            energy = float(rng.randint(20, 40) + sum(steps))
            opts = [InstructionOption(float(q), energy, knob=1410)]
            for k, step in enumerate(steps, start=1):
                energy -= step
                opts.append(InstructionOption(float(q + k), energy, knob=1410 - 60 * k))
            options[(stage, inst)] = opts
    return options


@pytest.mark.parametrize("seed", range(8))
def test_iteration_frontier_equals_brute_force_on_toy(seed):
    # 2 stages x 3 microbatches, 2 options per instruction: 4096 plans to enumerate.
    rng = random.Random(seed)
    blocking_power_w = rng.choice([0.0, 1.0, 3.0])
    options = _random_toy_options(rng, 2, 2)
    frontier = compose_iteration(options, 3, blocking_power_w=blocking_power_w, unit_time_s=1.0)
    expected = _brute_force_iteration(options, 2, 3, blocking_power_w)
    got = [(p.time_s, p.energy_j) for p in frontier.points]
    assert _flat(got) == pytest.approx(_flat(expected))


@pytest.mark.parametrize("seed", range(4))
def test_iteration_frontier_three_options_brute_force(seed):
    rng = random.Random(100 + seed)
    blocking_power_w = rng.choice([0.0, 2.0])
    options = _random_toy_options(rng, 2, 3)
    frontier = compose_iteration(options, 2, blocking_power_w=blocking_power_w, unit_time_s=1.0)
    expected = _brute_force_iteration(options, 2, 2, blocking_power_w)
    assert _flat([(p.time_s, p.energy_j) for p in frontier.points]) == pytest.approx(_flat(expected))


def test_iteration_endpoints_plans_and_monotone_energy():
    # Gapped, non-uniform options: the solver is a relaxation here; endpoints must still hold.
    rng = random.Random(5)
    options = {}
    for stage in range(2):
        for inst in ("forward", "backward"):
            base = rng.uniform(0.02, 0.05) * (2 if inst == "backward" else 1)
            options[(stage, inst)] = [
                InstructionOption(
                    base * (1 + 0.05 * k),
                    10.0 * (1 - 0.04 * k) ** 2 * base / 0.02,
                    knob=1410 - 90 * k,
                )
                for k in range(5)
            ]
    frontier = compose_iteration(options, 3, blocking_power_w=60.0)
    dag = build_1f1b_dag(2, 3)
    fastest = {n: options[(n.stage, n.instruction)][0].time_s for n in dag.nodes}
    assert frontier.points[0].time_s == pytest.approx(makespan_s(dag, fastest))
    # ... and costs no more than running everything at the highest clock (off-critical
    # instructions slow down for free).
    all_fastest_energy = iteration_energy_j(
        2,
        makespan_s(dag, fastest),
        sum(fastest.values()),
        sum(options[(n.stage, n.instruction)][0].energy_j for n in dag.nodes),
        60.0,
    )
    assert frontier.points[0].energy_j <= all_fastest_energy + 1e-9
    # The solver starts from every instruction at its slowest Pareto-optimal option.
    assert all(o.knob == 1410 - 90 * 4 for o in frontier.plan(frontier.trace[0]).values())
    times = [p.time_s for p in frontier.points]
    energies = [p.energy_j for p in frontier.points]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert all(a > b for a, b in itertools.pairwise(energies))
    # Each point's numbers are what its plan adds up to.
    for point in frontier.points[:: max(1, len(frontier.points) // 5)]:
        plan = frontier.plan(point)
        t = makespan_s(dag, {n: o.time_s for n, o in plan.items()})
        e = iteration_energy_j(2, t, sum(o.time_s for o in plan.values()), sum(o.energy_j for o in plan.values()), 60.0)
        assert (point.time_s, point.energy_j) == pytest.approx((t, e))
        assert frontier.option(point, 1, "backward", 2) is plan[PipelineNode(1, "backward", 2)]
    # Quantization (floor) makes each instruction at most one unit longer than the solver thinks.
    assert all(p.time_s < p.solver_time_s + len(frontier.nodes) * frontier.unit_time_s for p in frontier.trace)


def test_iteration_takes_microbatch_frontiers():
    points, counts, outside, sequential = _two_type_problem(6.0, 60.0)
    mb = compose_microbatch(points, counts, outside=outside, sequential=sequential)
    options = {(s, inst): mb for s in range(2) for inst in ("forward", "backward")}
    frontier = compose_iteration(options, 2, blocking_power_w=10.0, unit_time_s=0.1)
    chosen = frontier.plan(frontier.points[0])
    assert all(isinstance(o, MicrobatchPoint) for o in chosen.values())
    assert all(any(o is q for q in mb.points) for o in chosen.values())
    dag = build_1f1b_dag(2, 2)
    assert frontier.points[0].time_s == pytest.approx(makespan_s(dag, dict.fromkeys(dag.nodes, mb.points[0].time_s)))


@pytest.mark.parametrize(
    "options, kwargs, match",
    [
        (
            {(0, "forward"): [InstructionOption(1.0, 1.0)]},
            {},
            "missing options for stage 0 backward",
        ),
        (
            {
                (0, "forward"): [InstructionOption(1.0, 1.0)],
                (0, "backward"): [InstructionOption(1.0, 1.0)],
                (1, "forward"): [InstructionOption(1.0, 1.0)],
            },
            {},
            "stage 1 backward",
        ),
        ({(0, "forward"): [], (0, "backward"): [InstructionOption(1.0, 1.0)]}, {}, "no options"),
        ({(0, "recompute"): [InstructionOption(1.0, 1.0)]}, {}, "unknown instruction"),
        (
            {
                (0, "forward"): [InstructionOption(1e-4, 1.0)],
                (0, "backward"): [InstructionOption(1.0, 1.0)],
            },
            {},
            "below the time quantum",
        ),
        (
            {
                (0, "forward"): [InstructionOption(1.0, float("inf"))],
                (0, "backward"): [InstructionOption(1.0, 1.0)],
            },
            {},
            "finite",
        ),
        (
            {
                (0, "forward"): [InstructionOption(1.0, 1.0)],
                (0, "backward"): [InstructionOption(1.0, 1.0)],
            },
            {"blocking_power_w": -1.0},
            "blocking_power_w",
        ),
        (
            {
                (0, "forward"): [InstructionOption(1.0, 1.0)],
                (0, "backward"): [InstructionOption(1.0, 1.0)],
            },
            {"cost_model": "cubic"},
            "cost_model",
        ),
        ({}, {}, "no options"),
    ],
)
def test_iteration_bad_inputs(options, kwargs, match):
    args = {"blocking_power_w": 50.0, **kwargs}
    with pytest.raises(CompositionError, match=match):
        compose_iteration(options, 2, **args)
    with pytest.raises(CompositionError):
        compose_iteration(
            {
                (0, "forward"): [InstructionOption(1.0, 1.0)],
                (0, "backward"): [InstructionOption(1.0, 1.0)],
            },
            0,
            blocking_power_w=1.0,
        )


def test_iteration_on_real_profile_small_pipeline():
    # 2 stages x 4 microbatches of the GPT-3 175B A100 profile (fast), with the Perseus fit too.
    profile = read_perseus_profile(PROFILE_CSV)
    small = {key: opts for key, opts in profile.items() if key[0] < 2}
    for cost_model in ("convex", "exponential"):
        frontier = compose_iteration(small, 4, blocking_power_w=A100_BLOCKING_POWER_W, cost_model=cost_model)
        plan = frontier.plan(frontier.points[0])
        assert {o.knob for o in plan.values()} >= {1410}
        freqs = plan_frequencies(frontier, frontier.points[-1])
        assert len(freqs) == 2 and all(len(f) == 8 for f in freqs)
        energies = [p.energy_j for p in frontier.points]
        assert all(a > b for a, b in itertools.pairwise(energies))


@pytest.mark.slow
def test_reproduces_perseus_planner_frontier_mb12():
    """8 stages x 12 microbatches against the Perseus planner's own frontier (about 30-60 s)."""
    import csv

    profile = read_perseus_profile(PROFILE_CSV)
    with open(DATA / "perseus_gpt3-175b_a100_sxm_frontier_mb12.csv") as f:
        reference = [(float(r["time"]), float(r["energy"])) for r in csv.DictReader(f)]
    frontier = compose_iteration(profile, 12, blocking_power_w=A100_BLOCKING_POWER_W, cost_model="exponential")
    # lowtime's own numbers are the planner's, step for step (the first trace entry is the
    # slowest plan, which the planner does not print).
    solver = [(p.solver_time_s, p.solver_energy_j) for p in frontier.trace[1:]]
    assert len(solver) == len(reference)
    for (t, e), (rt, re_) in zip(solver, reference):
        assert t == pytest.approx(rt, abs=1e-9)
        assert e == pytest.approx(re_, rel=1e-6)
    # The measured re-evaluation stays within 2% of the planner's numbers.
    for p in frontier.trace:
        assert p.time_s == pytest.approx(p.solver_time_s, rel=0.02)
        assert p.energy_j == pytest.approx(p.solver_energy_j, rel=0.02)


# ----------------------------------------------------------------------------- solver speed


def _clock_sweep_options(num_stages, num_clocks=8, forward_s=0.04, seed=0):
    """Options from a clock sweep: time ~ 1/clock^0.9, energy convex in the clock."""
    rng = random.Random(seed)
    options = {}
    for stage in range(num_stages):
        for inst, base_s in (("forward", forward_s), ("backward", 2 * forward_s)):
            scale = rng.uniform(0.95, 1.05)
            opts = []
            for k in range(num_clocks):
                clock = 1410 - k * (510 / (num_clocks - 1))
                time_s = base_s * scale * (1410 / clock) ** 0.9
                opts.append(InstructionOption(time_s, time_s * (150 + 320 * (clock / 1410) ** 3), clock))
            options[(stage, inst)] = opts
    return options


def _least_energy_within(frontier, time_s):
    return min((p.energy_j for p in frontier.points if p.time_s <= time_s), default=float("inf"))


@pytest.mark.parametrize("cost_model", ["convex", "exponential"])
def test_fast_solver_loop_walks_lowtimes_plans(cost_model):
    options = _clock_sweep_options(3)
    frontiers = [
        compose_iteration(options, 4, blocking_power_w=80.0, cost_model=cost_model, solver_loop=loop, min_cut="lowtime")
        for loop in ("fast", "lowtime")
    ]
    fast, lowtime = frontiers
    assert len(fast.trace) == len(lowtime.trace) > 50
    for a, b in zip(fast.trace, lowtime.trace):
        assert a.choices.tolist() == b.choices.tolist()
        assert a.solver_time_s == b.solver_time_s
        assert a.solver_energy_j == pytest.approx(b.solver_energy_j, rel=1e-12)
        assert (a.time_s, a.energy_j) == (b.time_s, b.energy_j)


def test_fast_solver_loop_on_real_profile():
    profile = read_perseus_profile(PROFILE_CSV)
    small = {key: opts for key, opts in profile.items() if key[0] < 3}
    fast, lowtime = (
        compose_iteration(small, 3, blocking_power_w=A100_BLOCKING_POWER_W, solver_loop=loop, min_cut="lowtime")
        for loop in ("fast", "lowtime")
    )
    assert [p.choices.tolist() for p in fast.trace] == [p.choices.tolist() for p in lowtime.trace]


def _epsilon(approx, exact):
    """Least e with every exact point (t, E) matched by an approx point within (1 + e) t and (1 + e) E."""
    return max(
        min(max(a.time_s / x.time_s, a.energy_j / x.energy_j) for a in approx.points) - 1.0 for x in exact.points
    )


@pytest.mark.parametrize("case", ["sweep", "profile"])
def test_dinic_min_cut_frontier_matches_lowtimes(case):
    # SciPy's Dinic min-cut against lowtime's Rust min-cut (the exact reference) in the same loop.
    # The cut is the same set wherever no residual capacity sits at exactly lowtime's FP_ERROR
    # tolerance (there lowtime's float flows decide either way): measured on the real profile 3
    # of 166 steps differ; on the sweep none.
    if case == "sweep":
        options, microbatches, power_w = _clock_sweep_options(3), 4, 80.0
    else:
        profile = read_perseus_profile(PROFILE_CSV)
        options, microbatches, power_w = (
            {key: opts for key, opts in profile.items() if key[0] < 3},
            3,
            A100_BLOCKING_POWER_W,
        )
    dinic, exact = (
        compose_iteration(options, microbatches, blocking_power_w=power_w, min_cut=cut) for cut in ("dinic", "lowtime")
    )
    assert len(exact.trace) > 50
    assert _epsilon(dinic, exact) <= 0.005
    assert _epsilon(exact, dinic) <= 0.005
    assert dinic.points[0].time_s == pytest.approx(exact.points[0].time_s, rel=0.005)
    # Every step shortens the quantized iteration by one unit, as lowtime's.
    assert [p.solver_time_s for p in dinic.trace] == [p.solver_time_s for p in exact.trace]


@pytest.mark.slow
def test_dinic_min_cut_frontier_matches_lowtimes_on_a_longer_pipeline():
    # 8 stages x 24 microbatches at 1 ms: about 2300 steps (lowtime's min-cut about a minute).
    options = _clock_sweep_options(8)
    dinic, exact = (compose_iteration(options, 24, blocking_power_w=80.0, min_cut=cut) for cut in ("dinic", "lowtime"))
    assert len(exact.trace) > 1000
    assert _epsilon(dinic, exact) <= 0.005
    assert _epsilon(exact, dinic) <= 0.005
    assert dinic.points[0].time_s == pytest.approx(exact.points[0].time_s, rel=0.005)


@pytest.mark.parametrize("max_steps", [20, 60, 150])
def test_adaptive_quantum_bounds_solver_steps(max_steps):
    options = _clock_sweep_options(2)
    fine_steps = count_solver_steps(options, 6)
    assert fine_steps > 150
    unit_s = choose_unit_time_s(options, 6, max_steps)
    assert unit_s > 1e-3
    assert count_solver_steps(options, 6, unit_s) <= max_steps
    frontier = compose_iteration(options, 6, blocking_power_w=80.0, max_solver_steps=max_steps)
    assert frontier.unit_time_s == unit_s
    assert len(frontier.trace) - 1 <= max_steps


def test_adaptive_quantum_keeps_fine_quantum_when_steps_allow():
    options = _clock_sweep_options(2)
    fine_steps = count_solver_steps(options, 6)
    assert choose_unit_time_s(options, 6, fine_steps) == 1e-3
    fixed = compose_iteration(options, 6, blocking_power_w=80.0)
    adaptive = compose_iteration(options, 6, blocking_power_w=80.0, max_solver_steps=fine_steps)
    assert [p.choices.tolist() for p in adaptive.trace] == [p.choices.tolist() for p in fixed.trace]


def test_adaptive_frontier_close_to_fine_frontier():
    # 2 stages x 6 microbatches: 416 steps at 1 ms, bounded to 60 (a 7.5x coarser quantum).
    options = _clock_sweep_options(2)
    fine = compose_iteration(options, 6, blocking_power_w=80.0)
    coarse = compose_iteration(options, 6, blocking_power_w=80.0, max_solver_steps=60)
    assert coarse.unit_time_s > 7 * fine.unit_time_s
    # The fastest plan is the least possible iteration time (the walk after the solver).
    dag = build_1f1b_dag(2, 6)
    fastest_s = makespan_s(dag, {n: options[(n.stage, n.instruction)][0].time_s for n in dag})
    assert coarse.points[0].time_s == pytest.approx(fastest_s, rel=1e-12)
    assert fine.points[0].time_s >= fastest_s - 1e-12
    # At every deadline the fine frontier meets, the coarse one spends at most 3% more energy
    # (measured: 2.25%; 0.9% at 250 steps).
    for point in fine.points:
        assert _least_energy_within(coarse, point.time_s) <= 1.03 * point.energy_j
    # Every coarse point is a real plan, evaluated exactly.
    for point in coarse.points[::10]:
        plan = coarse.plan(point)
        measured_s = makespan_s(dag, {n: o.time_s for n, o in plan.items()})
        assert point.time_s == pytest.approx(measured_s)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_solver_steps": 0}, "max_solver_steps"),
        ({"max_solver_steps": 2.5}, "max_solver_steps"),
        ({"max_solver_steps": 1}, "pass a larger max_solver_steps"),
        ({"solver_loop": "rust"}, "solver_loop"),
        ({"min_cut": "rust"}, "min_cut"),
    ],
)
def test_solver_speed_bad_inputs(kwargs, match):
    with pytest.raises(CompositionError, match=match):
        compose_iteration(_clock_sweep_options(2), 6, blocking_power_w=80.0, **kwargs)


# ----------------------------------------------------------------------------- Perseus CSV


def test_perseus_profile_round_trip_real_file(tmp_path):
    profile = read_perseus_profile(PROFILE_CSV)
    assert sorted(profile) == sorted((s, i) for s in range(8) for i in ("forward", "backward"))
    assert all(len(opts) == 38 for opts in profile.values())
    out = tmp_path / "profile.csv"
    write_perseus_profile(out, profile)
    again = read_perseus_profile(out)
    assert again == profile
    # Same rows as the original file (the order within a stage may differ).
    original = sorted(PROFILE_CSV.read_text().splitlines()[1:])
    assert sorted(out.read_text().splitlines()[1:]) == sorted(
        ",".join([s, i, f, repr(float(t)), repr(float(e))]) for s, i, f, t, e in (line.split(",") for line in original)
    )


def test_perseus_profile_round_trip_microbatch_points():
    points, counts, outside, sequential = _two_type_problem(6.0, 60.0)
    mb = compose_microbatch(points, counts, outside=outside, sequential=sequential)
    buffer = io.StringIO()
    write_perseus_profile(buffer, {(0, "forward"): mb.points, (0, "backward"): mb.points})
    buffer.seek(0)
    back = read_perseus_profile(buffer)
    assert [(o.knob, o.time_s, o.energy_j) for o in back[(0, "forward")]] == [
        (p.clock_mhz, p.time_s, p.energy_j) for p in mb.points
    ]


@pytest.mark.parametrize(
    "text, match",
    [
        ("stage,instr,frequency,time,energy\n0,forward,1410,1.0,1.0\n", "header"),
        (
            "stage,instruction,frequency,time,energy\n0,sideways,1410,1.0,1.0\n",
            "instruction: Input should be 'forward' or 'backward'",
        ),
        ("stage,instruction,frequency,time,energy\n0,forward,1410,abc,1.0\n", ":2:"),
        (
            "stage,instruction,frequency,time,energy\n0,forward,1410,0,1.0\n",
            "<stream>:2: time: Input should be greater than 0",
        ),
        ("stage,instruction,frequency,time,energy\n0,forward,1410,nan,1.0\n", "time: Input should be a finite number"),
        (
            "stage,instruction,frequency,time,energy\n0,forward,1410,1.0,1e999\n",
            "energy: Input should be a finite number",
        ),
        (
            "stage,instruction,frequency,time,energy\n-1,forward,1410,1.0,1.0\n",
            "stage: Input should be greater than or equal to 0",
        ),
        (
            "stage,instruction,frequency,time,energy\n0,forward,1410,1.0,-1\n",
            "energy: Input should be greater than or equal to 0",
        ),
        ("stage,instruction,frequency,time,energy\n0,forward,1410,1.0\n", "expected 5 fields"),
        (
            "stage,instruction,frequency,time,energy\n0,forward,1410,1.0,1.0\n0,forward,1410,2.0,1.0\n",
            "repeated row",
        ),
        ("stage,instruction,frequency,time,energy\n", "no rows"),
    ],
)
def test_perseus_profile_bad_input(text, match):
    with pytest.raises(CompositionError, match=match):
        read_perseus_profile(io.StringIO(text))


def test_perseus_plan_round_trip():
    plan = [[1410, 1395, 1200], [1080, 1410, 1410]]
    buffer = io.StringIO()
    write_perseus_plan(buffer, plan)
    buffer.write("# Iteration 3: cost change 1.0\n")
    buffer.seek(0)
    assert read_perseus_plan(buffer) == plan
    with pytest.raises(CompositionError):
        read_perseus_plan(io.StringIO("__import__('os').system('true')"))
    with pytest.raises(CompositionError, match=r"<stream>: \[0\]\[1\]: Input should be greater than 0"):
        read_perseus_plan(io.StringIO("[[1410, -5]]"))
    with pytest.raises(CompositionError, match="valid integer"):
        read_perseus_plan(io.StringIO("[[1410, True]]"))


def test_perseus_files_larger_than_any_real_one_are_refused_unread(tmp_path, monkeypatch):
    from kareus_fx.compose import perseus_csv

    path = tmp_path / "profile.csv"
    with path.open("wb") as f:
        f.truncate(perseus_csv.MAX_PROFILE_BYTES + 1)  # sparse: nothing written, nothing to read
    with pytest.raises(CompositionError, match=r"profile.csv: \d+ bytes, more than any real Perseus profile CSV"):
        read_perseus_profile(path)
    with pytest.raises(CompositionError, match="more than any real Perseus frequency plan"):
        read_perseus_plan(path)


def test_solve_pool_gives_each_methods_frontier_as_in_this_process():
    from kareus_fx.compose.solve_pool import compose_iterations

    by_name = {"three clocks": _clock_sweep_options(3), "two clocks": _clock_sweep_options(2)}
    by_name["one clock"] = {key: opts[:1] for key, opts in by_name["two clocks"].items()}
    kwargs = {"blocking_power_w": 80.0, "max_solver_steps": 40}
    here = compose_iterations(by_name, 4, processes=1, **kwargs)
    ran: list[str] = []
    for start_method in ("spawn", "fork"):
        pooled = compose_iterations(
            by_name, 4, processes=3, meanwhile=lambda: ran.append("meanwhile"), start_method=start_method, **kwargs
        )
        assert list(pooled) == list(by_name)
        for name in by_name:
            assert len(pooled[name].trace) == len(here[name].trace)
            for a, b in zip(pooled[name].trace, here[name].trace):
                assert (a.time_s, a.energy_j, a.choices.tolist()) == (b.time_s, b.energy_j, b.choices.tolist())
    assert ran == ["meanwhile", "meanwhile"]
    assert len(here["three clocks"].trace) > 10
