"""The TP token split of a mixture-of-experts block, eagerly on 2 gloo ranks: each rank keeps its
slice of a replicated tensor (its gradient all-gathered backward), and the slices' results are
all-gathered into a replicated tensor again (each rank keeping its own slice of the gradient), so
the replicated input's gradient is the whole one on every rank."""

from __future__ import annotations

import torch
from dist_harness import run_distributed

from kareus_fx.models.parallel import ParallelLayout, gather_along_tp, scatter_to_tp


def _split_and_gather(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    layout = ParallelLayout.from_default_group(tp=world_size)
    x = torch.arange(2 * 4 * 3, dtype=torch.float64).reshape(2, 4, 3).requires_grad_()
    part = scatter_to_tp(x, 1, layout.tp_group_name, world_size, rank)
    y = gather_along_tp(part * (rank + 1), 1, layout.tp_group_name, world_size, rank)
    y.sum().backward()
    assert x.grad is not None
    return part.detach(), y.detach(), x.grad


def test_tp_token_split_and_gather_keep_the_replicated_gradient():
    x = torch.arange(2 * 4 * 3, dtype=torch.float64).reshape(2, 4, 3)
    scale = torch.tensor([1.0, 1.0, 2.0, 2.0], dtype=torch.float64).reshape(1, 4, 1)
    for rank, (part, y, grad) in enumerate(run_distributed(_split_and_gather, 2, timeout_s=300)):
        torch.testing.assert_close(part, x[:, 2 * rank : 2 * rank + 2])
        torch.testing.assert_close(y, x * scale)
        torch.testing.assert_close(grad, scale.expand_as(x))
