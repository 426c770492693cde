"""The exact expert-parallel MoE layer in a pipeline: 2 stages x TP2, EP over each stage's TP group.

4 gloo ranks (ranks 0-1 stage 0, 2-3 stage 1; pipelines {0, 2} and {1, 3}), tiny-moe with 4
layers and no shared expert, built with ``exact_moe=True``: stage 0 holds the dense layer 0 and
the sparse layer 1, stage 1 the sparse layers 2 and 3, each sparse layer's 8 experts split over
the stage's two TP ranks (all-to-all dispatch and combine inside the stage). ``Schedule1F1B`` runs
3 microbatches of [2, 16] tokens through plain ``PipelineStage`` s, once over the eager stage
module and once over the same module compiled with ``backend="kareus"`` (no plan). Every stage's
graph must split into two nanobatches with no ``NanobatchFallbackWarning``, and the last stage's
losses and every parameter gradient on every rank must equal eager's (fp32; loss rtol 1e-5,
gradients rtol 1e-4 atol 1e-6).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import cast

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_distributed
from split_recording import record_splits
from test_torch_pipelining import _step

MICROBATCHES, MBS, SEQ, LAYERS = 3, 2, 16, 4


def _stage_module(layout):
    """This rank's stage of tiny-moe without its shared expert; the experts redrawn per EP rank
    (N(0, 0.3): a building seed shared by the ranks would give every rank the same experts)."""
    from kareus_fx.models import PipelineStage, build_model, get_config
    from kareus_fx.models.stage_module import StageModule

    config = get_config("tiny-moe")
    assert config.moe is not None
    config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, shared_ffn_size=0))
    torch.manual_seed(0)
    model = build_model(
        config, layout, num_layers=LAYERS, stage=PipelineStage(layout.pp_rank, layout.pp), exact_moe=True
    )
    torch.manual_seed(1 + layout.ep_rank)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.rsplit(".", 1)[-1] in ("w_gate", "w_up", "w_down"):
                param.normal_(0.0, 0.3)
    return StageModule(model)


def _prefixed(label: str) -> Callable[[str], str]:
    """An ``assert_close`` message: ``label``, then the mismatch it reports."""
    return lambda message: f"{label}: {message}"


def _pipeline_worker(rank, world_size):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from kareus_fx.deploy.pipelining import pipeline_group, stage_loss
    from kareus_fx.models import ParallelLayout
    from kareus_fx.passes.nanobatch import NanobatchFallbackWarning

    torch._dynamo.reset()
    layout = ParallelLayout.from_default_group(tp=2, pp=2, ep=2)
    group, stage, cpu = pipeline_group(layout), layout.pp_rank, torch.device("cpu")
    module = _stage_module(layout)
    parts = [module.model.example_batch(mbs=MBS, seq=SEQ, seed=mb) for mb in range(MICROBATCHES)]
    batch = {k: torch.cat([p[k] for p in parts]) for k in ("input_ids", "labels") if k in parts[0]}

    eager_stage = PipelineStage(module, stage, layout.pp, cpu, group=group)
    eager_losses, eager_grads = _step(Schedule1F1B(eager_stage, MICROBATCHES, loss_fn=stage_loss), module, stage, batch)

    splits = record_splits()
    compiled = cast(
        torch.nn.Module, torch.compile(module, backend="kareus", fullgraph=True, options={"inductor": False})
    )
    kareus_stage = PipelineStage(compiled, stage, layout.pp, cpu, group=group)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, grads = _step(Schedule1F1B(kareus_stage, MICROBATCHES, loss_fn=stage_loss), module, stage, batch)

    assert len(losses) == len(eager_losses) == (MICROBATCHES if stage == 1 else 0)
    for loss, eager in zip(losses, eager_losses):
        torch.testing.assert_close(loss, eager, rtol=1e-5, atol=0)
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-4, atol=1e-6, msg=_prefixed(f"rank {rank} {name}"))
    return {
        "stage": stage,
        "pipeline": dist.get_process_group_ranks(group),
        "experts": sorted(n for n in grads if n.endswith("w_gate")),
        "splits": splits,
        "fallbacks": [str(w.message) for w in caught if issubclass(w.category, NanobatchFallbackWarning)],
    }


@pytest.mark.slow
def test_expert_parallel_moe_in_a_two_stage_pipeline_splits_and_matches_eager():
    for rank, result in enumerate(run_distributed(_pipeline_worker, 4, timeout_s=900)):
        assert result["stage"] == rank // 2 and result["pipeline"] == [rank % 2, rank % 2 + 2]
        sparse_layers = [1] if rank < 2 else [0, 1]  # stage-local numbering; layer 0 is dense
        assert result["experts"] == [f"model.layers.{i}.mlp.w_gate" for i in sparse_layers]
        assert result["splits"] and all(result["splits"]), result["splits"]
        assert not result["fallbacks"], result["fallbacks"]


def test_the_exact_layer_refuses_a_shared_expert():
    from kareus_fx.errors import ParallelConfigError
    from kareus_fx.models import build_model

    with pytest.raises(ParallelConfigError, match="shared_ffn_size=32"):
        build_model("tiny-moe", exact_moe=True)


def test_reinitialising_the_exact_layer_from_a_seed_draws_what_building_it_drew():
    from kareus_fx.models import build_model, get_config

    config = get_config("tiny-moe")
    assert config.moe is not None
    config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, shared_ffn_size=0))
    torch.manual_seed(3)
    built = build_model(config, exact_moe=True)
    with torch.device("meta"):
        meta = build_model(config, exact_moe=True)
    meta.to_empty(device="cpu")
    meta.init_weights(seed=3)
    for (name, param), (_, drawn) in zip(built.named_parameters(), meta.named_parameters()):
        torch.testing.assert_close(drawn, param, rtol=0, atol=0, msg=_prefixed(name))
