"""The mixture-of-experts block of a traced reference model: a dropless expert-parallel exchange
priced by counts, with static shapes, for planning traces on the meta device.

A dropless MoE sends each (token, choice) row to the rank that owns the chosen expert, by counts
(Megatron-LM's all-to-all token dispatcher, DeepEP): how many rows go where depends on the
routing, which a trace on meta tensors cannot know. This block assumes the load that the planner
prices: every expert receives ``expert_imbalance`` times the uniform load, and every rank is
priced at that busiest rank's load, because the combine waits for the busiest rank. So with
``tokens`` routed tokens per rank, top-``k`` routing and ``ep`` ranks, every rank sends each peer
(itself included) and receives from each ``expert_imbalance * tokens * k / ep`` rows, rounded up
to whole rows per (batch element, expert): ``c = ceil(expert_imbalance * s * k / experts)`` rows
per expert of each sequence's ``s`` routed tokens. The step, per rank:

1. router: a linear to the expert logits, softmax (float32), top-k, the top-k weights renormalised
   (``normalize_top_k``) -- real work;
2. dispatch permutation: the (token, choice) slots of each sequence sorted by expert (``argsort``,
   the routing weights permuted alongside) and the tokens' rows selected into the send buffer
   (``index_select``; a fixed order stands in for the sort's, unknown on meta, repeated cyclically
   past the real slots when the assumed load exceeds them);
3. dispatch ``all_to_all_single`` with equal splits;
4. the local experts: one batched GEMM per projection over each expert's ``c`` rows from every
   peer and sequence (a grouped GEMM of equal groups), SwiGLU;
5. combine ``all_to_all_single`` back, then each slot's row put back in token order (an
   ``index_select``), weighted by its routing weight and summed over each token's ``k`` choices.

Buffers are laid out ``(ep, B, c * local experts)`` along dim 0 (peer, sequence, row), the layout
the nanobatch pass's all-to-all rule splits per nanobatch: each nanobatch exchanges its own
sequences' rows. A shared expert (``shared_ffn_size`` > 0) is a SwiGLU every routed token passes
through, added to the routed output.

Tensor parallelism: the block's input is replicated over the TP group (after attention's
row-parallel all-reduce). Each TP rank routes its own ``1 / tp`` of every sequence
(:func:`~kareus_fx.models.parallel.scatter_to_tp`: a slice forward, an all-gather of the gradient
backward) and the block's output is all-gathered over the TP group
(:func:`~kareus_fx.models.parallel.gather_along_tp`). Routed and shared experts are not
TP-sharded (expert tensor parallelism 1): each rank runs them on its own tokens with whole weights,
so the router and shared-expert weights are replicated over TP and their gradients partial sums
over it (summed outside the step's graph, like the QK-norm weights').

The block prices a step; it does not compute one: its rows are not the tokens the router chose.
It runs only on meta tensors and refuses real ones; the exact, runnable layer is
:class:`~kareus_fx.models.moe.ExpertParallelMoE`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from kareus_fx.errors import KareusError, ParallelConfigError
from kareus_fx.models.configs import MoEConfig
from kareus_fx.models.parallel import ParallelLayout, gather_along_tp, scatter_to_tp


class MetaOnlyError(KareusError, RuntimeError):
    """A planning-only module run on real tensors."""


class CountPricedMoE(nn.Module):
    """The sparse block of a decoder layer (see the module docstring); ``expert_imbalance`` >= 1
    is the busiest expert's load over the uniform one."""

    def __init__(
        self,
        hidden_size: int,
        moe: MoEConfig,
        layout: ParallelLayout,
        std: float,
        dtype: torch.dtype | None = None,
        expert_imbalance: float = 1.0,
    ) -> None:
        super().__init__()
        if moe.experts % layout.ep:
            raise ParallelConfigError(f"{moe.experts} experts do not split evenly over ep={layout.ep} ranks")
        if expert_imbalance < 1.0:
            raise ParallelConfigError(
                f"expert_imbalance is the busiest expert's load over the mean: >= 1, got {expert_imbalance}"
            )
        self.moe, self.std, self.expert_imbalance = moe, std, expert_imbalance
        self.tp, self.tp_rank, self.tp_group = layout.tp, layout.tp_rank, layout.tp_group_name
        self.ep, self.ep_group = layout.ep, layout.ep_group_name
        self.local_experts = moe.experts // layout.ep
        d, f = hidden_size, moe.expert_ffn_size
        self.router = nn.Parameter(torch.empty(moe.experts, d, dtype=dtype))
        self.w_gate_up = nn.Parameter(torch.empty(self.local_experts, d, 2 * f, dtype=dtype))
        self.w_down = nn.Parameter(torch.empty(self.local_experts, f, d, dtype=dtype))
        fs = moe.shared_ffn_size
        self.shared_gate_up = nn.Parameter(torch.empty(2 * fs, d, dtype=dtype)) if fs else None
        self.shared_down = nn.Parameter(torch.empty(d, fs, dtype=dtype)) if fs else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for p in self.parameters(recurse=False):
            nn.init.normal_(p, std=self.std)

    def rows_per_expert(self, seq: int) -> int:
        """Rows each expert receives from one sequence of ``seq`` routed tokens on one peer."""
        return math.ceil(self.expert_imbalance * seq * self.moe.top_k / self.moe.experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(batch, seq, hidden)``, replicated over TP -> the same shape."""
        if x.device.type != "meta":
            raise MetaOnlyError(
                "CountPricedMoE prices an expert-parallel step on meta tensors for planning traces and "
                "computes no real result; run kareus_fx.models.moe.ExpertParallelMoE (the exact, runnable "
                "layer) on real tensors"
            )
        x = scatter_to_tp(x, 1, self.tp_group, self.tp, self.tp_rank)
        b, s, d = x.shape
        k, rows = self.moe.top_k, self.local_experts * self.rows_per_expert(s)
        probs = F.linear(x, self.router).float().softmax(dim=-1)
        weights, ids = probs.topk(k, dim=-1)
        if self.moe.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # The permutation (Megatron-LM's): each sequence's slots sorted by expert, the routing
        # weights permuted alongside. Which token fills which row is unknown on meta, so the rows
        # are selected in a fixed order (row j holds slot j's token, cyclically past the real slots).
        order = ids.reshape(b, s * k).argsort(dim=1)
        sorted_weights = weights.reshape(b, s * k).gather(1, order).to(x.dtype)
        sent = self.ep * rows  # >= s * k: the assumed load covers every real slot
        slot = torch.arange(sent, device=x.device) % (s * k)
        send = x.index_select(1, slot // k)
        send = send.reshape(b, self.ep, rows, d).transpose(0, 1).reshape(sent * b, d)
        out = self._exchange(self._experts(self._exchange(send), b))
        out = out.reshape(self.ep, b, rows, d).transpose(0, 1).reshape(b, sent, d)
        # the un-permutation: each slot's row back in token order, weighted, summed per token
        slots = out.index_select(1, slot[: s * k]) * sorted_weights.unsqueeze(-1)
        y = slots.reshape(b, s, k, d).sum(dim=2)
        if self.shared_gate_up is not None and self.shared_down is not None:
            gate, up = F.linear(x, self.shared_gate_up).chunk(2, dim=-1)
            y = y + F.linear(F.silu(gate) * up, self.shared_down)
        return gather_along_tp(y, 1, self.tp_group, self.tp, self.tp_rank)

    def _experts(self, rows: torch.Tensor, b: int) -> torch.Tensor:
        """SwiGLU of ``rows`` (laid out peer, sequence, local expert, row) by their local experts:
        the rows regrouped by expert (the copy Megatron-LM's dispatcher makes after the exchange when
        a rank holds several experts), one batched GEMM per projection, and grouped back."""
        e, d = self.local_experts, rows.shape[-1]
        grouped = rows.reshape(self.ep, b, e, -1, d).permute(2, 0, 1, 3, 4).reshape(e, -1, d)
        gate, up = torch.bmm(grouped, self.w_gate_up).chunk(2, dim=-1)
        h = torch.bmm(F.silu(gate) * up, self.w_down)
        return h.reshape(e, self.ep, b, -1, d).permute(1, 2, 0, 3, 4).reshape(-1, d)

    def _exchange(self, buffer: torch.Tensor) -> torch.Tensor:
        """Chunk ``r`` of ``buffer`` (equal chunks along dim 0) to EP rank ``r``."""
        if self.ep_group is None:
            return buffer
        return funcol.all_to_all_single_autograd(buffer, None, None, self.ep_group)
