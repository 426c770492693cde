"""A reference mixture-of-experts layer with expert parallelism (all-to-all dispatch and combine).

Top-k routing (softmax router, top-k weights normalised in place), ``experts`` SwiGLU experts
split evenly over the ranks of the expert-parallel group (rank ``r`` holds experts
``r * E_local .. (r + 1) * E_local - 1``), and an exchange by ``all_to_all_single`` with equal
splits: every rank sends every other rank one slot per (token, choice), the token's row where
that rank owns the chosen expert and zeros elsewhere, with the local expert id (or -1), and the
combine returns the same slots. Padded, fixed-size buffers keep every shape static (no
``.tolist()`` split sizes, so no data-dependent size reaches the compiler) at ``ep`` times the
traffic of a dropless exchange by counts; no token is ever dropped, so each token's output
depends on its own row alone and the nanobatch split is exact. The layer composes with the
tensor-parallel attention of :mod:`kareus_fx.models.transformer` (the experts replace the MLP of
a block; the expert-parallel group may be the TP group or another): ``build_model(...,
exact_moe=True)`` puts it in the sparse decoder layers of a model with ``config.moe``, so a
pipeline stage holds it with its expert-parallel group inside the stage.

Every collective goes through ``torch.distributed._functional_collectives`` (autograd variant),
so Dynamo traces the layer without a graph break and the backward exchanges the gradients back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

from kareus_fx.errors import ParallelConfigError
from kareus_fx.models.configs import MoEConfig


class ExpertParallelMoE(nn.Module):
    """``experts`` SwiGLU experts of hidden size ``hidden``, top-``top_k`` routing, experts split
    over ``group`` (None: one process holds them all and nothing is exchanged)."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        experts: int,
        top_k: int,
        group: dist.ProcessGroup | None = None,
        *,
        std: float = 0.02,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.ep = 1 if group is None else group.size()
        self.ep_rank = 0 if group is None else group.rank()
        if experts % self.ep:
            raise ParallelConfigError(f"{experts} experts do not split evenly over {self.ep} ranks")
        self.experts, self.top_k, self.local_experts = experts, top_k, experts // self.ep
        self.std = std
        self.w_gate = nn.Parameter(torch.empty(self.local_experts, dim, hidden, dtype=dtype))
        self.w_up = nn.Parameter(torch.empty(self.local_experts, dim, hidden, dtype=dtype))
        self.w_down = nn.Parameter(torch.empty(self.local_experts, hidden, dim, dtype=dtype))
        self.reset_parameters()
        self.router = nn.Linear(dim, experts, bias=False, dtype=dtype)  # after the experts: see reset_parameters

    @classmethod
    def from_config(
        cls,
        dim: int,
        moe: MoEConfig,
        group: dist.ProcessGroup | None,
        std: float,
        dtype: torch.dtype | None = None,
    ) -> ExpertParallelMoE:
        """The layer of a model's sparse decoder layer. It has no shared expert and always
        renormalises the top-k weights, so a config asking otherwise is refused rather than run
        as another model."""
        if moe.shared_ffn_size or not moe.normalize_top_k:
            raise ParallelConfigError(
                f"the exact expert-parallel layer has no shared expert and renormalises its top-k weights; "
                f"got shared_ffn_size={moe.shared_ffn_size}, normalize_top_k={moe.normalize_top_k}: use a "
                f"config with shared_ffn_size=0 and normalize_top_k=True"
            )
        return cls(dim, moe.expert_ffn_size, moe.experts, moe.top_k, group, std=std, dtype=dtype)

    def reset_parameters(self) -> None:
        """The local experts' weights, N(0, std). The router resets itself; drawn after the
        experts, as ``Module.modules()`` visits it, so re-initialising a model (e.g. after
        ``to_empty``) from a seed draws what building it from that seed drew."""
        for weight in (self.w_gate, self.w_up, self.w_down):
            nn.init.normal_(weight, 0.0, self.std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(batch, seq, dim)`` -> the same shape."""
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        weights, ids = torch.topk(F.softmax(self.router(tokens), dim=-1), self.top_k, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        slots = tokens.unsqueeze(1).expand(b * t, self.top_k, d).reshape(-1, d)  # (token, choice)
        slot_ids = ids.reshape(-1)
        owner = torch.div(slot_ids, self.local_experts, rounding_mode="floor")
        mine = owner.unsqueeze(0) == torch.arange(self.ep, device=x.device).unsqueeze(1)  # (ep, slots)
        send_rows = (slots.unsqueeze(0) * mine.unsqueeze(-1).to(slots.dtype)).reshape(-1, d)
        send_ids = torch.where(mine, (slot_ids % self.local_experts).unsqueeze(0), -1).reshape(-1)
        rows, local_ids = self._exchange(send_rows), self._exchange(send_ids)
        out = torch.zeros_like(rows)
        for e in range(self.local_experts):
            h = F.silu(rows @ self.w_gate[e]) * (rows @ self.w_up[e])
            out = out + (local_ids == e).unsqueeze(-1).to(rows.dtype) * (h @ self.w_down[e])
        back = self._exchange(out).reshape(self.ep, b * t * self.top_k, d).sum(dim=0)
        combined = (back * weights.reshape(-1, 1)).reshape(b * t, self.top_k, d).sum(dim=1)
        return combined.reshape(b, t, d)

    def _exchange(self, buffer: torch.Tensor) -> torch.Tensor:
        """Chunk ``r`` of ``buffer`` (equal chunks along dim 0) to rank ``r``; chunk ``r`` of the
        result from rank ``r``."""
        if self.group is None:
            return buffer
        return funcol.all_to_all_single_autograd(buffer, None, None, self.group)
