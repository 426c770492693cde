"""The reference expert-parallel MoE layer (kareus_fx/models/moe.py) through ``backend="kareus"``.

2 gloo ranks, 4 experts (2 per rank), top-2, its dispatch and combine by ``all_to_all_single``
with equal splits: the graph must split into two nanobatches with no ``NanobatchFallbackWarning``
(each nanobatch exchanges its own tokens) and match the same layer in eager on each rank (fp32;
loss rtol 1e-5, gradients rtol 1e-4 atol 1e-6). Each rank routes its own tokens. Then the layer
behind tiny-qwen's tensor-parallel attention, its experts split over the TP group: the same.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist_harness import run_distributed
from eager_parity import assert_matches_eager, eager_reference
from split_recording import record_splits

from kareus_fx.errors import ParallelConfigError
from kareus_fx.models.configs import get_config
from kareus_fx.models.moe import ExpertParallelMoE
from kareus_fx.models.parallel import ParallelLayout
from kareus_fx.models.transformer import Attention, RMSNorm, RotaryEmbedding


class _MeanSquare(nn.Module):
    def __init__(self, moe: ExpertParallelMoE):
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x).square().mean()


def _compiled_parity(rank: int, model: nn.Module, x: torch.Tensor) -> tuple[list[bool], list[str]]:
    """Whether each graph split, and the fallback warnings, of ``model`` compiled with
    ``backend="kareus"``; its loss and gradients checked against eager on this rank."""
    from kareus_fx.passes.nanobatch import NanobatchFallbackWarning

    splits = record_splits()
    eager_loss, eager_grads = eager_reference(model, {"x": x})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loss = torch.compile(model, backend="kareus", options={"inductor": False})(x)
        loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    assert_matches_eager(model, loss, eager_loss, eager_grads, {"rtol": 1e-4, "atol": 1e-6}, f"rank {rank}")
    return splits, [str(w.message) for w in record if issubclass(w.category, NanobatchFallbackWarning)]


def _parity(rank: int, world_size: int) -> tuple[list[bool], list[str]]:
    torch.manual_seed(0)
    model = _MeanSquare(ExpertParallelMoE(8, 16, experts=4, top_k=2, group=dist.group.WORLD, std=0.3))
    return _compiled_parity(rank, model, torch.randn(4, 3, 8) + rank)


def test_expert_parallel_moe_splits_without_fallback_and_matches_eager():
    for splits, fallbacks in run_distributed(_parity, 2, timeout_s=300):
        assert not fallbacks, fallbacks
        assert splits == [True]


class _AttentionMoEBlock(nn.Module):
    """tiny-qwen's tensor-parallel attention (column-parallel q/k/v, row-parallel o, SDPA) and the
    expert-parallel MoE layer in place of the MLP, experts split over the same group."""

    def __init__(self, layout: ParallelLayout):
        super().__init__()
        config = get_config("tiny-qwen")
        self.rope = RotaryEmbedding(config, layout)
        self.attention_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attention = Attention(config, layout, attention="sdpa")
        self.moe_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.moe = ExpertParallelMoE(config.hidden_size, 32, experts=4, top_k=2, group=layout.tp_group, std=0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(x.shape[1], x.dtype)
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return (h + self.moe(self.moe_norm(h))).square().mean()


def _tp_attention_parity(rank: int, world_size: int) -> tuple[list[bool], list[str]]:
    torch.manual_seed(0)
    model = _AttentionMoEBlock(ParallelLayout.from_default_group(tp=world_size))
    return _compiled_parity(rank, model, torch.randn(4, 6, 64))


@pytest.mark.slow  # about a minute on a loaded machine (two ranks compile attention and the MoE)
def test_expert_parallel_moe_composes_with_tensor_parallel_attention():
    for splits, fallbacks in run_distributed(_tp_attention_parity, 2, timeout_s=300):
        assert not fallbacks, fallbacks
        assert splits == [True]


def test_experts_must_split_evenly_over_the_group():
    class _Group:
        def size(self) -> int:
            return 3

        def rank(self) -> int:
            return 0

    with pytest.raises(ParallelConfigError, match="4 experts"):
        ExpertParallelMoE(8, 16, experts=4, top_k=2, group=_Group())  # type: ignore[arg-type]
