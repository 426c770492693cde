"""Losses: ``cross_entropy``, ``nll_loss`` and the elementwise losses (``mse_loss``, ``l1_loss``, ...).

With ``reduction="none"`` a loss is elementwise over its batch (cross-entropy over the input with
the class dim taken out, as the target is laid out). With ``"sum"`` or ``"mean"`` it reduces over
the batch: the two nanobatches' results are recombined into the whole-batch value. A class-index
cross-entropy mean is recombined from per-token losses (sum over counted tokens / count), so a
nanobatch whose targets are all ``ignore_index`` contributes nothing instead of 0/0, and the sum
accumulates in fp32 as the fused mean does in bf16/fp16. The legacy ``size_average``/``reduce``
arguments are refused.
"""

from __future__ import annotations

import torch.fx as fx

from kareus_fx.passes.batch_dims.node_args import _arg, _same_call, _set_arg
from kareus_fx.passes.batch_dims.propagation import BatchAnalysis, _node_arg, register_batch_rule
from kareus_fx.passes.batch_dims.values import BatchDim, Call, Step


@register_batch_rule("cross_entropy", "nll_loss")
def _cross_entropy_like(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    inp, tgt = _node_arg(an, node, 0), _node_arg(an, node, 1, "target")
    weight = _arg(node, 2, "weight")
    if _arg(node, 3, "size_average") is not None or _arg(node, 5, "reduce") is not None:
        raise an._fail(node, "legacy size_average/reduce arguments")
    reduction = _arg(node, 6, "reduction", "mean")
    ignore_index = _arg(node, 4, "ignore_index", -100)
    if an.info(weight) is not None:
        raise an._fail(node, "batch-carrying class weights")
    s_in = an.shape(inp)
    if len(s_in) < 2:
        raise an._fail(node, "unbatched input")
    prob_target = an.vals[tgt].dtype.is_floating_point
    # elementwise over the input with the class dim (1) taken out, as the target is laid out
    i_in, i_t = an.info(inp), an.info(tgt)
    if isinstance(i_in, BatchDim) and i_in.dim == 1:
        raise an._fail(node, "batch on the class dim")
    t_shape = an.shape(tgt)
    want = None
    if isinstance(i_in, BatchDim):
        want = i_in if prob_target else i_in.moved(i_in.dim - (i_in.dim > 1))
    if isinstance(i_t, BatchDim):
        if want is not None and want != i_t:
            raise an._fail(node, "input and target carry the batch on different dims")
        want = i_t
    if i_in is None:
        raise an._fail(node, "shared logits with batch-carrying targets")
    if want is None:
        raise an._fail(node, "neither input nor target carries the batch")
    slices = {}
    if i_t is None:
        slices.update(an._shared_slices(node, [tgt], want, t_shape))
    if reduction == "none":
        return Step(want, True, an._with_slices(node, slices))
    if reduction == "sum":
        step = an._reduction_over_batch(node, "sum")
    elif prob_target:
        step = an._reduction_over_batch(node, "mean")
    else:
        # Per-token losses per nanobatch, summed in fp32 by the recombination: exact for an
        # all-ignored nanobatch (no 0/0) and as precise as the fused mean in bf16/fp16.
        step = an._reduction_over_batch(
            node, "ce_mean", target=tgt, ignore_index=ignore_index, weight=weight, half_info=want, half_like=tgt
        )

        def per_token(h: int) -> Call:
            c = _same_call(node)
            _set_arg(c, 6, "reduction", "none")
            return c

        step.call = an._with_slices(node, slices, per_token)
        return step
    step.call = an._with_slices(node, slices)
    return step


_LOSS_REDUCTION_POS = {
    "mse_loss": 4,
    "l1_loss": 4,
    "smooth_l1_loss": 4,
    "huber_loss": 2,
    "soft_margin_loss": 4,
    "binary_cross_entropy": 5,
    "binary_cross_entropy_with_logits": 5,
}


@register_batch_rule(*_LOSS_REDUCTION_POS)
def _rule_pointwise_loss(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    operands = list(node.all_input_nodes)
    inp = _node_arg(an, node, 0)
    full = an._pointwise(node, operands, out_shape=an.shape(inp))
    pos = _LOSS_REDUCTION_POS[name]
    if name != "huber_loss" and (
        _arg(node, 2 + (name.startswith("binary")), "size_average") is not None
        or _arg(node, 3 + (name.startswith("binary")), "reduce") is not None
    ):
        raise an._fail(node, "legacy size_average/reduce arguments")
    reduction = _arg(node, pos, "reduction", "mean")
    if reduction == "none":
        return full
    step = an._reduction_over_batch(node, "sum" if reduction == "sum" else "mean")
    step.call = full.call
    return step
