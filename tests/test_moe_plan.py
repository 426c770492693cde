"""Planning a mixture of experts with expert parallelism: the request's checks, the MoE presets, and a
small plan whose expert all-to-alls are tuned partitions, written to a plan file that reads back."""

from __future__ import annotations

import pytest

from kareus_fx.errors import OptionsError, ParallelConfigError
from kareus_fx.models import get_config
from kareus_fx.plan.plan_format import load_plan, write_plan
from kareus_fx.plan.presets import PRESETS
from kareus_fx.plan.request import PlanRequest, plan_request_from_preset, validate_plan_request
from kareus_fx.plan.stage_tracing import layers_alike

MOE_PRESETS = sorted(name for name, preset in PRESETS.items() if preset.ep > 1)


def _request(**fields) -> PlanRequest:
    shape = {"model": "tiny-moe", "tp": 1, "cp": 1, "pp": 1, "microbatches": 1, "mbs": 2, "seq": 64, "layers": 2}
    return PlanRequest(**{**shape, **fields})


def test_moe_presets_are_valid_requests_of_expert_parallel_models():
    assert len(MOE_PRESETS) >= 2
    for name in MOE_PRESETS:
        req = plan_request_from_preset(name)
        validate_plan_request(req)
        config = get_config(req.model)
        assert config.moe is not None and config.moe.experts % req.ep == 0
        assert req.dp % (req.ep // req.tp) == 0  # the EP group is whole data-parallel replicas
        assert req.trace_spec().ep == req.ep


def test_deepseek_preset_keeps_its_dense_layers_on_the_first_stage():
    req = plan_request_from_preset("deepseek-v3-ep64pp16-mbs2-seq4k")
    moe = get_config(req.model).moe
    assert moe is not None and isinstance(req.stage_layers, tuple)
    assert req.stage_layers[0] == moe.dense_layers and sum(req.stage_layers) == get_config(req.model).num_layers
    assert not layers_alike(req.model)  # its stages are traced in full, never from slices


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"ep": 2, "dp": 1}, "--dp 1 must hold a whole number of times"),
        ({"ep": 4, "tp": 2, "dp": 3}, "spans 2 data-parallel replicas"),
        ({"ep": 0}, "--ep must be an expert-parallel degree"),
        ({"ep": 2, "dp": 2, "expert_imbalance": 0.5}, "at least 1"),
        ({"model": "qwen3-1.7b", "layers": None, "ep": 2, "dp": 2}, "needs a mixture-of-experts model"),
        ({"ep": 3, "dp": 3}, "does not divide the 8 experts"),
        (
            {"model": "deepseek-v3", "layers": None, "pp": 16, "microbatches": 16, "stage_layers": "balanced"},
            "first 3 layers of deepseek-v3 are dense",
        ),
    ],
)
def test_bad_expert_parallel_requests_are_refused_before_tracing(fields, message):
    with pytest.raises(ParallelConfigError, match=message):
        validate_plan_request(_request(**fields))


def test_expert_all_to_alls_are_planned_on_the_simulated_gpu_only():
    with pytest.raises(OptionsError, match="measuring expert all-to-alls on devices is not supported"):
        validate_plan_request(_request(ep=2, dp=2, profiler="cpu-replay"))


@pytest.fixture(scope="module")
def moe_plan(tmp_path_factory):
    from kareus_fx.plan.planner import make_plan

    req = _request(ep=2, dp=2, gpu="h100")
    validate_plan_request(req)
    return make_plan(req, progress=False).data


def test_moe_plan_tunes_its_expert_all_to_alls_and_reads_back(moe_plan, tmp_path):
    workload = moe_plan["workload"]
    assert (workload["ep"], workload["expert_imbalance"], workload["dp"]) == (2, 1.0, 2)
    assert moe_plan["profiling"]["gpus_per_group"] == 2  # the expert-parallel group, not the TP x CP grid
    all_to_all = {
        type_id: record
        for type_id, record in moe_plan["partition_types"].items()
        if record["collective"]["kind"] == "all_to_all"
    }
    assert {record["graph"] for record in all_to_all.values()} == {"forward", "backward"}
    for record in all_to_all.values():
        assert record["collective"]["group_size"] == 2
        assert record["frontier"], "every all-to-all type has tuned points"
        assert {point["comm_sms"] for point in record["frontier"]} | {
            point["clock_mhz"] for point in record["frontier"]
        }
    assert set(moe_plan["methods"]) >= {"megatron", "nanobatching", "nanobatching+perseus", "kareus"}
    plan = load_plan(write_plan(tmp_path / "plan.json", moe_plan))
    assert plan.workload["ep"] == 2
