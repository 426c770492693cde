"""Activation checkpointing end to end: ``kareus plan --recompute``, the split, deployment.

One real plan (``make_plan``: trace, tune, compose) of tiny-llama, TP=2, 2 layers, 2 microbatches
of [2, 1536] tokens, float32, with ``recompute="full"`` (every decoder layer checkpointed, as
Megatron-LM's full recompute). Its backward must hold the recomputed forward; it deploys on the
model checkpointed the same way (2 gloo ranks, loss and every gradient equal to eager, no
nanobatch fallback) and is refused on the un-checkpointed one with a message naming recompute.
Hugging Face ``gradient_checkpointing_enable()`` must split and match eager the same way (one
process: see its test for torch's DTensor limitation).

Tolerances: ``rtol=1e-5, atol=1e-6`` (float32), as ``tests/test_codegen.py``: the split sums each
weight gradient from two halves; recomputation repeats the same arithmetic.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter

import pytest
import torch
from conftest import train_microbatches
from dist_harness import run_distributed

from kareus_fx.errors import OptionsError

TOL = {"rtol": 1e-5, "atol": 1e-6}
WORKLOAD = {"model": "tiny-llama", "tp": 2, "cp": 1, "pp": 1, "microbatches": 2, "mbs": 2, "seq": 1536, "layers": 2}


@pytest.fixture(scope="module")
def full_plan(tmp_path_factory):
    """(plan.json path, planner work directory) of WORKLOAD planned with ``recompute="full"``."""
    from kareus_fx.plan.plan_format import write_plan
    from kareus_fx.plan.planner import make_plan
    from kareus_fx.plan.request import PlanRequest

    root = tmp_path_factory.mktemp("recompute-plan")
    request = PlanRequest(**WORKLOAD, clock_stride_mhz=120, dtype="float32", recompute="full")
    outcome = make_plan(request, root / "work", progress=False)
    return write_plan(root / "plan.json", outcome.data), root / "work"


def _op_counts(dump_dir) -> dict[str, Counter]:
    (path,) = dump_dir.glob("kareus_graph_*.json")
    graphs = json.loads(path.read_text())["graphs"]
    return {g["name"]: Counter(n["op"] for n in g["nodes"] if n["kind"] in ("compute", "collective")) for g in graphs}


def test_full_recompute_plan_traces_the_recomputed_forward_into_the_backward(full_plan):
    from kareus_fx.plan.plan_format import load_plan

    plan_path, work = full_plan
    plan = load_plan(plan_path)
    assert plan.workload["recompute"] == "full"
    ops = _op_counts(work / "dumps" / "stage0-sequential")
    layers = WORKLOAD["layers"]
    # Each layer's attention runs forward again in the backward, before its gradient.
    assert ops["forward"]["kareus.attention.default"] == layers
    assert ops["backward"]["kareus.attention.default"] == layers
    assert ops["backward"]["kareus.attention_backward.default"] == layers
    # Without recompute the backward has two GEMMs per forward GEMM; the recomputed layers add theirs.
    assert ops["backward"]["aten.mm.default"] > 2 * ops["forward"]["aten.mm.default"]
    # The backward's TP all-reduces: one per column-parallel input gradient, plus recomputed ones.
    assert ops["backward"]["_c10d_functional.all_reduce.default"] > 2 * layers
    # Partitions and their types come out of the recomputing backward as before, and get tuned.
    tuned = Counter(t["graph"] for t in plan.data["partition_types"].values() if t["frontier"])
    assert tuned["backward"] >= 1 and tuned["forward"] >= 1, tuned


def _tiny_model(recompute: str):
    from kareus_fx.models import ParallelLayout, build_model

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = build_model(
        WORKLOAD["model"],
        ParallelLayout.from_default_group(tp=2, cp=1),
        num_layers=WORKLOAD["layers"],
        dtype=torch.float32,
        recompute=recompute,
    )
    model.init_weights(seed=0)
    return model


def _deploy_worker(rank, world_size, plan_path):
    from kareus_fx.passes.nanobatch import NanobatchFallbackWarning

    model = _tiny_model("full")
    batches = [model.example_batch(mbs=WORKLOAD["mbs"], seq=WORKLOAD["seq"], seed=mb) for mb in range(2)]
    eager_losses, eager_grads = train_microbatches(model, model, batches)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        compiled = torch.compile(
            model, backend="kareus", fullgraph=True, options={"plan": plan_path, "inductor": False}
        )
        losses, grads = train_microbatches(model, compiled, batches)
    fallbacks = [str(w.message) for w in record if issubclass(w.category, NanobatchFallbackWarning)]
    assert not fallbacks, fallbacks
    for loss, eager in zip(losses, eager_losses):
        torch.testing.assert_close(loss, eager, **TOL)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")

    plain = _tiny_model("none")
    compiled = torch.compile(plain, backend="kareus", fullgraph=True, options={"plan": plan_path, "inductor": False})
    try:
        compiled(**plain.example_batch(mbs=WORKLOAD["mbs"], seq=WORKLOAD["seq"])).backward()
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return None


def test_full_recompute_plan_deploys_on_the_checkpointed_model_only(full_plan):
    """Parity on the model with every layer under ``torch.utils.checkpoint``; the un-checkpointed
    model is refused before anything is compiled, naming the difference and the fix."""
    plan_path, _ = full_plan
    for message in run_distributed(_deploy_worker, 2, str(plan_path), timeout_s=600):
        assert message is not None
        assert "recompute differs" in message and "recompute=full" in message, message
        assert "checkpoints nothing" in message and "--recompute none" in message, message


def test_hf_gradient_checkpointing_splits_without_fallback_and_matches_eager():
    """``gradient_checkpointing_enable()`` (non-reentrant) on a Hugging Face Llama: one checkpointed
    region per decoder layer in Dynamo's graph, split into nanobatches with no fallback, the
    backward (aot_autograd, min-cut partitioner as the backend's) recomputes each layer's forward,
    and loss and gradients equal eager. One process: under TP, torch 2.13 cannot compile a
    checkpointed region over DTensor parameters at all (aot_autograd saves the DeviceMesh for the
    backward and asserts; plain ``aot_eager`` fails the same way), so the TP=2 parity with
    checkpointing is the reference model's above."""
    pytest.importorskip("transformers")
    from test_hf_models import _batch, _grads, _tiny_config
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from transformers import AutoModelForCausalLM

    from kareus_fx.models.recompute import checkpoint_regions
    from kareus_fx.passes.nanobatch import NanobatchFallbackWarning, split_nanobatches

    splits, regions, backward_ops = [], [], Counter()

    def backward_compiler(gm, example_inputs):
        backward_ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return boxed_nop(gm, example_inputs)

    def backend(gm, example_inputs):
        regions.append(checkpoint_regions(gm))
        splits.append(split_nanobatches(gm, example_inputs))
        return aot_autograd(
            fw_compiler=boxed_nop, bw_compiler=backward_compiler, partition_fn=min_cut_rematerialization_partition
        )(splits[-1].gm, example_inputs)

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = _tiny_config("llama")
    config.use_cache = False  # HF turns the cache off under checkpointing (with a logged warning Dynamo refuses)
    model = AutoModelForCausalLM.from_config(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = _batch()
    eager_loss = model(**batch).loss
    eager_loss.backward()
    eager_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loss = torch.compile(model, backend=backend, fullgraph=True)(**batch).loss
        loss.backward()
    torch._dynamo.reset()
    assert not [w for w in record if issubclass(w.category, NanobatchFallbackWarning)]
    assert regions == [config.num_hidden_layers]
    assert [(s.split, s.halves) for s in splits] == [(True, (2, 2))], [s.reason for s in splits]
    # Each nanobatch's layers run their q/k/v/o and MLP GEMMs again in the backward: 3 GEMMs per
    # forward GEMM of a layer (forward again, input gradient, weight gradient) instead of 2.
    layer_gemms = 2 * config.num_hidden_layers * 7  # nanobatches x layers x (q, k, v, o, gate, up, down)
    assert backward_ops["aten.mm.default"] >= 3 * layer_gemms, backward_ops["aten.mm.default"]
    torch.testing.assert_close(loss, eager_loss, **TOL)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, eager_grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_recompute_modes_are_checked_before_tracing():
    from kareus_fx.capture.tracing import TraceSpec, validate_trace_spec
    from kareus_fx.cli import _parser
    from kareus_fx.plan.request import plan_request_from_preset

    with pytest.raises(OptionsError, match=r"--recompute must be one of none, full, selective, got 'layers'"):
        validate_trace_spec(TraceSpec(model="tiny-llama", recompute="layers"))
    # The presets plan what the paper's testbed ran: full recompute (section 6.1).
    assert plan_request_from_preset("qwen3-1.7b-tp8-mbs8-seq4k").recompute == "full"
    assert plan_request_from_preset("qwen3-1.7b-tp8-mbs8-seq4k", recompute="none").recompute == "none"
    args = _parser().parse_args(["plan", "--preset", "qwen3-1.7b-tp8-mbs8-seq4k", "--recompute", "selective"])
    assert args.recompute == "selective"
