"""The paper's testbed settings that the presets carry (``kareus_fx.frameworks.megatron_settings``)."""

from __future__ import annotations

import dataclasses

import pytest

from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.frameworks.megatron_settings import HF_DEFAULTS, TESTBED_SETTINGS, artifact_stage_layers
from kareus_fx.plan.composition import planned_step_tail
from kareus_fx.plan.presets import PRESETS
from kareus_fx.plan.request import plan_request_from_preset


def test_the_testbed_presets_carry_the_artifact_configs_settings() -> None:
    # megatron_{qwen3_1.7b,llama3.2_3b}_config.yaml: num_layers_in_first_pipeline_stage 15,
    # mcore_distributed_optim, hidden_dropout 0.1, share_embeddings_and_output_weights true / false
    assert artifact_stage_layers(28, 2) == (15, 13)
    with pytest.raises(ValueError, match="do not split"):
        artifact_stage_layers(28, 3)
    assert TESTBED_SETTINGS["qwen3-1.7b"].tie_embeddings is True
    assert TESTBED_SETTINGS["llama3.2-3b"].tie_embeddings is False
    for preset in PRESETS.values():
        testbed = preset.in_paper and preset.pp == 2
        assert preset.megatron == (TESTBED_SETTINGS[preset.model] if testbed else HF_DEFAULTS), preset.name
        if testbed:
            assert preset.megatron.distributed_optimizer and preset.megatron.hidden_dropout == 0.1
    req = plan_request_from_preset("llama3.2-3b-cp2tp4-mbs8-seq4k")
    assert req.megatron == TESTBED_SETTINGS["llama3.2-3b"] and req.stage_layers == (15, 13)


def test_the_llama_testbed_tail_has_no_embedding_sync_and_a_sharded_step() -> None:
    spec = gpu_spec("A100-SXM4-40GB")
    testbed = plan_request_from_preset("llama3.2-3b-cp2tp4-mbs8-seq4k")
    hf = dataclasses.replace(testbed, megatron=HF_DEFAULTS)
    ours, theirs = planned_step_tail(testbed, spec), planned_step_tail(hf, spec)
    assert ours is not None and theirs is not None
    assert ours.parts_s["embedding_grad_sync"] == 0.0 < theirs.parts_s["embedding_grad_sync"]
    assert ours.parts_s["grad_sync"] < 0.6 * theirs.parts_s["grad_sync"]  # reduce-scatter, not all-reduce
    assert ours.time_s < theirs.time_s


def test_the_planner_adds_each_stages_dropout_and_gradient_accumulation(monkeypatch) -> None:
    from pathlib import Path

    from kareus_fx.frameworks import megatron_lm
    from kareus_fx.frameworks.megatron_async_dgrad import AsyncDgrad
    from kareus_fx.frameworks.megatron_dropout import dropout_ops
    from kareus_fx.frameworks.megatron_main_grad import MAIN_GRAD_ADD_BYTES_PER_PARAM, main_grad_ops
    from kareus_fx.frameworks.step_tail import stage_parameters
    from kareus_fx.models.configs import get_config
    from kareus_fx.plan.graph_workload import SequentialGraph
    from kareus_fx.plan.stage_tracing import StageGraphs, with_framework_work

    req = plan_request_from_preset("qwen3-1.7b-cp2tp4-mbs16-seq4k")
    empty = {g: SequentialGraph(g, (), (), g) for g in ("forward", "backward")}
    traced = [StageGraphs(stages=(s,), sequential=empty, partitioned=None) for s in (0, 1)]
    elements = 16 * 4096 / 2 * 2048  # mbs x seq / cp x hidden
    params = stage_parameters(get_config("qwen3-1.7b"), (15, 13), 4)
    for graphs, layers, n in zip(with_framework_work(req, traced), (15, 13), params):
        assert graphs.sequential["forward"].ops == dropout_ops("forward", layers, elements, "full")
        backward = graphs.sequential["backward"].ops
        assert backward == dropout_ops("backward", layers, elements, "full") + main_grad_ops(n)
        assert backward[-1].bytes == n * MAIN_GRAD_ADD_BYTES_PER_PARAM == pytest.approx(10 * n)
    # the asynchronous-dgrad split of the backward (megatron_async_dgrad.py) runs the added ops too
    monkeypatch.setattr(megatron_lm, "async_dgrad_split", lambda graph, names=None: AsyncDgrad(empty["backward"], ()))
    (priced,) = with_framework_work(req, traced[:1])
    framework = megatron_lm.MegatronLM()
    dump = {"graphs": [{"name": "backward"}]}
    splits = framework.backward_repricing(
        req, {"sequential": Path("stage0.json")}, lambda path: dump, framework.extra_work(req, 0)["backward"]
    )
    assert splits["sequential"].rest.ops == priced.sequential["backward"].ops
    assert "outside" not in splits
    # a user's workload (no dropout, no Megatron accumulation) and a measured profiler keep the traced graphs
    assert with_framework_work(dataclasses.replace(req, megatron=HF_DEFAULTS), traced) is traced
    assert with_framework_work(dataclasses.replace(req, profiler="cpu-replay"), traced) is traced
