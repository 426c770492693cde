"""The reference expert-parallel MoE layer (kareus_fx/models/moe.py) through ``backend="kareus"``.

2 gloo ranks, 4 experts (2 per rank), top-2, its dispatch and combine by ``all_to_all_single``
with equal splits: the graph must split into two nanobatches with no ``NanobatchFallbackWarning``
(each nanobatch exchanges its own tokens) and match the same layer in eager on each rank (fp32;
loss rtol 1e-5, gradients rtol 1e-4 atol 1e-6). Each rank routes its own tokens.
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
from kareus_fx.models.moe import ExpertParallelMoE


class _MeanSquare(nn.Module):
    def __init__(self, moe: ExpertParallelMoE):
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x).square().mean()


def _parity(rank: int, world_size: int) -> tuple[list[bool], list[str]]:
    from kareus_fx.passes.nanobatch import NanobatchFallbackWarning

    splits = record_splits()
    torch.manual_seed(0)
    model = _MeanSquare(ExpertParallelMoE(8, 16, experts=4, top_k=2, group=dist.group.WORLD, std=0.3))
    batch = {"x": torch.randn(4, 3, 8) + rank}
    eager_loss, eager_grads = eager_reference(model, batch)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loss = torch.compile(model, backend="kareus", options={"inductor": False})(**batch)
        loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    assert_matches_eager(model, loss, eager_loss, eager_grads, {"rtol": 1e-4, "atol": 1e-6}, f"rank {rank}")
    return splits, [str(w.message) for w in record if issubclass(w.category, NanobatchFallbackWarning)]


def test_expert_parallel_moe_splits_without_fallback_and_matches_eager():
    for splits, fallbacks in run_distributed(_parity, 2, timeout_s=300):
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
