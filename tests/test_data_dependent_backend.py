"""Graphs with data-dependent sizes through ``backend="kareus"``: they run, never raise.

An expert-parallel exchange as torchtitan writes it (``capture_scalar_outputs``; per-rank token
counts exchanged by an ``all_to_all_single``, turned into split sizes by ``.tolist()``, then the
tokens' dispatch and combine ``all_to_all_single`` with those split sizes) on 2 gloo ranks. The
split sizes are unbacked symbols: the nanobatch split falls back with one warning naming them and
the all-to-all that reads them, and the graph compiles unsplit with Inductor. Reference: the same module in eager, same inputs.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from dist_harness import run_distributed
from eager_parity import assert_matches_eager, eager_reference


class ExpertExchange(nn.Module):
    """Each token goes to rank 0 or the last rank by the sign of a feature, is transformed there
    and comes back to its place."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.up = nn.Linear(d, d)
        self.down = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        world_size = dist.get_world_size()
        h = self.up(x).flatten(0, 1)
        dest = (h[:, 0] > 0).long() * (world_size - 1)
        order = torch.argsort(dest, stable=True)
        counts = torch.bincount(dest, minlength=world_size)
        received = funcol.all_to_all_single(counts, None, None, dist.group.WORLD)
        in_splits, out_splits = counts.tolist(), received.tolist()
        sent = funcol.all_to_all_single_autograd(h[order], out_splits, in_splits, dist.group.WORLD)
        back = funcol.all_to_all_single_autograd(self.down(sent), in_splits, out_splits, dist.group.WORLD)
        return torch.empty_like(back).index_copy(0, order, back).square().sum()


def _run(rank: int, world_size: int) -> list[str]:
    from kareus_fx.passes.nanobatch import NanobatchFallbackWarning

    torch._dynamo.config.capture_scalar_outputs = True
    torch.manual_seed(0)
    model = ExpertExchange()
    x = torch.randn(4, 3, 8) + rank
    eager_loss, eager_grads = eager_reference(model, {"x": x})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loss = torch.compile(model, backend="kareus")(x)
        loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    assert_matches_eager(model, loss, eager_loss, eager_grads, {"rtol": 1e-4, "atol": 1e-6}, f"rank {rank}")
    return [str(w.message) for w in record if issubclass(w.category, NanobatchFallbackWarning)]


def test_expert_parallel_split_sizes_fall_back_and_run_with_inductor():
    for fallbacks in run_distributed(_run, 2, timeout_s=300):
        # the reason names the symbols and the collective whose split sizes they are
        assert fallbacks and all(
            "unbacked symbols" in m and "read by c10d.all_to_all_single" in m for m in fallbacks
        ), fallbacks
