"""Interleaved 1F1B: the composer's schedule against torch.distributed.pipelining's own.

``ScheduleInterleaved1F1B`` computes every rank's action list when it is built; the stages it
gets here are stand-ins carrying only what its constructor reads (pipeline size, this rank, the
global stage indices), so no process group is needed. The actions compared are the compute
actions of the lowered list it executes (``pipeline_order_with_comms``).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

from kareus_fx.compose import CompositionError, InstructionOption, compose_iteration
from kareus_fx.compose.pipeline_schedule import PipelineNode, build_pipeline_dag, check_interleaving, interleaved_order

CASES = [(2, 2, 4), (4, 2, 8), (4, 3, 12)]


@dataclass
class _StandInStage:
    """What ``PipelineScheduleMulti.__init__`` reads of a ``PipelineStage``."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int
    stage_index_to_group_rank: dict = field(default_factory=dict)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


def torch_order(num_ranks: int, virtual_stages: int, num_microbatches: int, rank: int) -> list[tuple[int, str, int]]:
    """(global stage, instruction, microbatch) of every compute action ``rank`` executes."""
    stages = [
        _StandInStage(chunk * num_ranks + rank, num_ranks * virtual_stages, num_ranks, rank)
        for chunk in range(virtual_stages)
    ]
    schedule = ScheduleInterleaved1F1B(stages, num_microbatches)
    names = {_ComputationType.FORWARD: "forward", _ComputationType.FULL_BACKWARD: "backward"}
    actions = schedule.pipeline_order_with_comms[rank]
    assert all(a.computation_type in names for a in actions if a.is_compute_op), "an unexpected compute action"
    return [(a.stage_index, names[a.computation_type], a.microbatch_index) for a in actions if a.is_compute_op]


@pytest.mark.parametrize("num_ranks, virtual_stages, num_microbatches", CASES)
def test_per_rank_order_equals_pytorch_interleaved_1f1b(num_ranks, virtual_stages, num_microbatches):
    for rank in range(num_ranks):
        ours = interleaved_order(num_ranks, virtual_stages, num_microbatches, rank)
        assert ours == torch_order(num_ranks, virtual_stages, num_microbatches, rank), f"rank {rank}"
        assert len(ours) == 2 * virtual_stages * num_microbatches


def event_simulation_s(
    orders: dict[int, list[tuple[int, str, int]]], num_stages: int, duration_s: dict[tuple[int, str], float]
) -> float:
    """Run every rank's action list in order: an action starts once its rank is free and its input
    is there (a forward needs the previous stage's forward of the microbatch, a backward the next
    stage's backward, the last stage's backward its own forward). Returns the iteration time."""
    done_at: dict[tuple[int, str, int], float] = {}
    free_at = dict.fromkeys(orders, 0.0)
    position = dict.fromkeys(orders, 0)
    events: list[tuple[float, int]] = [(0.0, rank) for rank in orders]
    while events:
        _, rank = heapq.heappop(events)
        while position[rank] < len(orders[rank]):
            stage, instruction, mb = orders[rank][position[rank]]
            if instruction == "forward":
                needs = (stage - 1, "forward", mb) if stage > 0 else None
            else:
                needs = (stage + 1, "backward", mb) if stage < num_stages - 1 else (stage, "forward", mb)
            if needs is not None and needs not in done_at:
                break  # blocked: resumes when another rank finishes something
            start = max(free_at[rank], done_at[needs] if needs else 0.0)
            done_at[(stage, instruction, mb)] = free_at[rank] = start + duration_s[(stage, instruction)]
            position[rank] += 1
            for other in orders:
                if other != rank:
                    heapq.heappush(events, (free_at[other], other))
    assert all(position[r] == len(orders[r]) for r in orders), "the schedule deadlocked"
    return max(done_at.values())


@pytest.mark.parametrize("num_ranks, virtual_stages, num_microbatches", CASES)
def test_unsplit_iteration_time_equals_event_simulation(num_ranks, virtual_stages, num_microbatches):
    num_stages = num_ranks * virtual_stages
    # Uneven chunks (a first and a last chunk that cost more, as an embedding and a head do).
    duration_s = {}
    for stage in range(num_stages):
        forward_s = 0.010 + 0.001 * (stage % 3) + (0.004 if stage in (0, num_stages - 1) else 0.0)
        duration_s[(stage, "forward")] = forward_s
        duration_s[(stage, "backward")] = 2.1 * forward_s
    options = {key: [InstructionOption(t, 300.0 * t, knob=1410)] for key, t in duration_s.items()}
    frontier = compose_iteration(
        options, num_microbatches, blocking_power_w=80.0, unit_time_s=1e-4, virtual_stages=virtual_stages
    )
    orders = {r: torch_order(num_ranks, virtual_stages, num_microbatches, r) for r in range(num_ranks)}
    simulated_s = event_simulation_s(orders, num_stages, duration_s)
    assert len(frontier.points) == 1
    assert frontier.points[0].time_s == pytest.approx(simulated_s, rel=1e-12)
    # Energy per GPU: num_ranks GPUs busy for the sum of instruction times, blocked otherwise.
    busy_s = num_microbatches * sum(duration_s.values())
    expected_j = 300.0 * busy_s + 80.0 * (num_ranks * simulated_s - busy_s)
    assert frontier.points[0].energy_j == pytest.approx(expected_j, rel=1e-9)
    assert frontier.num_gpus == num_ranks


def test_interleaving_shrinks_the_bubble():
    # Same work per GPU split into V chunks: the iteration gets shorter as V grows (Narayanan et al.).
    times = {}
    for virtual_stages in (1, 2, 4):
        options = {
            (s, inst): [InstructionOption((0.01 if inst == "forward" else 0.02) / virtual_stages, 1.0, knob=0)]
            for s in range(4 * virtual_stages)
            for inst in ("forward", "backward")
        }
        frontier = compose_iteration(options, 8, blocking_power_w=0.0, unit_time_s=1e-4, virtual_stages=virtual_stages)
        times[virtual_stages] = frontier.points[0].time_s
    # 1F1B: (M + P - 1)(F + B); interleaved: bubble (P - 1)(F + B) / V.
    assert times[1] == pytest.approx((8 + 3) * 0.03)
    assert times[2] < times[1] and times[4] < times[2]
    assert times[4] == pytest.approx(8 * 0.03 + 3 * 0.03 / 4, rel=1e-9)


def test_interleaved_dag_has_every_instruction_once():
    dag = build_pipeline_dag(4, 8, virtual_stages=2)
    assert dag.number_of_nodes() == 4 * 2 * 8 * 2
    assert PipelineNode(3, "forward", 5) in dag.predecessors(PipelineNode(4, "forward", 5))


@pytest.mark.parametrize(
    "args, match",
    [
        ((4, 2, 3, 0), "needs at least 4 microbatches"),
        ((4, 2, 9, 0), "do not divide into 2"),
        ((4, 0, 8, 0), "virtual_stages must be a positive integer"),
        ((4, 2, 8, 4), "rank 4 is outside"),
    ],
)
def test_interleaved_bad_sizes(args, match):
    with pytest.raises(CompositionError, match=match):
        interleaved_order(*args)


def test_options_for_too_few_stages_are_refused():
    options = {(s, i): [InstructionOption(0.01, 1.0)] for s in range(3) for i in ("forward", "backward")}
    with pytest.raises(CompositionError, match="3 stages do not divide into 2 virtual stages"):
        compose_iteration(options, 4, blocking_power_w=0.0, virtual_stages=2)


def test_perseus_plan_lists_each_gpus_clocks_in_its_interleaved_order():
    from kareus_fx.compose import plan_frequencies

    options = {
        (s, inst): [InstructionOption(0.02, 2.0, knob=1410), InstructionOption(0.03, 1.5, knob=1000 + s)]
        for s in range(4)
        for inst in ("forward", "backward")
    }
    frontier = compose_iteration(options, 4, blocking_power_w=10.0, unit_time_s=1e-3, virtual_stages=2)
    slowest = frontier.trace[0]
    per_gpu = plan_frequencies(frontier, slowest)
    assert len(per_gpu) == 2 and all(len(clocks) == 2 * 2 * 4 for clocks in per_gpu)
    expected = [[frontier.option(slowest, *action).knob for action in interleaved_order(2, 2, 4, r)] for r in range(2)]
    assert per_gpu == expected


# ----------------------------------------------------------------------------- planner and presets


def test_plan_of_an_interleaved_pipeline(tmp_path):
    """A tiny real plan (traced model, simulated GPU): PP2 x 2 chunks, 4 stages in the plan."""
    from kareus_fx.deploy.plan_clocks import clock_schedule
    from kareus_fx.plan.plan_format import load_plan, write_plan
    from kareus_fx.plan.planner import make_plan
    from kareus_fx.plan.request import PlanRequest

    request = PlanRequest(
        model="tiny-llama",
        tp=2,
        cp=1,
        pp=2,
        virtual_stages=2,
        microbatches=4,
        mbs=2,
        seq=1536,
        layers=4,
        clock_stride_mhz=240,
    )
    outcome = make_plan(request, tmp_path / "work", progress=False)
    plan = load_plan(write_plan(tmp_path / "plan.json", outcome.data))  # schema and cross-checks
    assert plan.workload["virtual_stages"] == 2 and plan.workload["world_size"] == 4
    assert [s["stage"] for s in plan.data["stages"]] == [0, 1, 2, 3]
    assert plan.workload["stage_layers"] == [1, 1, 1, 1]
    megatron = outcome.iteration["megatron"]
    assert megatron.virtual_stages == 2 and megatron.num_gpus == 2
    # Megatron-LM's one plan: its time is the interleaved schedule's, by direct event simulation.
    (point,) = megatron.points
    durations = {key: opts[0].time_s for key, opts in megatron.options.items()}
    orders = {r: torch_order(2, 2, 4, r) for r in range(2)}
    tail_s = plan.data["step_tail"]["time_s"]  # the gradient sync and optimizer step after the pipeline
    assert point.time_s == pytest.approx(event_simulation_s(orders, 4, durations) + tail_s, rel=1e-12)
    schedule = clock_schedule(plan, 0)
    assert schedule is not None


def test_presets_of_interleaved_pipelines():
    from kareus_fx.plan.presets import PRESETS
    from kareus_fx.plan.request import plan_request_from_preset

    v4 = plan_request_from_preset("llama3.1-405b-pp16tp8-v4-mb128")
    assert (v4.pp, v4.virtual_stages, v4.num_stages, v4.world_size) == (16, 4, 64, 128)
    assert v4.gpu == "H100-SXM5-80GB" and (v4.mbs, v4.seq) == (1, 8192)
    assert sum(v4.stage_layers) == 126 and v4.stage_layers[0] == v4.stage_layers[-1] == 1
    v1 = PRESETS["llama3.1-405b-pp16tp8-v1-mb64"]
    assert v1.stage_layers == (7, *[8] * 14, 7)
    assert plan_request_from_preset("llama3.3-70b-pp10tp8-v2-mb16").num_stages == 20
    assert not PRESETS["llama3.3-70b-pp10tp8-v2-mb16"].in_paper and not v1.in_paper  # not in bench --suite paper
    # ScheduleInterleaved1F1B cannot run 128 microbatches over 10 GPUs in equal rounds: no such preset.
    assert "llama3.3-70b-pp10tp8-v2-mb128" not in PRESETS
    for preset in PRESETS.values():
        check_interleaving(preset.pp, preset.virtual_stages, preset.microbatches)


def test_interleaving_request_errors():
    from kareus_fx.errors import ParallelConfigError
    from kareus_fx.plan.request import PlanRequest, validate_plan_request

    bad = PlanRequest(model="tiny-llama", tp=1, cp=1, pp=4, virtual_stages=2, microbatches=9, mbs=1, seq=64, layers=8)
    with pytest.raises(ParallelConfigError, match=r"--virtual-stages 2: .*do not divide into"):
        validate_plan_request(bad)
