"""A decoder-only transformer (Llama 3 / Qwen3) with Megatron-style tensor and context parallelism.

Layer structure (Hugging Face numerics; Megatron-LM's fused projections)::

    h = embed_tokens(input_ids)
    for layer in layers:                      # layers.{i}
        h = h + self_attn(input_layernorm(h))     # qkv_proj (column) -> [q_norm, k_norm]
                                                  #   -> RoPE -> [CP: all-gather K, V]
                                                  #   -> causal attention -> o_proj (row)
        h = h + mlp(post_attention_layernorm(h))  # gate_up_proj (column) -> SiLU(gate) * up
                                                  #   -> down_proj (row)
    loss = loss_fn(lm_head(norm(h)), labels)  # mean cross-entropy over this rank's tokens

Tensor parallelism (TP group of ``layout.tp`` ranks): a column-parallel linear starts with
``copy_to_tp`` (identity forward, all-reduce backward), a row-parallel one ends with
``reduce_from_tp`` (all-reduce forward, identity backward). Each decoder layer therefore issues
exactly 2 all-reduces forward (``self_attn.o_proj``, ``mlp.down_proj``) and 2 backward
(``self_attn.qkv_proj``, ``mlp.gate_up_proj``).

Embedding and LM head are vocab-parallel, as in Megatron-LM (a replicated LM head would repeat
the largest GEMM of a small model ``tp`` times and hold ``tp`` copies of its weight). Outside
the decoder layers this costs, per step:

* ``embed_tokens``: 1 all-reduce forward ([mbs, seq, hidden]; rows of other ranks' vocab shards
  are zero), none backward;
* ``lm_head``: none forward, 1 all-reduce backward (its ``copy_to_tp``, [mbs, seq, hidden]);
* ``loss_fn``: 1 all-gather forward of 2 floats per token (each TP rank's log-sum-exp over its
  vocab shard and its label logit, or 0 when the label is outside its shard), none backward.
  Megatron's vocab-parallel cross-entropy uses 3 all-reduces (max, label logit, sum of exp) for
  the same result.

Qwen3's QK-norm weights are shared by all heads while each TP rank sees only its own heads, so
under TP their gradients are partial sums; :meth:`Transformer.finalize_grads` sums them over the
TP group after backward, outside the step's graph, so the layers keep 2 all-reduces each way.

So a TP step has ``2 * num_layers + 1`` all-reduces and 1 all-gather forward and
``2 * num_layers + 1`` all-reduces backward. Every collective node's ``nn_module_stack`` names
its module (``layers.{i}.self_attn.o_proj``, ``embed_tokens``, ``lm_head``, ``loss_fn``), so a
graph dump can tell layer collectives from embedding / loss ones.

Context parallelism (CP group of ``layout.cp`` ranks; the scheme of Llama 3 training): each
rank holds a contiguous ``seq / cp`` chunk of every sequence; RoPE positions are offset by
``cp_rank * chunk``; each layer all-gathers K and then V along the sequence (two consecutive
all-gathers forward, two reduce-scatters backward) and attends over the gathered keys up to the
end of its own chunk (causal attention aligned to the lower right). The loss is the mean over this
rank's chunk; the full-sequence loss is the mean of the CP ranks' losses and the full gradient
the CP-mean of the ranks' gradients, which :meth:`Transformer.finalize_grads` computes (as
Megatron's data/context-parallel gradient all-reduce does, outside the step's graph).

Labels are targets already aligned with ``input_ids`` (``labels[:, t]`` is the token after
``input_ids[:, t]``): shifting inside a CP chunk would need the neighbouring rank's first token.
Every label counts (no ignore index), so the loss is a plain mean.

Attention is ``kareus::attention`` (``kareus_fx.models.attention_op``: one node forward and one
backward on every device, exact causal FLOPs) unless built with ``attention="sdpa"``.

An unsharded model's weights (or gradients) map onto a layout with
:meth:`Transformer.shard_full_state_dict` / :meth:`Transformer.load_full_state_dict`, which
is how the tests build identical sharded and unsharded copies.

Pipeline parallelism (``stage=PipelineStage(index, num_stages)``; see ``stage_layers.py`` for the
layer split): a stage holds its own decoder layers, numbered from 0 (``layers.0`` of stage 1 is
global layer ``stage_layer_range(...)[0]``; :meth:`Transformer.full_parameter_name` maps back).
The first stage also holds ``embed_tokens`` and returns the hidden states after its layers; a
middle stage maps hidden states to hidden states; the last stage holds ``norm``, ``lm_head`` and
``loss_fn`` and returns the loss. Hidden states between stages are [mbs, seq / cp, hidden] in the
model's dtype; the point-to-point sends between stages are outside the stage's graph (as in
Megatron's schedule), so a stage's graphs carry only its TP / CP collectives. With tied
embeddings and more than one stage, the first stage's ``embed_tokens.weight`` and the last stage's
``lm_head.weight`` are two copies of one weight, as in Megatron-LM: they must start equal
(:meth:`Transformer.load_full_state_dict` loads both from ``embed_tokens.weight``) and the sum of
their two gradients is the tied weight's gradient (Megatron's embedding-group all-reduce, a step
outside the stage's graph, like :meth:`Transformer.finalize_grads`).

Mixture of experts (``config.moe``): decoder layers from ``config.moe.dense_layers`` on (global
layer index, so every pipeline stage gets its own right) have the sparse block
:class:`~kareus_fx.models.moe_pricing.CountPricedMoE` as ``mlp``: a router, the expert all-to-alls
over the EP group (``layout.ep`` ranks) and the experts, with the exchange priced by counts under an
assumed expert load (``expert_imbalance``). Under TP each rank routes its ``1 / tp`` of every
sequence and the block's output is all-gathered over the TP group, so a sparse layer issues 1
all-reduce (``self_attn.o_proj``), 2 all-to-alls and 1 all-gather forward, and 1 all-reduce
(``self_attn.qkv_proj``), 2 all-to-alls and 1 all-gather (of the token slice's gradient) backward.
The sparse block prices a step for planning and runs on the meta device only; the exact, runnable
expert-parallel layer is :class:`~kareus_fx.models.moe.ExpertParallelMoE`, which ``exact_moe=True``
puts in the sparse layers instead (its experts split over the layout's EP group, its router and
experts on every rank's whole, replicated input: no shared expert, see its ``from_config``).

The model has no data-dependent Python control flow and no ``.item()``: it builds and runs on the
meta device at full size (build under ``with torch.device("meta")``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kareus_fx.errors import ParallelConfigError
from kareus_fx.models.attention_op import attention as kareus_attention
from kareus_fx.models.configs import ModelConfig, get_config
from kareus_fx.models.moe import ExpertParallelMoE
from kareus_fx.models.moe_pricing import CountPricedMoE
from kareus_fx.models.parallel import (
    ParallelLayout,
    copy_to_tp,
    cp_all_gather,
    gather_from_tp,
    reduce_from_tp,
)
from kareus_fx.models.recompute import check_recompute
from kareus_fx.models.stage_layers import PipelineStage, stage_layer_range


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32 (Hugging Face ``LlamaRMSNorm`` numerics)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class ColumnParallelLinear(nn.Module):
    """``copy_to_tp`` then a linear whose output features are sharded over TP (no bias).

    ``out_segments`` lists the fused outputs (e.g. q, k, v); each segment is sharded separately,
    so this rank's weight is ``[seg_0 shard; seg_1 shard; ...]``.
    """

    def __init__(
        self,
        in_features: int,
        out_segments: tuple[int, ...],
        layout: ParallelLayout,
        std: float,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.out_segments = out_segments
        self.tp, self.tp_rank, self.tp_group = layout.tp, layout.tp_rank, layout.tp_group_name
        self.std = std
        local_out = sum(s // layout.tp for s in out_segments)
        self.weight = nn.Parameter(torch.empty(local_out, in_features, dtype=dtype))
        self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.tp_group), self.weight)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.std)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the unsharded weight ``full``."""
        return torch.cat([seg.chunk(self.tp, 0)[self.tp_rank] for seg in full.split(self.out_segments, 0)])


class RowParallelLinear(nn.Module):
    """A linear whose input features are sharded over TP, then ``reduce_from_tp`` (no bias)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        layout: ParallelLayout,
        std: float,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp, self.tp_rank, self.tp_group = layout.tp, layout.tp_rank, layout.tp_group_name
        self.std = std
        self.weight = nn.Parameter(torch.empty(out_features, in_features // layout.tp, dtype=dtype))
        self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(F.linear(x, self.weight), self.tp_group)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.std)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        return full.chunk(self.tp, 1)[self.tp_rank]


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (vocabulary) are sharded over TP; 1 all-reduce forward."""

    def __init__(self, vocab_size: int, dim: int, layout: ParallelLayout, std: float, dtype=None) -> None:
        super().__init__()
        self.tp, self.tp_rank, self.tp_group = layout.tp, layout.tp_rank, layout.tp_group_name
        self.local_vocab = vocab_size // layout.tp
        self.std = std
        self.weight = nn.Parameter(torch.empty(self.local_vocab, dim, dtype=dtype))
        self.reset_parameters()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.tp_rank * self.local_vocab
        outside = (local < 0) | (local >= self.local_vocab)
        emb = F.embedding(local.masked_fill(outside, 0), self.weight)
        return reduce_from_tp(emb.masked_fill(outside.unsqueeze(-1), 0.0), self.tp_group)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.std)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        return full.chunk(self.tp, 0)[self.tp_rank]


class VocabParallelCrossEntropy(nn.Module):
    """Mean cross-entropy of vocab-sharded logits, in float32; 1 all-gather forward.

    Each TP rank reduces its shard to (log-sum-exp, label logit or 0) per token; one all-gather
    brings every rank's pair, and the replicated loss is ``logsumexp_r(lse_r) - sum_r(label_r)``.
    """

    def __init__(self, vocab_size: int, layout: ParallelLayout) -> None:
        super().__init__()
        self.tp_rank, self.tp_group = layout.tp_rank, layout.tp_group_name
        self.local_vocab = vocab_size // layout.tp

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        local = labels - self.tp_rank * self.local_vocab
        inside = (local >= 0) & (local < self.local_vocab)
        picked = logits.gather(-1, local.clamp(0, self.local_vocab - 1).unsqueeze(-1)).squeeze(-1)
        stats = torch.stack([torch.logsumexp(logits, -1), picked * inside], dim=0)
        stats = gather_from_tp(stats, self.tp_group, self.tp_rank)  # [tp, 2, mbs, seq]
        return (torch.logsumexp(stats[:, 0], 0) - stats[:, 1].sum(0)).mean()


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies (float32, [head_dim / 2]), with Llama 3 scaling if configured."""
    dim = config.head_dim
    inv = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    s = config.rope_scaling
    if s is not None:  # transformers' _compute_llama3_parameters
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv.float()


class RotaryEmbedding(nn.Module):
    """cos/sin tables for this CP rank's positions ``cp_rank * seq + [0, seq)``."""

    inv_freq: torch.Tensor  # a buffer (registered in __init__)

    def __init__(self, config: ModelConfig, layout: ParallelLayout) -> None:
        super().__init__()
        self.config = config
        self.cp_rank = layout.cp_rank
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(self, seq: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(seq, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(pos + self.cp_rank * seq, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)  # [seq, 1, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.inv_freq.copy_(rope_inv_freq(self.config))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ([mbs, seq, heads, head_dim]) by its positions' angles."""
    return x * cos + _rotate_half(x) * sin


ATTENTION_IMPLS = ("kareus", "sdpa")


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layout: ParallelLayout,
        dtype=None,
        attention: str = "kareus",
        recompute_core: bool = False,
    ) -> None:
        super().__init__()
        d, std = config.head_dim, config.init_std
        self.head_dim = d
        self.attention = attention
        self.recompute_core = recompute_core
        """Checkpoint the core attention (``recompute="selective"``, see ``recompute.py``)."""
        self.local_heads = config.num_heads // layout.tp
        self.local_kv_heads = config.num_kv_heads // layout.tp
        self.cp, self.cp_rank, self.cp_group = layout.cp, layout.cp_rank, layout.cp_group_name
        segments = (config.num_heads * d, config.num_kv_heads * d, config.num_kv_heads * d)
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, segments, layout, std, dtype)
        if config.qk_norm:
            # Shared by all heads while each TP rank sees its own heads only: under TP their
            # gradients are partial sums (see Transformer.finalize_grads).
            self.q_norm: RMSNorm | None = RMSNorm(d, config.norm_eps, dtype)
            self.k_norm: RMSNorm | None = RMSNorm(d, config.norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.o_proj = RowParallelLinear(config.num_heads * d, config.hidden_size, layout, std, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        mbs, seq, _ = x.shape
        d, hq, hkv = self.head_dim, self.local_heads, self.local_kv_heads
        q, k, v = self.qkv_proj(x).split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(mbs, seq, hq, d), k.view(mbs, seq, hkv, d), v.view(mbs, seq, hkv, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q = q.transpose(1, 2)  # [mbs, heads, seq, d]
        if self.cp == 1:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        else:
            # Sequence-first copies first: a dim-0 all-gather needs no concatenation after it,
            # so the K and V all-gathers are adjacent in the graph (ready to be fused).
            k, v = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
            k = cp_all_gather(k, 0, self.cp_group)  # [cp * seq, mbs, hkv, d]
            v = cp_all_gather(v, 0, self.cp_group)
            # Causal: this rank's queries (positions cp_rank * seq + [0, seq)) see only the
            # keys up to the end of their own chunk.
            end = (self.cp_rank + 1) * seq
            k, v = k[:end].permute(1, 2, 0, 3), v[:end].permute(1, 2, 0, 3)
        out = checkpoint(self._attend, q, k, v, use_reentrant=False) if self.recompute_core else self._attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(mbs, seq, hq * d))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention aligned to the lower right: the last query sees the last key."""
        if self.attention == "kareus":
            return kareus_attention(q, k, v, self.head_dim**-0.5)
        gqa = q.shape[1] != k.shape[1]
        seq_q, seq_k = q.shape[2], k.shape[2]
        if seq_q == seq_k:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        # SDPA's is_causal aligns to the upper left, so a key prefix needs an explicit mask
        mask = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril(seq_k - seq_q)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layout: ParallelLayout, dtype=None) -> None:
        super().__init__()
        f, h, std = config.ffn_size, config.hidden_size, config.init_std
        self.gate_up_proj = ColumnParallelLinear(h, (f, f), layout, std, dtype)
        self.down_proj = RowParallelLinear(f, h, layout, std, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Attention and an MLP, or for a mixture-of-experts model's layer ``index`` (global, counted
    over the whole model) at or past ``config.moe.dense_layers`` the sparse block
    (:class:`~kareus_fx.models.moe_pricing.CountPricedMoE`, meta only; with ``exact_moe`` the
    runnable :class:`~kareus_fx.models.moe.ExpertParallelMoE` over ``layout.ep_group``) as ``mlp``."""

    def __init__(
        self,
        config: ModelConfig,
        layout: ParallelLayout,
        dtype=None,
        attention: str = "kareus",
        recompute_core: bool = False,
        index: int = 0,
        expert_imbalance: float = 1.0,
        exact_moe: bool = False,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps, dtype)
        self.self_attn = Attention(config, layout, dtype, attention, recompute_core)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps, dtype)
        moe = config.moe
        self.mlp: MLP | CountPricedMoE | ExpertParallelMoE
        if moe is None or index < moe.dense_layers:
            self.mlp = MLP(config, layout, dtype)
        elif exact_moe:
            self.mlp = ExpertParallelMoE.from_config(config.hidden_size, moe, layout.ep_group, config.init_std, dtype)
        else:
            self.mlp = CountPricedMoE(config.hidden_size, moe, layout, config.init_std, dtype, expert_imbalance)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Transformer(nn.Module):
    """The decoder-only model, or one pipeline stage of it (see the module docstring).

    ``forward(input_ids, labels)`` of the whole model returns the mean token loss; a pipeline
    stage takes ``input_ids`` (first stage) or ``hidden`` (the others), plus ``labels`` on the
    last stage, and returns the hidden states (all but the last stage) or the loss.
    ``config.num_layers`` counts the whole model's layers; the stage builds its share.
    """

    def __init__(
        self,
        config: ModelConfig,
        layout: ParallelLayout | None = None,
        dtype=None,
        attention: str = "kareus",
        stage: PipelineStage | None = None,
        recompute: str = "none",
        expert_imbalance: float = 1.0,
        exact_moe: bool = False,
    ) -> None:
        super().__init__()
        self.recompute = check_recompute(recompute)
        layout = layout or ParallelLayout()
        stage = stage or PipelineStage()
        config.check_parallel(layout.tp, layout.cp, layout.ep)
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {attention!r}")
        self.config, self.layout, self.stage = config, layout, stage
        self.layer_range = stage_layer_range(config.num_layers, stage.num_stages, stage.index, stage.layer_counts)
        h, std = config.hidden_size, config.init_std
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, layout, std, dtype) if stage.is_first else None
        self.rotary = RotaryEmbedding(config, layout)
        self.layers = nn.ModuleList(
            DecoderLayer(config, layout, dtype, attention, recompute == "selective", index, expert_imbalance, exact_moe)
            for index in self.layer_range
        )
        if stage.is_last:
            self.norm: RMSNorm | None = RMSNorm(h, config.norm_eps, dtype)
            self.lm_head: ColumnParallelLinear | None = ColumnParallelLinear(
                h, (config.vocab_size,), layout, std, dtype
            )
            self.tie_weights()
            self.loss_fn: VocabParallelCrossEntropy | None = VocabParallelCrossEntropy(config.vocab_size, layout)
        else:
            self.norm = self.lm_head = self.loss_fn = None

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """``layers`` as the :class:`DecoderLayer` s they are (``nn.ModuleList`` yields ``nn.Module``)."""
        return [layer for layer in self.layers if isinstance(layer, DecoderLayer)]

    @property
    def ties_within(self) -> bool:
        """The LM head shares the embedding's parameter (tied embeddings, one stage holds both)."""
        return self.config.tie_embeddings and self.stage.is_first and self.stage.is_last

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self._check_inputs(input_ids, labels, hidden)
        h = hidden if self.embed_tokens is None else self.embed_tokens(input_ids)  # the first stage embeds
        assert h is not None, "_check_inputs lets a stage after the first through only with hidden"
        cos, sin = self.rotary(h.shape[1], h.dtype)
        for layer in self.layers:
            h = checkpoint(layer, h, cos, sin, use_reentrant=False) if self.recompute == "full" else layer(h, cos, sin)
        if self.norm is None or self.lm_head is None or self.loss_fn is None:
            return h  # a stage before the last hands its hidden state on
        return self.loss_fn(self.lm_head(self.norm(h)), labels)

    def _check_inputs(self, input_ids, labels, hidden) -> None:
        """Raise a ValueError naming the inputs this stage needs and those it does not take."""
        wanted = {
            "input_ids": self.stage.is_first,
            "hidden": not self.stage.is_first,
            "labels": self.stage.is_last,
        }
        given = {"input_ids": input_ids, "hidden": hidden, "labels": labels}
        missing = [name for name, needed in wanted.items() if needed and given[name] is None]
        extra = [name for name, needed in wanted.items() if not needed and given[name] is not None]
        if missing or extra:
            problems = [
                f"{verb} {', '.join(map(repr, names))}"
                for verb, names in (("needs", missing), ("does not take", extra))
                if names
            ]
            raise ValueError(
                f"{self.stage.role} pipeline stage {self.stage.index} of {self.stage.num_stages} "
                f"{' and '.join(problems)}; pass the inputs its example_batch() returns"
            )

    def tie_weights(self) -> None:
        """Share the embedding with the LM head if the config ties them and this stage has both."""
        if self.ties_within and self.lm_head is not None and self.embed_tokens is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def full_parameter_name(self, name: str) -> str:
        """The whole model's name of this stage's parameter ``name`` (``layers.i`` renumbered)."""
        if not name.startswith("layers."):
            return name
        _, local, rest = name.split(".", 2)
        return f"layers.{self.layer_range[int(local)]}.{rest}"

    def init_weights(self, seed: int | None = None) -> None:
        """Re-tie and re-initialise every parameter and buffer (e.g. after ``to_empty``).

        Linear and embedding weights are N(0, init_std), norms are ones: the same draws, in the
        same order, as building the model after ``torch.manual_seed(seed)``. Each rank draws its
        own shards, so a sharded model is not a shard of an unsharded one with the same seed:
        use :meth:`load_full_state_dict` for that.

        A tied last stage of a pipeline draws its own ``lm_head.weight``: copy the first stage's
        embedding into it (or use :meth:`load_full_state_dict`) to tie them.
        """
        self.tie_weights()  # to_empty gives each use of a shared parameter its own copy
        if seed is not None:
            torch.manual_seed(seed)
        for module in self.modules():
            if module is not self.lm_head or not self.ties_within:
                reset = getattr(module, "reset_parameters", None)
                if reset is not None:
                    reset()

    def shard_full_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's shards of the unsharded tensors in ``full`` (parameters or gradients).

        ``full`` is keyed by the whole model's names; the result by this stage's names (see
        :meth:`full_parameter_name`). Keys of ``full`` that name no parameter of this stage are
        ignored. The ``lm_head.weight`` of a tied last stage without the embedding comes from
        ``full["embed_tokens.weight"]`` when ``full`` has no ``lm_head.weight`` (a weight copy; for
        gradients the tied weight's gradient is the sum of the two copies' gradients).
        """
        out = {}
        for mod_name, module in self.named_modules():
            for p_name, _ in module.named_parameters(recurse=False):
                key = f"{mod_name}.{p_name}" if mod_name else p_name
                source = self.full_parameter_name(key)
                if source == "lm_head.weight" and source not in full and self.config.tie_embeddings:
                    source = "embed_tokens.weight"
                if source in full:
                    shard = getattr(module, "shard", None)
                    out[key] = full[source] if shard is None else shard(full[source])
        return out

    def load_full_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        """Load an unsharded model's state dict onto this rank's shards."""
        sharded = self.shard_full_state_dict(full)
        missing = {n for n, _ in self.named_parameters()} - set(sharded)
        if missing:
            raise KeyError(f"state dict lacks {sorted(missing)}")
        self.load_state_dict(sharded, strict=False)  # a tied lm_head.weight may be absent

    @torch.no_grad()
    def finalize_grads(self) -> None:
        """Gradient reductions a training step does after backward, outside the step's graph.

        Sums the partial gradients of parameters shared across TP ranks but used on sharded
        data (the QK-norm weights) over the TP group, and averages every gradient over the CP
        group (the full-sequence loss is the mean of the CP ranks' chunk losses).
        """
        tp_group, cp_group = self.layout.tp_group, self.layout.cp_group
        if tp_group is not None and self.config.qk_norm:
            for layer in self.decoder_layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    if norm is not None and norm.weight.grad is not None:
                        dist.all_reduce(norm.weight.grad, group=tp_group)
        if cp_group is not None:
            for p in self.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=cp_group)
                    p.grad.div_(self.layout.cp)

    def example_batch(
        self, mbs: int, seq: int, device: torch.device | str | None = None, seed: int = 0
    ) -> dict[str, torch.Tensor]:
        """Random inputs of this stage for this CP rank, each [mbs, seq / cp, ...].

        ``input_ids`` (first stage) and aligned ``labels`` (last stage): every rank draws the same
        full [mbs, seq + 1] token sequence from ``seed`` and keeps its chunk, so each stage's
        tokens are the whole model's. ``hidden`` (every stage but the first): N(0, 1) activations
        [mbs, seq / cp, hidden_size] in the model's dtype with ``requires_grad``, drawn after the
        tokens from the same generator. On the meta device the tensors have shapes only.
        """
        cp = self.layout.cp
        if seq % cp:
            raise ParallelConfigError(f"seq={seq} is not divisible by cp={cp}")
        device = torch.device(device) if device is not None else torch.get_default_device()
        chunk = seq // cp
        dtype = self.decoder_layers[0].input_layernorm.weight.dtype
        hidden_shape = (mbs, chunk, self.config.hidden_size)
        if device.type == "meta":
            ids = torch.empty(mbs, chunk, dtype=torch.long, device=device)
            labels = torch.empty_like(ids)
            hidden = None if self.stage.is_first else torch.empty(hidden_shape, dtype=dtype, device=device)
        else:
            gen = torch.Generator().manual_seed(seed)
            tokens = torch.randint(self.config.vocab_size, (mbs, seq + 1), generator=gen)
            lo = self.layout.cp_rank * chunk
            ids = tokens[:, lo : lo + chunk].to(device)
            labels = tokens[:, lo + 1 : lo + chunk + 1].to(device)
            hidden = None if self.stage.is_first else torch.randn(hidden_shape, generator=gen).to(device, dtype)
        batch = {"input_ids": ids} if hidden is None else {"hidden": hidden.requires_grad_()}
        if self.stage.is_last:
            batch["labels"] = labels
        return batch


def build_model(
    name: str | ModelConfig,
    layout: ParallelLayout | None = None,
    num_layers: int | None = None,
    dtype: torch.dtype = torch.float32,
    attention: str = "kareus",
    stage: PipelineStage | None = None,
    recompute: str = "none",
    expert_imbalance: float = 1.0,
    exact_moe: bool = False,
) -> Transformer:
    """The model ``name`` (see ``model_names()``) sharded for ``layout``, on the default device.

    ``num_layers=None`` keeps the config's layer count; it counts the whole model's layers also
    when ``stage`` picks one pipeline stage (``stage=None``: the whole model). Weights are N(0, init_std) drawn from
    torch's global RNG: seed it with ``torch.manual_seed`` for a reproducible model.
    ``attention``: ``"kareus"`` (``kareus::attention``, one node forward and one backward on
    every device) or ``"sdpa"`` (``F.scaled_dot_product_attention``; on meta it lowers to the
    math path with the full score matrix in the graph).
    ``recompute``: activation checkpointing, ``"none"``, ``"full"`` (every decoder layer) or
    ``"selective"`` (core attention); see ``recompute.py``.
    ``expert_imbalance``: a mixture-of-experts model's assumed busiest-expert load over the uniform
    one (``moe_pricing.py``; its sparse layers build and run on the meta device only).
    ``exact_moe``: the sparse layers are the exact, runnable expert-parallel layer instead
    (``moe.py``; ``expert_imbalance`` then has no effect).
    """
    config = get_config(name) if isinstance(name, str) else name
    return Transformer(
        config.with_layers(num_layers), layout, dtype, attention, stage, recompute, expert_imbalance, exact_moe
    )
