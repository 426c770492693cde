"""Hand-built partitions from analytic FLOPs and bytes, for calibration, tests and benchmarks.

Real partition types come from the graph pass; these builders describe the workloads whose
measurements the cost models are calibrated and validated against, with the same conventions
as the graph pass (one :class:`OpCost` per aten-level kernel; bytes = every tensor read once
plus every output written once; elementwise ops count one FLOP per element).

- :func:`kareus_attention_tp2` is the workload of the Kareus artifact's attention-overlap
  measurements (``ml-energy/kareus`` tests/fuser/attention/overlap_test_attn.py): Megatron
  attention sub-layer, hidden 2048, 32 heads, FP16, sequence 4096, nanobatch 2, TP=2, seven
  compute ops (bias-dropout-add, LayerNorm, QKV linear, QKV post-process, RoPE, attention,
  output projection) plus the all-reduce of the other nanobatch's 4096x2x2048 FP16 output.
  Unfused RoPE (``apply_rope_fusion=False`` in that script) is Megatron's
  ``_apply_rotary_pos_emb_bshd`` op by op.
- :func:`llama_attention_partition` / :func:`llama_mlp_partition`: the Llama-3.2-3B sub-layers
  of the paper's Figure 3 (attention at TP=4) and the MLP sub-layer, nanobatch of a microbatch.
- :func:`transformer_stage_ops`: one pipeline stage (forward or backward) of a GPT-style model
  per GPU, for the frequency (Perseus stage-profile) calibration and validation.
"""

from __future__ import annotations

from dataclasses import dataclass

from kareus_fx.workload import CollectiveSpec, OpCost, PartitionType, SlotSpec

_MIB = 1024 * 1024


def gemm(name: str, m: int, k: int, n: int, dtype_bytes: int = 2, bias: bool = False) -> OpCost:
    """``[m, k] @ [k, n]`` (+ bias): 2mkn FLOPs; reads both operands, writes the output."""
    flops = 2.0 * m * k * n + (m * n if bias else 0)
    nbytes = dtype_bytes * (m * k + k * n + m * n + (n if bias else 0))
    return OpCost(name, "aten.addmm.default" if bias else "aten.mm.default", flops, float(nbytes))


def elementwise(
    name: str, numel: float, reads: float, writes: float, dtype_bytes: int = 2, target: str = "aten.add.Tensor"
) -> OpCost:
    """An elementwise-like kernel over ``numel`` elements reading ``reads`` and writing ``writes`` full tensors."""
    return OpCost(name, target, float(numel), float(dtype_bytes * numel * (reads + writes)))


def flash_attention(
    name: str,
    batch: int,
    heads: int,
    kv_heads: int,
    seq: int,
    head_dim: int,
    causal: bool = True,
    dtype_bytes: int = 2,
    backward: bool = False,
) -> OpCost:
    """Fused (flash) attention: 4*b*h*s^2*d FLOPs forward (halved when causal), 2.5x that backward."""
    flops = 4.0 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    q_bytes = batch * heads * seq * head_dim * dtype_bytes
    kv_bytes = 2 * batch * kv_heads * seq * head_dim * dtype_bytes
    nbytes = q_bytes + kv_bytes + q_bytes  # read q, k, v; write o
    if backward:
        flops *= 2.5
        nbytes = 2 * nbytes + q_bytes + kv_bytes  # read q,k,v,o,do; write dq,dk,dv
    target = "aten._scaled_dot_product_flash_attention" + ("_backward" if backward else "") + ".default"
    return OpCost(name, target, flops, float(nbytes))


def unfused_rope(name: str, tokens: int, heads: int, head_dim: int, dtype_bytes: int = 2) -> tuple[OpCost, ...]:
    """Megatron's unfused ``_apply_rotary_pos_emb_bshd`` on one [s, b, heads, head_dim] tensor.

    ``t*cos + rotate_half(t)*sin`` then the concatenation with the (empty) pass-through part:
    cos, sin (on the frequency table), mul, neg (half), cat, mul, add, cat.
    """
    n = tokens * heads * head_dim
    table = tokens * head_dim  # the (s, 1, 1, d) frequency table, broadcast over batch and heads
    return (
        elementwise(f"{name}.cos", table, 1, 1, dtype_bytes, "aten.cos.default"),
        elementwise(f"{name}.sin", table, 1, 1, dtype_bytes, "aten.sin.default"),
        elementwise(f"{name}.mul_cos", n, 1, 1, dtype_bytes, "aten.mul.Tensor"),
        elementwise(f"{name}.neg", n / 2, 1, 1, dtype_bytes, "aten.neg.default"),
        elementwise(f"{name}.cat_half", n, 1, 1, dtype_bytes, "aten.cat.default"),
        elementwise(f"{name}.mul_sin", n, 1, 1, dtype_bytes, "aten.mul.Tensor"),
        elementwise(f"{name}.add", n, 2, 1, dtype_bytes, "aten.add.Tensor"),
        elementwise(f"{name}.cat_pass", n, 1, 1, dtype_bytes, "aten.cat.default"),
    )


def kareus_attention_tp2(count: int = 1) -> PartitionType:
    """The Kareus artifact's attention-overlap workload (see the module docstring), one slot per op."""
    seq, nano, hidden, heads, tp = 4096, 2, 2048, 32, 2
    head_dim = hidden // heads
    tokens = seq * nano
    local_heads = heads // tp
    qkv_out = 3 * hidden // tp
    n_hidden = tokens * hidden
    slots = (
        # bias-dropout-add (one fused kernel): read x, residual; write out and the dropout mask (1 byte).
        SlotSpec((OpCost("bda", "fused_bias_dropout_add", 3.0 * n_hidden, 2.0 * 3 * n_hidden + n_hidden),)),
        SlotSpec((elementwise("layernorm", n_hidden, 1, 1, 2, "aten.native_layer_norm.default"),)),
        SlotSpec((gemm("linear_qkv", tokens, hidden, qkv_out, bias=True),)),
        # split of the fused QKV output into contiguous q, k, v.
        SlotSpec(
            tuple(
                elementwise(f"qkv_split.{t}", tokens * local_heads * head_dim, 1, 1, 2, "aten.clone.default")
                for t in "qkv"
            )
        ),
        SlotSpec(
            unfused_rope("rope_q", tokens, local_heads, head_dim)
            + unfused_rope("rope_k", tokens, local_heads, head_dim)
        ),
        SlotSpec((flash_attention("attention", nano, local_heads, local_heads, seq, head_dim, causal=True),)),
        SlotSpec((gemm("linear_proj", tokens, hidden // tp, hidden, bias=True),)),
    )
    collective = CollectiveSpec("all_reduce", float(2 * n_hidden), group_size=tp)
    return PartitionType(
        type_id="kareus_attention_tp2_fwd",
        graph="forward",
        slots=slots,
        collective=collective,
        count=count,
        launch_slots=tuple(range(len(slots))),
    )


@dataclass(frozen=True)
class LlamaShape:
    """Dimensions of a Llama-style decoder layer."""

    hidden: int
    heads: int
    kv_heads: int
    ffn: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA_3_2_3B = LlamaShape(hidden=3072, heads=24, kv_heads=8, ffn=8192)


def llama_attention_partition(
    shape: LlamaShape = LLAMA_3_2_3B,
    tp: int = 4,
    nanobatch: int = 4,
    seq: int = 4096,
    count: int = 1,
) -> PartitionType:
    """Attention sub-layer of one nanobatch (RMSNorm, QKV, RoPE, flash attention, output projection)
    plus the all-reduce of the other nanobatch's attention output (paper Figure 3)."""
    tokens = nanobatch * seq
    n_hidden = tokens * shape.hidden
    q_heads, kv_heads = shape.heads // tp, max(1, shape.kv_heads // tp)
    qkv_out = (q_heads + 2 * kv_heads) * shape.head_dim
    rope_elems = tokens * (q_heads + kv_heads) * shape.head_dim
    slots = (
        SlotSpec((elementwise("rmsnorm", n_hidden, 1, 1, 2, "aten._fused_rms_norm.default"),)),
        SlotSpec((gemm("linear_qkv", tokens, shape.hidden, qkv_out),)),
        SlotSpec((elementwise("rope", rope_elems, 1, 1, 2, "rope"),)),
        SlotSpec((flash_attention("flash_attention", nanobatch, q_heads, kv_heads, seq, shape.head_dim),)),
        SlotSpec((gemm("linear_out", tokens, q_heads * shape.head_dim, shape.hidden),)),
    )
    return PartitionType(
        type_id=f"llama_attn_tp{tp}_fwd",
        graph="forward",
        slots=slots,
        collective=CollectiveSpec("all_reduce", float(2 * n_hidden), group_size=tp),
        count=count,
        launch_slots=tuple(range(len(slots))),
    )


def llama_mlp_partition(
    shape: LlamaShape = LLAMA_3_2_3B,
    tp: int = 4,
    nanobatch: int = 4,
    seq: int = 4096,
    count: int = 1,
) -> PartitionType:
    """MLP sub-layer of one nanobatch (RMSNorm, gate/up, SwiGLU, down) plus the other nanobatch's all-reduce."""
    tokens = nanobatch * seq
    n_hidden = tokens * shape.hidden
    ffn = shape.ffn // tp
    slots = (
        SlotSpec((elementwise("rmsnorm", n_hidden, 1, 1, 2, "aten._fused_rms_norm.default"),)),
        SlotSpec((gemm("linear_gate_up", tokens, shape.hidden, 2 * ffn),)),
        SlotSpec((elementwise("swiglu", tokens * ffn, 2, 1, 2, "aten.mul.Tensor"),)),
        SlotSpec((gemm("linear_down", tokens, ffn, shape.hidden),)),
    )
    return PartitionType(
        type_id=f"llama_mlp_tp{tp}_fwd",
        graph="forward",
        slots=slots,
        collective=CollectiveSpec("all_reduce", float(2 * n_hidden), group_size=tp),
        count=count,
        launch_slots=tuple(range(len(slots))),
    )


@dataclass(frozen=True)
class GPTShape:
    """A GPT-style (LayerNorm, GELU MLP, multi-head attention) model.

    ``attention`` names how the attention core runs: ``"flash"`` (one fused kernel), or the
    unfused HuggingFace implementations that Perseus' Merak-based training ran: ``"gpt2"``
    (matmul, scale, causal mask, softmax, dropout, matmul) or ``"bloom"`` (baddbmm with ALiBi,
    mask, softmax in FP32, cast back, dropout, bmm).
    """

    hidden: int
    heads: int
    layers: int
    vocab: int
    ffn_mult: int = 4
    attention: str = "flash"


GPT3_175B = GPTShape(hidden=12288, heads=96, layers=96, vocab=51200, attention="gpt2")
BLOOM_176B = GPTShape(hidden=14336, heads=112, layers=70, vocab=250880, attention="bloom")


def _attention_core(style: str, batch: int, heads: int, seq: int, head_dim: int) -> list[OpCost]:
    """The attention core's kernels for one GPU's heads (see :class:`GPTShape`)."""
    if style == "flash":
        return [flash_attention("attention", batch, heads, heads, seq, head_dim)]
    scores = batch * heads * seq * seq
    qkv = batch * heads * seq * head_dim
    qk = OpCost("attn_scores", "aten.bmm.default", 2.0 * scores * head_dim, 2.0 * (2 * qkv + scores))
    pv = OpCost("attn_context", "aten.bmm.default", 2.0 * scores * head_dim, 2.0 * (scores + 2 * qkv))
    mask_bytes = seq * seq  # one boolean causal mask, broadcast
    dropout = OpCost("attn_dropout", "aten.native_dropout.default", scores, 2.0 * 2 * scores + scores)
    if style == "gpt2":
        return [
            qk,
            elementwise("attn_scale", scores, 1, 1, 2, "aten.div.Tensor"),
            OpCost("attn_mask", "aten.where.self", scores, 2.0 * 2 * scores + mask_bytes),
            elementwise("attn_softmax", scores, 1, 1, 2, "aten._softmax.default"),
            dropout,
            pv,
        ]
    if style == "bloom":
        return [
            OpCost("attn_scores", "aten.baddbmm.default", 2.0 * scores * head_dim, 2.0 * (2 * qkv + 2 * scores)),
            OpCost("attn_mask", "aten.masked_fill.Scalar", scores, 2.0 * 2 * scores + mask_bytes),
            OpCost("attn_softmax", "aten._softmax.default", scores, 2.0 * scores + 4.0 * scores),
            OpCost("attn_cast", "aten._to_copy.default", scores, 4.0 * scores + 2.0 * scores),
            dropout,
            pv,
        ]
    raise ValueError(f"unknown attention style {style!r}; use 'flash', 'gpt2' or 'bloom'")


def _gpt_layer_forward(shape: GPTShape, tokens: int, batch: int, seq: int, tp: int) -> list[OpCost]:
    h, ffn = shape.hidden, shape.ffn_mult * shape.hidden
    local_heads = shape.heads // tp
    n = tokens * h
    return [
        elementwise("ln1", n, 1, 1, 2, "aten.native_layer_norm.default"),
        gemm("qkv", tokens, h, 3 * h // tp, bias=True),
        *_attention_core(shape.attention, batch, local_heads, seq, h // shape.heads),
        gemm("proj", tokens, h // tp, h, bias=True),
        elementwise("dropout_add1", n, 2, 1),
        elementwise("ln2", n, 1, 1, 2, "aten.native_layer_norm.default"),
        gemm("fc1", tokens, h, ffn // tp, bias=True),
        elementwise("gelu", tokens * ffn // tp, 1, 1, 2, "aten.gelu.default"),
        gemm("fc2", tokens, ffn // tp, h, bias=True),
        elementwise("dropout_add2", n, 2, 1),
    ]


def _backward_of(op: OpCost) -> list[OpCost]:
    """Backward kernels of a forward op: data and weight gradient GEMMs, or a 2x elementwise pass."""
    if op.target.startswith("aten._scaled_dot_product"):
        return [
            OpCost(op.name + ".bwd", op.target.replace(".default", "_backward.default"), 2.5 * op.flops, 2.5 * op.bytes)
        ]
    if op.target in ("aten.addmm.default", "aten.mm.default", "aten.bmm.default", "aten.baddbmm.default"):
        return [
            OpCost(op.name + ".dgrad", "aten.mm.default", op.flops, op.bytes),
            OpCost(op.name + ".wgrad", "aten.mm.default", op.flops, op.bytes),
        ]
    return [OpCost(op.name + ".bwd", op.target, 2 * op.flops, 2 * op.bytes)]


def transformer_stage_ops(
    shape: GPTShape,
    stage: int,
    stages: int = 8,
    tp: int = 8,
    batch: int = 1,
    seq: int = 2048,
    backward: bool = False,
) -> tuple[list[OpCost], list[CollectiveSpec]]:
    """One GPU's kernels of one pipeline stage (layers split evenly; the last stage adds the LM head
    and the loss) and its tensor-parallel collectives (two all-reduces per layer and pass)."""
    tokens = batch * seq
    per_stage = -(-shape.layers // stages)
    layers = min(per_stage, shape.layers - per_stage * stage) if stage == stages - 1 else per_stage
    ops: list[OpCost] = []
    for _ in range(layers):
        ops.extend(_gpt_layer_forward(shape, tokens, batch, seq, tp))
    if stage == stages - 1:
        ops.append(elementwise("final_ln", tokens * shape.hidden, 1, 1, 2, "aten.native_layer_norm.default"))
        ops.append(gemm("lm_head", tokens, shape.hidden, shape.vocab // tp))
        ops.append(elementwise("cross_entropy", tokens * shape.vocab // tp, 1, 1, 4, "aten._log_softmax.default"))
    if backward:
        ops = [b for op in reversed(ops) for b in _backward_of(op)]
    collective = CollectiveSpec("all_reduce", float(2 * tokens * shape.hidden), group_size=tp)
    return ops, [collective] * (2 * layers)
