"""Training frameworks behind one interface (``kareus_fx.frameworks``): the default and Megatron-LM
give the planner's numbers, a new framework plugs in by its registry name, and ``--framework``."""

from __future__ import annotations

import dataclasses

import pytest

from kareus_fx import cli
from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.cost_models.simulated_profiler import SimulatedProfiler
from kareus_fx.errors import OptionsError
from kareus_fx.frameworks import registry
from kareus_fx.frameworks.base import TrainingFramework
from kareus_fx.frameworks.megatron_lm import MegatronLM
from kareus_fx.frameworks.megatron_settings import HF_DEFAULTS
from kareus_fx.frameworks.pipeline_sends import stage_transfer_s
from kareus_fx.frameworks.step_tail import step_tail
from kareus_fx.frameworks.torchtitan_fsdp import TorchtitanFSDP
from kareus_fx.frameworks.traced_order import TracedOrder
from kareus_fx.models.configs import get_config
from kareus_fx.plan.composition import planned_step_tail
from kareus_fx.plan.presets import PRESETS
from kareus_fx.plan.profiler_capabilities import PROFILER_CAPABILITIES
from kareus_fx.plan.request import PROFILERS, PlanRequest, plan_request_from_preset, validate_plan_request

SMALL = PlanRequest(model="llama3.2-3b", tp=4, cp=1, pp=2, microbatches=4, mbs=2, seq=2048, dp=2)
TESTBED = "llama3.2-3b-cp2tp4-mbs8-seq4k"
SPEC = gpu_spec("A100-SXM4-40GB")


def _simulator():
    return SimulatedProfiler(SPEC.name).simulator


def test_every_registered_framework_implements_the_interface() -> None:
    assert set(registry.FRAMEWORKS) == {"traced-order", "megatron-lm", "torchtitan-fsdp"}
    for name, cls in registry.FRAMEWORKS.items():
        framework = registry.get_framework(name)
        assert isinstance(framework, TrainingFramework) and isinstance(framework, cls) and framework.name == name


def test_every_profiler_declares_its_capabilities() -> None:
    assert set(PROFILER_CAPABILITIES) == set(PROFILERS)
    assert PROFILER_CAPABILITIES["simulated"].prices_untraced_work
    assert not any(PROFILER_CAPABILITIES[p].prices_untraced_work for p in ("cuda", "cpu-replay"))


def test_requests_get_the_framework_they_imply() -> None:
    assert registry.framework_name(SMALL) == "traced-order"
    for preset in PRESETS.values():
        expected = "traced-order" if preset.megatron == HF_DEFAULTS else "megatron-lm"
        assert registry.framework_name(plan_request_from_preset(preset.name)) == expected, preset.name
    assert registry.framework_name(plan_request_from_preset(TESTBED)) == "megatron-lm"
    assert registry.framework_name(dataclasses.replace(SMALL, framework="torchtitan-fsdp")) == "torchtitan-fsdp"


def test_the_traced_order_adds_nothing_but_plain_sends_and_the_plain_step() -> None:
    framework = TracedOrder()
    assert framework.model_config(SMALL) == get_config("llama3.2-3b")
    assert framework.stage_layer_counts(SMALL) == [14, 14]
    assert framework.extra_work(SMALL, 0) == {} and framework.backward_repricing(SMALL, {}, dict) == {}
    sent = [1e8, 1e8]
    assert framework.pipeline_sends(SMALL, sent, SPEC) == stage_transfer_s(sent, 4, 1, SPEC, ranks=2)
    cfg = get_config("llama3.2-3b")
    plain = step_tail(_simulator(), cfg, [14, 14], tp=4, cp=1, dp=2, pp=2, distributed_optimizer=False)
    assert framework.step_tail(SMALL, _simulator()) == plain
    assert planned_step_tail(SMALL, SPEC) == plain


def test_megatron_under_the_default_settings_is_the_traced_order() -> None:
    ours, traced = MegatronLM(), TracedOrder()
    assert ours.model_config(SMALL) == traced.model_config(SMALL)
    assert ours.extra_work(SMALL, 0) == {} and ours.backward_repricing(SMALL, {}, dict) == {}
    assert ours.step_tail(SMALL, _simulator()) == traced.step_tail(SMALL, _simulator())
    assert planned_step_tail(dataclasses.replace(SMALL, framework="megatron-lm"), SPEC) == planned_step_tail(
        SMALL, SPEC
    )


def test_megatron_prices_the_testbed_settings() -> None:
    req = plan_request_from_preset(TESTBED)
    framework = MegatronLM()
    cfg = framework.model_config(req)
    assert cfg.tie_embeddings is False  # share_embeddings_and_output_weights: false
    sharded = step_tail(_simulator(), cfg, [15, 13], tp=4, cp=2, dp=1, pp=2, distributed_optimizer=True)
    assert framework.step_tail(req, _simulator()) == sharded == planned_step_tail(req, SPEC)
    extra = framework.extra_work(req, 0)
    assert extra["forward"] and extra["backward"]  # dropout masks; dropout backward and main_grad adds
    # a measured profiler prices no work the traced model does not run
    assert planned_step_tail(dataclasses.replace(req, profiler="cpu-replay"), SPEC) is None


def test_torchtitan_fsdp_plugs_in_by_name_and_changes_only_the_step_tail() -> None:
    req = dataclasses.replace(SMALL, framework="torchtitan-fsdp")
    validate_plan_request(req)
    framework = registry.framework_for(req)
    assert isinstance(framework, TorchtitanFSDP)
    assert framework.extra_work(req, 0) == {} and framework.model_config(req) == TracedOrder().model_config(SMALL)
    fsdp, plain = planned_step_tail(req, SPEC), planned_step_tail(SMALL, SPEC)
    assert fsdp is not None and plain is not None
    # the gradients reduce-scattered over the 2 data-parallel ranks, not all-reduced; AdamW on the shard
    assert fsdp.parts_s["grad_sync"] < 0.6 * plain.parts_s["grad_sync"]
    assert fsdp.parts_s["optimizer"] < 0.6 * plain.parts_s["optimizer"]
    assert fsdp.parts_s["embedding_grad_sync"] == 0.0 and fsdp.time_s < plain.time_s
    assert fsdp.parameters_per_gpu == plain.parameters_per_gpu


def test_a_new_framework_plugs_in_without_touching_the_planner(monkeypatch) -> None:
    class NoTail(TracedOrder):
        name = "no-tail"

        def step_tail(self, req, simulator):
            return None

    monkeypatch.setitem(registry.FRAMEWORKS, NoTail.name, NoTail)
    assert planned_step_tail(dataclasses.replace(SMALL, framework="no-tail"), SPEC) is None


def test_an_unknown_framework_is_refused_naming_the_choices(no_tracing, tmp_path, capsys) -> None:
    with pytest.raises(OptionsError, match="unknown training framework 'nemo': choose one of megatron-lm, "):
        validate_plan_request(dataclasses.replace(SMALL, framework="nemo"))
    argv = ["plan", "--model", "llama3.2-3b", "--tp", "4", "--pp", "2", "--microbatches", "4", "--mbs", "2"]
    argv += ["--seq", "2048", "--out", str(tmp_path)]
    assert cli.main([*argv, "--framework", "nemo"]) == 2
    assert "choose one of megatron-lm, torchtitan-fsdp, traced-order" in capsys.readouterr().err


def test_the_cli_framework_reaches_the_request() -> None:
    argv = ["plan", "--model", "llama3.2-3b", "--tp", "4", "--pp", "2", "--microbatches", "4", "--mbs", "2"]
    argv += ["--seq", "2048"]
    assert cli._plan_request(cli._parser().parse_args(argv)).framework is None
    req = cli._plan_request(cli._parser().parse_args([*argv, "--framework", "torchtitan-fsdp"]))
    assert req.framework == "torchtitan-fsdp"
    preset = cli._plan_request(cli._parser().parse_args(["plan", "--preset", TESTBED]))
    assert preset.framework is None and registry.framework_name(preset) == "megatron-lm"
