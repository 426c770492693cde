"""Attention: ``scaled_dot_product_attention``, the ``kareus::attention`` op, ``flex_attention``.

Attention over ``[..., seq, dim]`` treats every leading (batch, head) index on its own, so it is
exact per nanobatch when q, k and v carry the batch on the same leading dim (shared keys and values
are sliced); the batch may not enter through the mask alone, and shared queries cannot attend over
batch-carrying keys. Attention dropout draws random numbers and needs ``allow_rng``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from kareus_fx.passes.batch_dims.node_args import _arg
from kareus_fx.passes.batch_dims.propagation import BatchAnalysis, register_batch_rule
from kareus_fx.passes.batch_dims.values import BatchDim, IndexOffsetBody, SliceOf, Step, Whole, _is_split


@register_batch_rule("scaled_dot_product_attention")
def _rule_sdpa(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    if _arg(node, 4, "dropout_p", 0.0) and not an.allow_rng:
        raise an._fail(node, "attention dropout draws random numbers; pass allow_rng=True")
    return _attention(an, node, node.args[0], _arg(node, 1, "key"), _arg(node, 2, "value"), _arg(node, 3, "attn_mask"))


@register_batch_rule("kareus.attention")
def _rule_kareus_attention(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """``kareus::attention(q, k, v, scale)``: causal attention per (batch, head), no mask."""
    return _attention(an, node, node.args[0], node.args[1], node.args[2], None)


def _attention(an: BatchAnalysis, node: fx.Node, q, k, v, mask) -> Step:
    """Attention over ``[..., seq, dim]``: every leading (batch, head) index is independent."""
    out_shape = an.shape(node)
    nd = len(out_shape)
    out = None
    for t in (q, k, v):
        i = an.info(t)
        if isinstance(i, BatchDim):
            if len(an.shape(t)) != nd or i.dim >= nd - 2:
                raise an._fail(node, "batch in the sequence or feature dims of q/k/v")
            if out is not None and out != i:
                raise an._fail(node, "q/k/v carry the batch on different dims")
            out = i
    if out is None:
        raise an._fail(node, "batch enters only through the mask")
    if an.info(q) is None:
        raise an._fail(node, "shared queries attend over batch-carrying keys")
    slices = an._shared_slices(node, [k, v], out, out_shape)
    if mask is not None:
        scores = out_shape[:-1] + (an.shape(k)[-2],)
        mi = an.info(mask)
        if isinstance(mi, BatchDim) and mi.moved(mi.dim + nd - len(an.shape(mask))) != out:
            raise an._fail(node, "mask carries the batch on another dim")
        slices.update(an._shared_slices(node, [mask], out, scores))
    return Step(out, True, an._with_slices(node, slices))


@register_batch_rule("hop.flex_attention")
def _rule_flex_attention(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """``flex_attention(q, k, v, score_mod, block_mask, scale, kernel_options, score_buffers, mask_buffers)``.

    Every batch element attends on its own, so each nanobatch runs the op on its rows of q, k, v
    and of every batched ``BlockMask`` tensor (block counts and indices with dim 0 = batch; dim 0
    of 1 broadcasts and is shared). The score and mask functions see a batch index ``b``: a
    nanobatch's copy gets ``b`` shifted by its first element, so it reads the buffers it captures
    (document ids, padding masks) at the rows the unsplit call reads; those buffers are passed
    whole (a batch-carrying one must be a graph input, whose full value the split graph has).
    """
    if len(node.args) != 9:
        raise an._fail(node, f"{len(node.args)} arguments, expected 9 (the torch 2.13 flex_attention signature)")
    args: tuple[Any, ...] = tuple(node.args)
    q, k, v, score_mod, block_mask, _scale, _options, score_buffers, mask_buffers = args
    qi = an.info(q)
    if qi != BatchDim(0):
        raise an._fail(node, f"queries carry the batch as {qi!r}, not on dim 0")
    for t in (k, v):
        if an.info(t) not in (None, qi):
            raise an._fail(node, "keys or values carry the batch unlike the queries")
    subs: dict[int, Any] = dict(an._shared_slices(node, [k, v], qi, an.shape(q)))
    mask_fn = block_mask[-1]
    for part in block_mask[:-1]:
        if not isinstance(part, fx.Node):
            continue
        info = an.info(part)
        if info is None and an.shape(part)[0] == an.batch and an.batch != 1:
            subs[id(part)] = SliceOf(part, qi)
        elif info not in (None, qi) or (info is None and an.shape(part)[0] != 1):
            raise an._fail(node, f"block mask tensor {part.name} is neither batched on dim 0 nor broadcast")
    for buf in (*score_buffers, *mask_buffers):
        if isinstance(buf, fx.Node) and _is_split(an.info(buf)):
            if buf.op != "placeholder":
                raise an._fail(node, f"score/mask buffer {buf.name} is computed from batch data inside the graph")
            subs[id(buf)] = Whole(buf)
    for fn, pos in ((score_mod, 1), (mask_fn, 0)):
        if not isinstance(fn, fx.Node) or fn.op != "get_attr":
            raise an._fail(node, "score or mask function is not a graph attribute")
        subs[id(fn)] = IndexOffsetBody(str(fn.target), pos)
    outs = tuple(qi if isinstance(o, torch.Tensor) else None for o in an.vals[node])
    return Step(outs, True, an._with_slices(node, subs))
