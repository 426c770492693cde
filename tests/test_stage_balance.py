"""Balanced pipeline stages (``plan/stage_balance.py``): the split, and the planner resolving it.

Stage times come from the simulated A100 (a calibrated cost model).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus_fx import cli
from kareus_fx.cost_models.simulated_profiler import SimulatedProfiler
from kareus_fx.errors import ParallelConfigError
from kareus_fx.frameworks.pipeline_sends import stage_transfer_s
from kareus_fx.models import get_config
from kareus_fx.plan.layer_slice import SLICE_LAYERS
from kareus_fx.plan.presets import PRESETS
from kareus_fx.plan.request import PlanRequest, plan_request_from_preset
from kareus_fx.plan.stage_balance import StageCost, balanced_layer_counts, cost_from_slices
from kareus_fx.plan.stage_tracing import trace_plan_stages, trace_stages


def _compositions(total: int, parts: int):
    """Every split of ``total`` layers over ``parts`` stages, each at least one."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *cuts, total)
        yield tuple(b - a for a, b in itertools.pairwise(edges))


def _bottleneck_s(counts, costs) -> float:
    return max(cost.time_s(n) for cost, n in zip(costs, counts, strict=True))


stage_cost = st.builds(StageCost, st.floats(0.0, 5.0), st.floats(0.05, 2.0))


@settings(max_examples=200, deadline=None)
@given(costs=st.lists(stage_cost, min_size=1, max_size=5), extra=st.integers(0, 12))
def test_balanced_split_has_the_least_bottleneck_of_every_split(costs, extra):
    layers = len(costs) + extra
    counts = balanced_layer_counts(layers, costs)
    assert len(counts) == len(costs) and sum(counts) == layers and min(counts) >= 1
    best = min(_bottleneck_s(c, costs) for c in _compositions(layers, len(costs)))
    assert _bottleneck_s(counts, costs) == pytest.approx(best, rel=1e-8)


def test_a_heavy_last_stage_gets_fewer_layers_and_ties_go_to_the_later_stage():
    layer = StageCost(0.0, 1.0)
    head = StageCost(2.0, 1.0)  # the LM head and loss cost two layers
    assert balanced_layer_counts(28, [layer, head]) == (15, 13)
    # 16 layers + a 2-layer head over 2 stages: 9/7 both cost 9; the slower stage is not made faster
    assert balanced_layer_counts(16, [layer, head]) == (9, 7)
    # no fixed costs and an odd count: the later stage has the fewer layers, as Megatron-LM's even split
    assert balanced_layer_counts(7, [layer, layer, layer]) == (3, 2, 2)
    # a light head does not take a layer off the last stage when a middle stage would need it
    light_head, sends_both_ways = StageCost(0.9, 1.0), StageCost(0.2, 1.0)
    assert balanced_layer_counts(12, [layer, sends_both_ways, light_head]) == (4, 4, 4)


def test_costs_come_from_two_slices_and_a_free_layer_is_refused():
    cost = cost_from_slices(short_s=5.0, long_s=7.0, short_layers=2)
    assert (cost.fixed_s, cost.per_layer_s) == (1.0, 2.0)
    with pytest.raises(ValueError, match="not slower"):
        cost_from_slices(short_s=5.0, long_s=5.0, short_layers=2)


def test_every_preset_splits_as_its_source_and_an_explicit_split_is_checked():
    # The testbed's workloads split 15 + 13 (the artifact's num_layers_in_first_pipeline_stage), the
    # emulation is balanced by the planner; the Llama 3.1 405B ones give the paper's own split (first
    # and last stages one layer short). A split must cover the model's layers once.
    testbed = {p.stage_layers for p in PRESETS.values() if p.in_paper and p.pp == 2}
    assert testbed == {(15, 13)}
    assert {p.stage_layers for p in PRESETS.values() if p.in_paper and p.pp != 2} == {"balanced"}
    for preset in PRESETS.values():
        if isinstance(preset.stage_layers, tuple):
            assert sum(preset.stage_layers) == get_config(preset.model).num_layers, preset.name
            assert len(preset.stage_layers) == preset.pp * preset.virtual_stages, preset.name
    assert plan_request_from_preset("qwen3-1.7b-tp8-mbs8-seq4k").stage_layers == (15, 13)
    with pytest.raises(ParallelConfigError, match=r"add up to the model's 28 layers; e.g. \[14, 14\]"):
        trace_plan_stages(plan_request_from_preset("qwen3-1.7b-tp8-mbs8-seq4k", stage_layers=(15, 12)), None)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("15,12", "add up to the model's 28 layers"),
        ("10,10,8", "3 stage layer counts [10, 10, 8] for a 2-stage pipeline"),
        ("lopsided", "expected even, balanced or one layer count per stage"),
    ],
)
def test_cli_refuses_a_bad_stage_split_before_tracing(no_tracing, tmp_path, capsys, value, message):
    argv = ["plan", "--preset", "qwen3-1.7b-tp8-mbs8-seq4k", "--stage-layers", value, "--out", str(tmp_path)]
    try:
        status = cli.main(argv)
    except SystemExit as stop:  # argparse's own refusal of a value it cannot parse
        status = stop.code
    assert status == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


# Llama-3.2-3B's shapes at TP8 with 20 layers over 3 stages: the 128k-word LM head and loss weigh
# about a layer, a middle stage sends both ways, and every split from 6 to 8 layers a stage extends
# the same slices (no full trace).
SMALL = PlanRequest(
    model="llama3.2-3b", tp=8, cp=1, pp=3, microbatches=4, mbs=4, seq=2048, layers=20, stage_layers="balanced"
)
KINDS = ("nanobatched", "sequential")


def _megatron_bottleneck_s(traced) -> float:
    """The slowest stage's Megatron-LM microbatch as the plan prices it: forward + backward,
    un-split, at the maximum clock, each ending with its pipeline send."""
    profiler = SimulatedProfiler(SMALL.gpu)
    spec = profiler.simulator.spec
    stage_of = {s: t for t in traced for s in t.stages}
    sends = stage_transfer_s([stage_of[s].sent_bytes for s in range(SMALL.pp)], SMALL.tp, SMALL.cp, spec)
    return max(
        sum(
            profiler.measure_sequence(g.ops, g.collectives, spec.clock_max_mhz).time_s + sends[(s, name)]
            for name, g in stage_of[s].sequential.items()
        )
        for s in range(SMALL.pp)
    )


@pytest.mark.slow  # traces every candidate split (about 60 s); test_balanced_split_has_the_least_bottleneck_of_every_split is its fast sibling
def test_planner_resolves_balanced_to_the_split_whose_full_stages_are_most_even(tmp_path):
    """The split chosen from the slices' costs is, among the splits, the one whose extended
    full-size stage graphs have the fastest slowest stage (sends included)."""
    req, traced = trace_plan_stages(SMALL, tmp_path / "balanced")
    assert isinstance(req.stage_layers, tuple) and sum(req.stage_layers) == 20
    slices = {
        role: [
            {kind: next((tmp_path / "balanced" / f"stage{stage}-{kind}-slice{k}").glob("*.json")) for kind in KINDS}
            for k in SLICE_LAYERS
        ]
        for role, stage in (("first", 0), ("middle", 1), ("last", 2))
    }
    splits = [split for split in _compositions(20, 3) if min(split) >= 6]
    bottleneck = {
        split: _megatron_bottleneck_s(
            trace_stages(dataclasses.replace(req, stage_layers=split), tmp_path / "-".join(map(str, split)), slices)
        )
        for split in splits
    }
    assert req.stage_layers == min(bottleneck, key=bottleneck.get), bottleneck
    assert bottleneck[req.stage_layers] == pytest.approx(_megatron_bottleneck_s(traced), rel=1e-12)


def test_every_bucket_of_a_balanced_bucketed_plan_gets_the_largest_buckets_split(monkeypatch, tmp_path):
    """One model runs every bucket: the largest bucket resolves ``balanced``, the others reuse it."""
    from kareus_fx.plan import bucketed_plan
    from kareus_fx.plan.planner import PlanOutcome

    planned = []

    def plan(req, work_dir, progress=True):
        planned.append((req.seq, req.stage_layers))
        split = [3, 1] if req.stage_layers == "balanced" else list(req.stage_layers)
        return PlanOutcome(data={"workload": {"stage_layers": split}}, wall_s={"total_s": 0.0})

    monkeypatch.setattr(bucketed_plan, "make_plan", plan)
    monkeypatch.setattr(bucketed_plan, "bucketed_plan_data", lambda by_seq: {"buckets": sorted(by_seq)})
    req = PlanRequest(
        model="tiny-llama", tp=2, cp=1, pp=2, microbatches=2, mbs=2, seq=128, layers=4, stage_layers="balanced"
    )
    outcome = bucketed_plan.make_bucketed_plan(req, [128, 64, 32], tmp_path)
    assert planned == [(128, "balanced"), (32, (3, 1)), (64, (3, 1))]
    assert outcome.data["buckets"] == [32, 64, 128]
