"""A small transformer tensor-parallelised with DTensor (``parallelize_module``).

The same block as ``transformer.py`` written the plain way (separate q/k/v, w1/w3/w2 linears,
replicated embedding and head) and sharded by ``torch.distributed.tensor.parallel``:
q/k/v and w1/w3 ``ColwiseParallel``, o and w2 ``RowwiseParallel``. ``forward`` returns a plain
loss tensor (the parallel styles hand out local tensors). Under ``torch.compile`` the DTensor
redistributions lower to the same ``_c10d_functional`` ops as the hand-written model: per block
2 all-reduces forward (after ``attn.wo`` and ``ffn.w2``) and 2 backward (gradients of the
replicated inputs of the column-parallel linears).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from kareus_fx.errors import ParallelConfigError


class _Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mbs, seq, _ = x.shape
        # -1: this rank's heads once wq/wk/wv are column-sharded
        q, k, v = (w(x).view(mbs, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(mbs, seq, -1))


class _FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.attn = _Attention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.ffn = _FeedForward(dim, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h))
        return h + self.ffn(self.ffn_norm(h))


class DTensorTransformer(nn.Module):
    """Embedding, ``num_layers`` blocks, norm, head; ``forward(input_ids, labels)`` -> mean loss."""

    def __init__(
        self,
        vocab: int = 256,
        dim: int = 64,
        n_heads: int = 4,
        hidden: int = 128,
        num_layers: int = 2,
    ) -> None:
        super().__init__()
        self.n_heads, self.hidden = n_heads, hidden
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_Block(dim, n_heads, hidden) for _ in range(num_layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def parallelize_dtensor_model(model: DTensorTransformer, mesh: DeviceMesh) -> DTensorTransformer:
    """Shard ``model``'s blocks over the 1-D ``mesh`` in place (Megatron column/row pattern).

    Every rank must hold the same unsharded weights (seed the RNG identically before building).
    """
    tp = mesh.size()
    for count, what in ((model.n_heads, "attention heads"), (model.hidden, "FFN channels")):
        if count % tp:
            raise ParallelConfigError(f"tp={tp} does not divide {count} {what}")
    plan = {
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(),
        "ffn.w1": ColwiseParallel(),
        "ffn.w3": ColwiseParallel(),
        "ffn.w2": RowwiseParallel(),
    }
    for block in model.layers:
        parallelize_module(block, mesh, plan)
    return model
