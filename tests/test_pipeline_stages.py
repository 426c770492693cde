"""Pipeline-parallel stages: layer split, stage groups, inputs, numerics and traced partition types.

Numerics (fp32, 2 gloo ranks, TP=2): tolerance ``rtol=1e-5, atol=1e-6`` on the loss and every
gradient. Running the stages one after another executes the whole model's kernels in the same
order, so the split agrees to rounding (the tied-embedding gradient is the sum of two copies'
gradients instead of one accumulation); a compiled stage differs from eager by the nanobatch
split's summation order of weight gradients (a few ulps).
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_distributed

from kareus_fx.capture.tracing import TraceSpec, distinct_stages, validate_trace_spec
from kareus_fx.errors import ParallelConfigError
from kareus_fx.models import (
    ParallelLayout,
    PipelineStage,
    StageGroup,
    build_model,
    get_config,
    group_stages,
    stage_layer_range,
)
from kareus_fx.models.stage_layers import even_layer_counts
from kareus_fx.plan.presets import PRESETS

TOL = {"rtol": 1e-5, "atol": 1e-6}


# ---------------------------------------------------------------- layer split and stage groups


@pytest.mark.parametrize(
    "num_layers,num_stages,sizes",
    [(28, 2, [14, 14]), (80, 10, [8] * 10), (30, 4, [8, 8, 7, 7]), (5, 1, [5]), (3, 3, [1, 1, 1])],
)
def test_stage_layer_range_splits_evenly_extra_layers_first(num_layers, num_stages, sizes):
    ranges = [stage_layer_range(num_layers, num_stages, i) for i in range(num_stages)]
    assert [len(r) for r in ranges] == sizes
    assert [i for r in ranges for i in r] == list(range(num_layers))  # contiguous, in order


def test_explicit_layer_counts_split_in_order_and_bad_counts_are_refused():
    ranges = [stage_layer_range(28, 2, i, (16, 12)) for i in range(2)]
    assert ranges == [range(0, 16), range(16, 28)]
    assert group_stages(28, 2, (16, 12)) == [StageGroup("first", 16, (0,)), StageGroup("last", 12, (1,))]
    assert group_stages(30, 4, (8, 8, 8, 6)) == [
        StageGroup("first", 8, (0,)),
        StageGroup("middle", 8, (1, 2)),
        StageGroup("last", 6, (3,)),
    ]
    with pytest.raises(ParallelConfigError, match=r"add up to the model's 28 layers; e.g. \[14, 14\]"):
        stage_layer_range(28, 2, 0, (16, 13))
    with pytest.raises(ParallelConfigError, match="must each be >= 1"):
        group_stages(28, 2, (28, 0))
    with pytest.raises(ParallelConfigError, match="3 stage layer counts"):
        PipelineStage(0, 2, (10, 10, 8))
    with pytest.raises(ParallelConfigError, match="add up to"):
        validate_trace_spec(TraceSpec(model="tiny-llama", pp=2, stage_layers=(1, 2)))


def test_group_stages_by_role_and_layer_count():
    assert group_stages(80, 10) == [
        StageGroup("first", 8, (0,)),
        StageGroup("middle", 8, tuple(range(1, 9))),
        StageGroup("last", 8, (9,)),
    ]
    assert group_stages(28, 2) == [StageGroup("first", 14, (0,)), StageGroup("last", 14, (1,))]
    assert group_stages(30, 4) == [
        StageGroup("first", 8, (0,)),
        StageGroup("middle", 8, (1,)),
        StageGroup("middle", 7, (2,)),
        StageGroup("last", 7, (3,)),
    ]
    assert group_stages(28, 1) == [StageGroup("single", 28, (0,))]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_distinct_stages_of_every_preset_cover_the_pipeline_once(name):
    preset = PRESETS[name]
    spec = TraceSpec(model=preset.model, tp=preset.tp, cp=preset.cp, pp=preset.pp)
    groups = distinct_stages(spec)
    assert sorted(s for g in groups for s in g.stages) == list(range(preset.pp))
    layers = get_config(preset.model).num_layers
    # Megatron-LM's even split: 126 layers over 16 stages are 7s and 8s (the first stages take the extra).
    assert {g.num_layers for g in groups} == set(even_layer_counts(layers, preset.pp))
    counts = even_layer_counts(layers, preset.pp)
    middles = len(set(counts[1:-1]))  # one group per distinct middle-stage layer count
    expected_roles = ["first", *["middle"] * middles, "last"] if preset.pp > 2 else ["first", "last"]
    assert [g.role for g in groups] == expected_roles


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"pp": 0}, r"pp must be >= 1, got pp=0; use pp=1"),
        ({"pp": 3, "layers": 2}, r"pp=3 pipeline stages need at least 3 decoder layers.*choose pp <= 2"),
        ({"pp": 2, "stage": 2}, r"--stage 2 is not a stage of a pp=2 pipeline; choose a stage in 0\.\.1"),
        ({"pp": 2, "stage": -1}, r"--stage -1 is not a stage"),
    ],
)
def test_validate_trace_spec_rejects_bad_pipelines(overrides, message):
    with pytest.raises(ParallelConfigError, match=message):
        validate_trace_spec(TraceSpec(model="tiny-llama", **overrides))


def test_llama70b_pp10_needs_at_most_80_stages():
    validate_trace_spec(TraceSpec(model="llama3.3-70b", tp=8, pp=80, stage=79))
    with pytest.raises(ParallelConfigError, match="choose pp <= 80"):
        distinct_stages(TraceSpec(model="llama3.3-70b", tp=8, pp=81))


# ---------------------------------------------------------------- stage modules and inputs


def _stages(name: str, pp: int, num_layers: int, layout: ParallelLayout | None = None, counts=None):
    return [build_model(name, layout, num_layers=num_layers, stage=PipelineStage(i, pp, counts)) for i in range(pp)]


def test_stage_modules_inputs_and_outputs():
    first, middle, last = _stages("tiny-llama", 3, num_layers=4)
    assert [len(s.layers) for s in (first, middle, last)] == [2, 1, 1]
    assert first.embed_tokens is not None and first.lm_head is None and first.norm is None
    assert middle.embed_tokens is None and middle.lm_head is None
    assert last.embed_tokens is None and last.lm_head is not None and last.loss_fn is not None
    assert last.full_parameter_name("layers.0.mlp.down_proj.weight") == "layers.3.mlp.down_proj.weight"

    hidden_size = get_config("tiny-llama").hidden_size
    batches = [s.example_batch(mbs=2, seq=8) for s in (first, middle, last)]
    assert set(batches[0]) == {"input_ids"} and set(batches[1]) == {"hidden"}
    assert set(batches[2]) == {"hidden", "labels"}
    for batch in batches[1:]:
        assert batch["hidden"].shape == (2, 8, hidden_size) and batch["hidden"].requires_grad
    whole = build_model("tiny-llama", num_layers=4).example_batch(mbs=2, seq=8)
    assert torch.equal(batches[0]["input_ids"], whole["input_ids"])
    assert torch.equal(batches[2]["labels"], whole["labels"])

    assert first(**batches[0]).shape == (2, 8, hidden_size)
    assert middle(**batches[1]).shape == (2, 8, hidden_size)
    assert last(**batches[2]).shape == ()
    with pytest.raises(ValueError, match=r"middle pipeline stage 1 of 3 needs 'hidden' and does not take 'input_ids'"):
        middle(input_ids=batches[0]["input_ids"])
    with pytest.raises(ValueError, match=r"first pipeline stage 0 of 3 does not take 'labels'"):
        first(**batches[0], labels=batches[2]["labels"])


def test_tied_embedding_first_and_last_stage_hold_copies():
    torch.manual_seed(0)
    whole = build_model("tiny-qwen")
    assert whole.lm_head.weight is whole.embed_tokens.weight
    first, last = _stages("tiny-qwen", 2, num_layers=2)
    assert last.lm_head.weight is not None and first.embed_tokens.weight is not last.lm_head.weight
    for stage in (first, last):
        stage.load_full_state_dict(whole.state_dict())
    assert torch.equal(first.embed_tokens.weight, last.lm_head.weight)
    assert torch.equal(last.lm_head.weight, whole.embed_tokens.weight)


def test_llama70b_pp10_middle_stage_full_size_on_meta():
    """A PP10 TP8 middle stage of Llama-3.3-70B builds and runs forward + backward on meta."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        layout = ParallelLayout.from_default_group(tp=8)
        with torch.device("meta"):
            stage = build_model("llama3.3-70b", layout, dtype=torch.bfloat16, stage=PipelineStage(4, 10))
        assert stage.layer_range == range(32, 40) and len(stage.layers) == 8
        batch = stage.example_batch(mbs=4, seq=4096, device="meta")
        assert batch["hidden"].shape == (4, 4096, 8192) and batch["hidden"].dtype == torch.bfloat16
        out = stage(**batch)
        torch.autograd.backward(out, grad_tensors=torch.empty_like(out))
        assert out.shape == (4, 4096, 8192) and batch["hidden"].grad.shape == (4, 4096, 8192)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- numerics: split == whole model


def _run_pipeline(stages, batch) -> torch.Tensor:
    """One microbatch through ``stages`` in order, then backward in reverse, as 1F1B runs it.

    Each stage's input is a fresh leaf (what a point-to-point receive gives); the gradient of a
    stage's output is the next stage's input gradient. Returns the last stage's loss.
    """
    outputs, inputs = [], []
    for stage in stages:
        kwargs = {}
        if stage.stage.is_first:
            kwargs["input_ids"] = batch["input_ids"]
        else:
            inputs.append(outputs[-1].detach().requires_grad_())
            kwargs["hidden"] = inputs[-1]
        if stage.stage.is_last:
            kwargs["labels"] = batch["labels"]
        outputs.append(stage(**kwargs))
    outputs[-1].backward()
    for output, next_input in zip(reversed(outputs[:-1]), reversed(inputs)):
        output.backward(next_input.grad)
    for stage in stages:
        stage.finalize_grads()
    return outputs[-1].detach()


def _split_matches_whole_worker(rank, world_size, name, pp, num_layers, counts=None):
    torch.manual_seed(0)
    reference = build_model(name, num_layers=num_layers)  # unsharded weights, same on every rank
    layout = ParallelLayout.from_default_group(tp=world_size)
    whole = build_model(name, layout, num_layers=num_layers)
    whole.load_full_state_dict(reference.state_dict())
    stages = _stages(name, pp, num_layers, layout, counts)
    for stage in stages:
        stage.load_full_state_dict(reference.state_dict())
    batch = whole.example_batch(mbs=4, seq=16)
    loss = whole(**batch)
    loss.backward()
    whole.finalize_grads()

    pipeline_loss = _run_pipeline(stages, batch)
    torch.testing.assert_close(pipeline_loss, loss.detach(), **TOL)
    expected = {n: p.grad for n, p in whole.named_parameters()}
    got: dict[str, torch.Tensor] = {}
    for stage in stages:
        for local_name, param in stage.named_parameters():
            full_name = stage.full_parameter_name(local_name)
            if full_name == "lm_head.weight" and not stage.ties_within and stage.config.tie_embeddings:
                full_name = "embed_tokens.weight"  # the tied weight's second copy: gradients add up
            got[full_name] = got[full_name] + param.grad if full_name in got else param.grad
    assert set(got) == set(expected)
    for full_name, grad in got.items():
        torch.testing.assert_close(
            grad, expected[full_name], **TOL, msg=lambda m, full_name=full_name: f"{full_name}: {m}"
        )


_SPLITS = {"2-2": (2, 2, None), "3-4": (3, 4, None), "3-5-uneven": (3, 5, (1, 3, 1))}
"""Pipeline stages, layers and explicit layer counts per stage, by case name."""
_SLOW_SPLITS = {("tiny-llama", "3-4"), ("tiny-qwen", "3-5-uneven")}
"""About 6 s each on 2 cores: each model runs 3 stages in the other of these two cases."""


@pytest.mark.parametrize(
    "name, pp, num_layers, counts",
    [
        pytest.param(
            name,
            *split,
            id=f"{name}-{case}",
            marks=[pytest.mark.slow] if (name, case) in _SLOW_SPLITS else [],
        )
        for name in ("tiny-llama", "tiny-qwen")
        for case, split in _SPLITS.items()
    ],
)
def test_pipeline_split_matches_whole_model_tp2(name, pp, num_layers, counts):
    """Even splits and an explicit uneven one (``PipelineStage.layer_counts``)."""
    run_distributed(_split_matches_whole_worker, 2, name, pp, num_layers, counts)


def _stage_step(model, batch, output_grad, fn):
    model.zero_grad(set_to_none=True)
    inputs = {k: v.detach().clone().requires_grad_() if k == "hidden" else v for k, v in batch.items()}
    out = fn(**inputs)
    torch.autograd.backward(out, grad_tensors=output_grad)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    grads["<hidden input>"] = inputs["hidden"].grad
    return out.detach(), grads


def _compiled_stage_worker(rank, world_size, index, dump_dir):
    from kareus_fx.passes.nanobatch import NanobatchFallbackWarning

    torch._dynamo.reset()
    layout = ParallelLayout.from_default_group(tp=world_size)
    model = build_model("tiny-llama", layout, num_layers=3, stage=PipelineStage(index, 3))
    model.init_weights(seed=0)
    batch = model.example_batch(mbs=4, seq=16)
    gen = torch.Generator().manual_seed(1)
    output_grad = None if model.stage.is_last else torch.randn(batch["hidden"].shape, generator=gen)
    eager_out, eager_grads = _stage_step(model, batch, output_grad, model)
    compiled = torch.compile(model, backend="kareus", options={"dump_dir": dump_dir}, fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, grads = _stage_step(model, batch, output_grad, compiled)
    torch.testing.assert_close(out, eager_out, **TOL)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")
    (path,) = Path(dump_dir).glob(f"kareus_graph_*_rank{dist.get_rank()}.json")
    forward = json.loads(path.read_text())["graphs"][0]
    kinds = Counter(n["collective"]["kind"] for n in forward["nodes"] if n["kind"] == "collective")
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, NanobatchFallbackWarning)]
    return dict(kinds), fallbacks


@pytest.mark.slow  # ~30 s each on 2 shared cores (Dynamo + aot_autograd in 2 processes)
@pytest.mark.parametrize("index", [1, 2], ids=["middle", "last"])
def test_compiled_stage_matches_eager_tp2(index, tmp_path):
    results = run_distributed(_compiled_stage_worker, 2, index, str(tmp_path))
    for kinds, fallbacks in results:
        assert fallbacks == []
        # One decoder layer, split in two nanobatches: o_proj and down_proj all-reduces twice;
        # the last stage adds the loss's all-gather per nanobatch.
        assert kinds == ({"all_reduce": 4} if index == 1 else {"all_reduce": 4, "all_gather": 2})


# ---------------------------------------------------------------- traced partition types per stage


def _partition_types(tmp_path, spec: TraceSpec) -> dict[str, dict[str, int]]:
    """{graph name: {partition type id: count}} of ``spec``'s traced stage (nanobatched)."""
    from kareus_fx.capture.dump import load_dump, partition_types_from_dump
    from kareus_fx.capture.tracing import trace_full_size
    from kareus_fx.passes.nanobatch import NanobatchFallbackWarning

    dump_dir = tmp_path / f"pp{spec.pp}-stage{spec.stage}-layers{spec.layers}"
    with warnings.catch_warnings():
        warnings.simplefilter("error", NanobatchFallbackWarning)
        (path,) = trace_full_size(spec, options={"dump_dir": str(dump_dir)}).dump_paths
    types: dict[str, dict[str, int]] = {}
    for partition_type in partition_types_from_dump(load_dump(path)).values():
        types.setdefault(partition_type.graph, {})[partition_type.type_id] = partition_type.count
    return types


@pytest.mark.slow  # four traces, ~1 min each
def test_stage_decoder_layers_map_onto_the_whole_models_partition_types(tmp_path):
    """Every stage kind (first, middle, last) of Qwen3-1.7B TP8 with 4 layers per stage has
    exactly the whole model's partition types: per direction one attention-side and one
    MLP-side all-reduce type (the types of the stage edges are one-offs and dissolve)."""
    base = TraceSpec(model="qwen3-1.7b", tp=8, mbs=8, seq=4096)
    whole = _partition_types(tmp_path, TraceSpec(**{**base.__dict__, "layers": 4}))
    assert {graph: len(types) for graph, types in whole.items()} == {"forward": 2, "backward": 2}
    stages = {
        "first": TraceSpec(**{**base.__dict__, "layers": 8, "pp": 2, "stage": 0}),
        "last": TraceSpec(**{**base.__dict__, "layers": 8, "pp": 2, "stage": 1}),
        "middle": TraceSpec(**{**base.__dict__, "layers": 12, "pp": 3, "stage": 1}),
    }
    for role, spec in stages.items():
        types = _partition_types(tmp_path, spec)
        for graph in ("forward", "backward"):
            assert set(types[graph]) == set(whole[graph]), (role, graph, types[graph], whole[graph])
