"""Fused causal attention as one opaque op forward and one backward: ``kareus::attention``.

Why an op of our own: on the meta device (full-size planning on a CPU) PyTorch's
``scaled_dot_product_attention`` always takes the math path, which materialises the
``[batch, heads, seq_q, seq_k]`` score matrix in the aten graph; the costs of that graph have
nothing to do with the flash-attention kernel a GPU runs. This op keeps attention one node in
the forward graph and one in the backward graph everywhere (meta, CPU, GPU), with exact FLOPs.

Semantics: causal attention aligned to the lower right: query ``i`` (of ``seq_q``) sees keys
``j <= i + seq_k - seq_q``. With ``seq_q == seq_k`` that is plain causal attention; a
context-parallel rank whose queries are a later chunk passes the key prefix that ends where its
chunk ends. ``k``/``v`` may have fewer heads than ``q`` (grouped-query attention).
The backward recomputes the forward (as flash attention does) and is exact. Both run the
reference math here; on a GPU the forward's ``scaled_dot_product_attention`` picks a fused
kernel, while the backward still materialises the scores (a fused CUDA backward is future work:
it changes speed on a GPU, not the graph or the numbers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _causal_mask(seq_q: int, seq_k: int, device: torch.device) -> Tensor:
    return torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).tril(diagonal=seq_k - seq_q)


def _reference_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    if seq_q == seq_k:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    mask = _causal_mask(seq_q, seq_k, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


@torch.library.custom_op("kareus::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Lower-right-aligned causal attention of ``q [b, h, sq, d]`` over ``k, v [b, hkv, sk, d]``."""
    if k.shape[-2] < q.shape[-2]:
        raise ValueError(f"attention needs seq_k >= seq_q, got seq_q={q.shape[-2]}, seq_k={k.shape[-2]}")
    # Contiguous, like the fake: SDPA's CPU kernels may return another layout for transposed inputs.
    return _reference_attention(q, k, v, scale).contiguous()


@attention.register_fake
def _attention_fake(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


@torch.library.custom_op("kareus::attention_backward", mutates_args=())
def attention_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`attention` with respect to ``q``, ``k`` and ``v``.

    Explicit softmax-attention backward (the op runs below autograd, so no autograd here):
    with ``P = softmax(mask(q k^T scale))``: ``dV = P^T dO``, ``dP = dO V^T``,
    ``dS = P (dP - rowsum(dP P))``, ``dQ = dS K scale``, ``dK = dS^T Q scale``; grouped-query
    heads sum their gradients into the shared K/V head.
    """
    group = q.shape[1] // k.shape[1]
    k_full = k.repeat_interleave(group, dim=1)
    v_full = v.repeat_interleave(group, dim=1)
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    scores = (q @ k_full.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~_causal_mask(seq_q, seq_k, q.device), float("-inf"))
    probs = scores.softmax(dim=-1)
    grad_v_full = probs.transpose(-1, -2) @ grad_out
    grad_probs = grad_out @ v_full.transpose(-1, -2)
    grad_scores = probs * (grad_probs - (grad_probs * probs).sum(dim=-1, keepdim=True))
    grad_q = (grad_scores @ k_full) * scale
    grad_k_full = (grad_scores.transpose(-1, -2) @ q) * scale

    def fold(t: Tensor) -> Tensor:
        return t.unflatten(1, (k.shape[1], group)).sum(dim=2)

    return grad_q.contiguous(), fold(grad_k_full).contiguous(), fold(grad_v_full).contiguous()


@attention_backward.register_fake
def _attention_backward_fake(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    # Contiguous like the real op's matmul outputs (not empty_like: q, k, v are usually transposed
    # views, and a stride mismatch breaks the views aot_autograd puts after this op).
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, scale = inputs
    ctx.save_for_backward(q, k, v)
    ctx.scale = scale


def _backward(ctx, grad_out: Tensor):
    q, k, v = ctx.saved_tensors
    grad_q, grad_k, grad_v = attention_backward(grad_out.contiguous(), q, k, v, ctx.scale)
    return grad_q, grad_k, grad_v, None


attention.register_autograd(_backward, setup_context=_setup_context)


def causal_pair_fraction(seq_q: int, seq_k: int) -> float:
    """Share of the ``seq_q x seq_k`` score matrix that lower-right causal attention computes."""
    offset = seq_k - seq_q
    visible = seq_q * offset + seq_q * (seq_q + 1) // 2
    return visible / (seq_q * seq_k)


def attention_flops(q_shape: torch.Size, k_shape: torch.Size, v_shape: torch.Size) -> float:
    """Forward FLOPs: two matmuls (scores, weighted values) over the visible causal pairs."""
    batch, heads, seq_q, head_dim = q_shape
    seq_k, value_dim = k_shape[-2], v_shape[-1]
    dense = 2.0 * batch * heads * seq_q * seq_k * (head_dim + value_dim)
    return dense * causal_pair_fraction(seq_q, seq_k)


def attention_backward_flops(q_shape: torch.Size, k_shape: torch.Size, v_shape: torch.Size) -> float:
    """Backward FLOPs of a flash-style kernel: the score recomputation plus four matmuls (2.5x forward)."""
    return 2.5 * attention_flops(q_shape, k_shape, v_shape)
