"""Hugging Face transformers models under ``backend="kareus"``, 2 gloo ranks, TP=2.

Models as users bring them: ``LlamaForCausalLM`` and ``Qwen3ForCausalLM`` (QK-norm) built from tiny
configs (no weights, no download; one decoder layer, two with sequence parallelism), the config's defaults kept (``use_cache=True``: a cache built in
the graph), a left-padding attention mask and HF's own loss from ``labels``. Sharded with
``parallelize_module``: the config's ``base_model_tp_plan`` (q/k/v, gate/up column-parallel; o,
down row-parallel), and once torchtitan's sequence parallelism (``SequenceParallel`` norms, an
all-gather before the column-parallel linears, a reduce-scatter after the row-parallel ones).
Each case is tuned and deployed at compile time (``options={"tune": "simulated", ...}``).

Each case must split into nanobatches with no ``NanobatchFallbackWarning`` and match the eager
sharded model: loss and every parameter gradient (this rank's shard), float32,
``rtol=1e-5, atol=1e-6`` (the split reorders the batch sums: the loss is recombined from the
halves' per-token sums, each weight gradient is the sum of two halves' gradients).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from dist_harness import run_distributed

pytest.importorskip("transformers")

TOL = {"rtol": 1e-5, "atol": 1e-6}
MBS, SEQ = 4, 16


def _tiny_config(arch: str, layers: int = 2):
    from transformers import LlamaConfig, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[arch]
    return cls(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(128, (MBS, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(MBS, SEQ, dtype=torch.long)
    mask[1, :5] = 0  # left padding in one row of each nanobatch
    mask[3, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _shard(model, mesh, sequence_parallel: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    tp_plan = {
        key.removeprefix("layers.*."): value
        for key, value in model.config.base_model_tp_plan.items()
        if value in styles
    }
    for i, layer in enumerate(model.model.layers):
        plan = {key: styles[value]() for key, value in tp_plan.items()}
        if sequence_parallel:  # torchtitan's layout: the residual stream is sharded on the sequence
            plan.update(
                {
                    "input_layernorm": SequenceParallel(),
                    "post_attention_layernorm": SequenceParallel(),
                    "self_attn": PrepareModuleInput(
                        input_kwarg_layouts={"hidden_states": Shard(1)},
                        desired_input_kwarg_layouts={"hidden_states": Replicate()},
                    ),
                    "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                    "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                    "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
                }
            )
            if i == 0:  # the embedding output enters the stack replicated: keep this rank's part
                plan[""] = PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
                )
        parallelize_module(layer, mesh, plan)
    if sequence_parallel:
        parallelize_module(
            model,
            mesh,
            {
                "model.norm": SequenceParallel(use_local_output=True),
                "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
            },
        )


def _grads(model) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).detach().clone()
        for name, p in model.named_parameters()
    }


def _hf_worker(rank, world_size, arch: str, sequence_parallel: bool, options: dict):
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from kareus_fx.capture import compile_step
    from kareus_fx.passes.nanobatch import NanobatchFallbackWarning, split_nanobatches
    from kareus_fx.plan import live_tuning

    splits = []

    def recording_split(gm, example_inputs, **kwargs):
        splits.append(split_nanobatches(gm, example_inputs, **kwargs))
        return splits[-1]

    compile_step.split_nanobatches = live_tuning.split_nanobatches = recording_split
    torch._dynamo.reset()
    torch.manual_seed(0)
    # One decoder layer: the split, tuning and parity do not depend on depth, and each layer costs
    # about a third of a case's CPU time. Sequence parallelism keeps two: the reduce-scatter of
    # one layer feeding the all-gather of the next is its own boundary.
    config = _tiny_config(arch, layers=2 if sequence_parallel else 1)
    assert config.use_cache  # the default config: HF builds a cache inside the graph
    model = AutoModelForCausalLM.from_config(config)
    _shard(model, init_device_mesh("cpu", (world_size,)), sequence_parallel)
    batch = _batch()

    eager_loss = model(**batch).loss
    eager_loss.backward()
    eager_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend="kareus", fullgraph=True, options=options)
        loss = compiled(**batch).loss
        loss.backward()
    fallbacks = [str(w.message) for w in record if issubclass(w.category, NanobatchFallbackWarning)]
    assert not fallbacks, fallbacks
    assert [s.split for s in splits] == [True], [s.reason for s in splits]
    torch.testing.assert_close(loss, eager_loss, **TOL)
    grads = _grads(model)
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")
    deployed = []
    if "tune" in options:
        from kareus_fx.deploy.variants import deployed_graphs

        deployed = [(g.name, g.nanobatched) for g in deployed_graphs()]
    return {"halves": splits[0].halves, "outputs": splits[0].outputs, "deployed": deployed}


@pytest.mark.parametrize(
    "arch, sequence_parallel, kinds",
    [
        # about 30 s on 2 cores: the Llama model runs in the sequence-parallel case and plain TP's
        # all-reduces in the Qwen3 case
        pytest.param("llama", False, ("all_reduce",), marks=pytest.mark.slow, id="llama-tp2"),
        pytest.param("qwen3", False, ("all_reduce",), id="qwen3-tp2"),
        pytest.param("llama", True, ("all_gather", "reduce_scatter"), id="llama-tp2-sequence-parallel"),
    ],
)
def test_hf_model_splits_without_fallback_tunes_deploys_and_matches_eager(arch, sequence_parallel, kinds, tmp_path):
    """Compile-time tuning on the simulated A100 (``tune: "simulated"``): the partitions of each
    graph's collectives (sequence parallelism: its all-gathers and reduce-scatters, tuned as
    all-reduces are) get frontiers, and the plan is deployed at compile time."""
    from kareus_fx.plan.plan_format import load_plan

    plan_out = tmp_path / "plan.json"
    options = {"tune": "simulated", "plan_out": str(plan_out)}
    for result in run_distributed(_hf_worker, 2, arch, sequence_parallel, options, timeout_s=600):
        assert result["halves"] == (2, 2)
        assert {name for name, _ in result["deployed"]} == {"forward", "backward"}, result["deployed"]
    plan = load_plan(plan_out)
    assert plan.data["simulated"]
    tuned = Counter(
        (t["graph"], t["collective"]["kind"]) for t in plan.data["partition_types"].values() if t["frontier"]
    )
    for graph in ("forward", "backward"):
        for kind in kinds:
            assert tuned[graph, kind] >= 1, tuned


def test_hf_llama_odd_batch_splits_unevenly_on_one_process():
    """No parallelism, batch 3 (nanobatches of 2 and 1): each nanobatch's mask lookup gets its own
    batch ``arange``; loss and gradients equal eager."""
    import warnings

    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from transformers import AutoModelForCausalLM

    from kareus_fx.passes.nanobatch import NanobatchFallbackWarning, split_nanobatches

    splits = []

    def backend(gm, example_inputs):
        splits.append(split_nanobatches(gm, example_inputs))
        return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop)(splits[-1].gm, example_inputs)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_config("llama"))
    batch = {k: v[1:] for k, v in _batch().items()}  # rows 1..3: padded, full, padded
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
    assert [(s.split, s.halves) for s in splits] == [(True, (2, 1))], [s.reason for s in splits]
    torch.testing.assert_close(loss, eager_loss, **TOL)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, eager_grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")
